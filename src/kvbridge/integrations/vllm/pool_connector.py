"""`KVBridgePoolConnector`: a prefix cache in Mooncake Store that `vllm serve` instances of any shape share.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgePoolConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"master": "10.0.0.5:50051",
                                                         "secret_file": "/etc/kvbridge/pool.key"}}'

It follows vLLM's scheduler hooks as its OffloadingConnector does, with the shared pool
(`kvbridge.pool`) as the medium:

* lookup at scheduling: `get_num_new_matched_tokens` hashes the prompt in pool blocks
  (`block_tokens`, the same on every instance: kvbridge's chained SHA-256 of token ids, which
  no engine's block size or hash seed changes) and asks the store which leading blocks are
  complete; the hit beyond the local prefix-cache hit is reported as external (vLLM counts it in
  `vllm:external_prefix_cache_hits`) and loaded asynchronously;
* load: the allocated blocks go to every worker rank, which at the start of the step that
  computes the rest of the prompt fetches the objects its heads need, checks their seals and
  copies them in (`PoolTier.load`; `load_async: true` makes it vLLM's asynchronous load, two
  engine steps later); a chunk that fails leaves its blocks untouched and reports them in
  `get_block_ids_with_load_errors` (and the request in `failed_recving` when asynchronous), and
  vLLM recomputes them (`kv_load_failure_policy: recompute`; vLLM's default `fail` fails the
  request);
* store after compute: when a request finishes, its full pool blocks that the store lacks are
  stored by every rank (the objects each writes), its blocks held until then
  (`request_finished` -> True, released by `finished_sending`).

Limits, each refused in one line at start: one KV-cache group of full attention (no hybrid or
sliding-window models through vLLM yet; the pool itself handles them, see `proofs/pool_demo`),
no MLA, an engine block size that divides `block_tokens`. Stores happen when a request
finishes, not while it decodes.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)
from vllm.logger import init_logger

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError, IncompatibleEngines
from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec
from kvbridge.integrations.vllm.registration import spec_and_layout
from kvbridge.offload.keys import chained_block_hashes, group_keys
from kvbridge.offload.scheduling import load_job, store_job
from kvbridge.offload.spec import GPULoadStoreSpec
from kvbridge.pool.store import PoolUnavailable, StoreClient, StoreConfig
from kvbridge.pool.tier import PoolConfig, PoolIndex, PoolTier
from kvbridge.transport.cache import RankCache

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")
MAX_FINISHED_IDS = 1 << 16


def vllm_staging(block_tokens: int, slots: int) -> EngineLayout:
    """Pool objects of vLLM CPU caches are cut from vLLM CPU's own layout at TP 1: there a head's
    transposed K and its V are one run (in the canonical layout, each K dimension is a component
    of its own: 34 runs per object, and Mooncake's per-task cost made loads slower than prefill)."""
    return vllm_cpu_layout(1, block_tokens, slots)


class PoolSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config` of KVBridgePoolConnector; an unknown key is refused (named).

    `load_async` hands loads to vLLM's asynchronous path (the request waits two more engine
    steps); by default a load runs at the start of the step that computes the rest of the prompt.

    `master` is the `mooncake_master` RPC address; its metadata server defaults to the next port
    (as `kvbridge.pool.MooncakeMaster` starts it). `model_id` defaults to the model path vLLM
    serves; `block_tokens` must be the same on every instance and a multiple of each one's block
    size. The seal key comes from `secret_file` (mode 0600) or `secret`; `insecure: true` seals
    with a checksum only.
    """

    master: str
    metadata_url: str = ""
    model_id: str = ""
    block_tokens: int = 64
    staging_blocks: int = 64
    segment_mib: int = 64
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    load: bool = True
    store: bool = True
    load_async: bool = False
    secret_file: str = ""
    secret: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        if not (self.secret_file or self.secret or self.insecure):
            raise ConfigError("KVBridgePoolConnector needs a seal secret: set kv_connector_extra_config secret_file "
                              "(or secret), the same on every instance, or insecure: true")
        if not 0 <= self.segment_mib <= 1 << 20:
            raise ConfigError(f"KVBridgePoolConnector segment_mib must be in [0, 2^20], got {self.segment_mib}")

    def store_config(self, lend: bool) -> StoreConfig:
        host, _, port = self.master.rpartition(":")
        url = self.metadata_url or (f"http://{host}:{int(port) + 1}/metadata" if port.isdigit() else "")
        return StoreConfig(self.master, url, self.local_hostname, self.protocol,
                           segment_bytes=(self.segment_mib << 20) if lend else 0)

    def pool_config(self, model: str) -> PoolConfig:
        secret = self.secret.encode()
        if self.secret_file:
            try:
                with open(self.secret_file, "rb") as f:
                    secret = f.read(4096).strip()
            except OSError as e:
                raise ConfigError(f"KVBridgePoolConnector secret_file {self.secret_file!r}: {e.strerror}") from None
            if os.stat(self.secret_file).st_mode & 0o077:
                raise ConfigError(f"KVBridgePoolConnector secret_file {self.secret_file!r} is readable by others; "
                                  f"chmod 600 it")
        return PoolConfig(model_id=self.model_id or model, block_tokens=self.block_tokens,
                          staging_blocks=self.staging_blocks, secret=secret)


def pool_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ModelSpec:
    """The spec every rank registers, from the configs alone (the scheduler has no tensors)."""
    mc = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or getattr(kv_cache_config, "has_mamba_layers", False):
        raise IncompatibleEngines(f"KVBridgePoolConnector serves one KV-cache group of full attention; this model "
                                  f"has {len(groups)} groups (hybrid or sliding-window models are not supported yet)")
    if mc.use_mla:
        raise IncompatibleEngines("KVBridgePoolConnector does not serve MLA models through vLLM yet")
    kv = groups[0].kv_cache_spec
    if getattr(kv, "sliding_window", None):
        raise IncompatibleEngines("KVBridgePoolConnector serves full attention only; this model slides a window")
    heads, head = mc.get_total_num_kv_heads(), int(kv.head_size)
    layers = tuple(LayerSpec("full", heads, head, head) for _ in groups[0].layer_names)
    return vllm_cpu_spec(ModelSpec(layers, normalize_dtype(str(kv.dtype)), str(mc.model)))


@dataclass
class PoolJob:
    """One request's load or store: its pool keys and the device side (`GPULoadStoreSpec` fields)."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]

    def gpu(self) -> GPULoadStoreSpec:
        return GPULoadStoreSpec(self.block_ids, self.group_sizes, self.block_indices)


@dataclass
class PoolMetadata(KVConnectorMetadata):
    loads: list[PoolJob] = field(default_factory=list)
    stores: list[PoolJob] = field(default_factory=list)


class KVBridgePoolConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's shared pool behind vLLM's KVConnectorBase_V1 (see the module doc).

    `SupportsHMA` so that vLLM's MultiConnector can pair it with `KVBridgeConnector`; the model
    still has one KV-cache group (`pool_spec` refuses others)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        try:
            self.settings = msgspec.convert(extra, PoolSettings)
        except msgspec.ValidationError as e:
            raise ConfigError(f"KVBridgePoolConnector kv_connector_extra_config: {e}") from None
        self.spec = pool_spec(vllm_config, kv_cache_config)
        self.config = self.settings.pool_config(str(vllm_config.model_config.model))
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.config.block_tokens % self.block_size:
            raise ConfigError(f"KVBridgePoolConnector block_tokens {self.config.block_tokens} is not a multiple of "
                              f"this engine's block size {self.block_size}")
        self._scheduler = _PoolScheduler(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _PoolWorker(self) if role == KVConnectorRole.WORKER else None

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.lookup(request, num_computed_tokens)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads run whole in `start_load_kv`, before the forward; nothing per layer."""

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.take_meta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids[0]) if len(block_ids) == 1 else False, None

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, PoolMetadata):
            self._worker.run(meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Stores read finished requests' blocks; nothing per layer."""

    def wait_for_save(self):
        """Stores run at the next step's start, from blocks vLLM holds for them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self._worker.results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


class _PoolScheduler:
    def __init__(self, conn: KVBridgePoolConnector):
        self.conn = conn
        self.bt = conn.config.block_tokens
        self.factor = self.bt // conn.block_size
        self._client: StoreClient | None = None
        self._index: PoolIndex | None = None
        self._pending: dict[str, tuple[list[bytes], int]] = {}
        self._loaded: set[str] = set()  # requests a load was scheduled for (until they finish)
        self._meta = PoolMetadata()
        self.stats = {"lookups": 0, "hit_tokens": 0, "stores": 0}

    def _idx(self) -> PoolIndex | None:
        if self._index is None:
            try:
                self._client = StoreClient(self.conn.settings.store_config(lend=False))
            except PoolUnavailable as e:
                logger.warning("KVBridgePoolConnector: store unreachable, serving without it: %s", e)
                return None
            self._index = PoolIndex(self.conn.spec, self._client, self.conn.config, vllm_staging)
        return self._index

    def _keys(self, tokens: list[int]) -> list[bytes]:
        return group_keys(chained_block_hashes(tokens, self.bt), 0)

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.conn.settings.load or request.request_id in self._loaded:
            return 0, False  # one load per request: after a refused one, vLLM recomputes (no retry loop)
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self.bt  # vLLM computes at least the last token itself
        if usable * self.bt <= num_computed_tokens or (index := self._idx()) is None:
            return 0, False
        keys = self._keys(tokens[:usable * self.bt])
        self.stats["lookups"] += 1
        hits = 0
        for present in index.hits(keys):
            if present is not True:
                break
            hits += 1
        tokens_hit = hits * self.bt
        logger.debug("KVBridgePoolConnector: %s: %d of %d pool blocks complete, %d tokens computed here",
                     request.request_id, hits, len(keys), num_computed_tokens)
        if tokens_hit <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = (keys[:hits], tokens_hit)
        self.stats["hit_tokens"] += tokens_hit - num_computed_tokens
        # Synchronous by default: the worker loads at the start of the very step that computes the
        # rest of the prompt (an asynchronous load costs two more engine steps before the request
        # runs, which on a busy CPU engine cost more than the tokens it saved).
        return tokens_hit - num_computed_tokens, self.conn.settings.load_async

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pending = self._pending.pop(request.request_id, None)
        if not num_external_tokens or pending is None:
            return
        keys, tokens_hit = pending
        self._loaded.add(request.request_id)
        local = tokens_hit - num_external_tokens
        table = [int(b) for b in blocks.get_block_ids()[0]][: tokens_hit // self.conn.block_size]
        on_device = [i < local // self.conn.block_size for i in range(len(table))]
        load_keys, gpu = load_job([table], [keys], tokens_hit, self.conn.block_size, self.factor, [on_device])
        self._meta.loads.append(PoolJob(request.request_id, load_keys, gpu.block_ids.tolist(), gpu.group_sizes,
                                        gpu.block_indices))

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """Queue the store of the request's full pool blocks that the store lacks; True: hold its blocks."""
        self._loaded.discard(request.request_id)
        self._pending.pop(request.request_id, None)
        if not self.conn.settings.store or (index := self._idx()) is None:
            return False
        n = min(int(request.num_computed_tokens), len(request.all_token_ids)) // self.bt
        table = [int(b) for b in block_ids][: n * self.factor]
        n = min(n, len(table) // self.factor)
        if n <= 0:
            return False
        keys = self._keys(list(request.all_token_ids)[: n * self.bt])
        missing = [k for k, present in zip(keys, index.hits(keys)) if present is not True]
        if not missing:
            return False
        logger.debug("KVBridgePoolConnector: %s finished: storing %d of its %d pool blocks", request.request_id,
                     len(missing), len(keys))
        gpu = store_job([table], [keys], missing, self.factor)
        self._meta.stores.append(PoolJob(request.request_id, missing, gpu.block_ids.tolist(), gpu.group_sizes,
                                         gpu.block_indices))
        self.stats["stores"] += 1
        return True

    def take_meta(self) -> PoolMetadata:
        meta, self._meta = self._meta, PoolMetadata()
        return meta

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class _PoolWorker:
    """One engine rank: its store client and tier, jobs run at the step's start."""

    def __init__(self, conn: KVBridgePoolConnector):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.conn = conn
        self.rank = get_tensor_model_parallel_rank()
        self.tp_size = conn._vllm_config.parallel_config.tensor_parallel_size
        self._caches: dict[str, torch.Tensor] = {}
        self._tier: PoolTier | None = None
        self._client: StoreClient | None = None
        self._stored: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()  # recent finished ids (bounded)
        self._res = KVConnectorTransferResults()
        self._failed_blocks: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec, layout, names = spec_and_layout(self.conn._vllm_config, self.conn._kv_cache_config, kv_caches,
                                              self.tp_size)
        if spec.fingerprint() != self.conn.spec.fingerprint() or spec.num_layers != self.conn.spec.num_layers:
            raise IncompatibleEngines(f"KVBridgePoolConnector: the registered cache ({spec.describe()}) differs from "
                                      f"the one the scheduler derived from the configs ({self.conn.spec.describe()})")
        self._caches = kv_caches
        # The VllmCpuLayout itself: its addressing places K transposed per head (a plain
        # EngineLayout of the same fields describes other bytes, and same-shape round trips hid it).
        self._names, self._spec, self._layout = names, spec, layout

    def _ensure_tier(self) -> PoolTier:
        # Built at first use: another connector (MultiConnector) may re-point the cache tensors at
        # registration; the tensors themselves are what vLLM computes into.
        if self._tier is None:
            cache = RankCache(self._spec, self._layout, self.rank, [self._caches[n] for n in self._names])
            self._client = StoreClient(self.conn.settings.store_config(lend=self.conn.settings.segment_mib > 0))
            # Serial copies: numba's parallel (OpenMP) runtime in a vLLM CPU worker changed the
            # thread count its attention kernels check ("thread_num 1 vs. 2") and killed the engine.
            self._tier = PoolTier(cache, self._client, self.conn.config, parallel=False, staging=vllm_staging)
            logger.info("KVBridgePoolConnector rank %d: %s; pool at %s, %d-token blocks, writes %d and reads %d "
                        "objects per block", self.rank, self._layout.describe(), self.conn.settings.master,
                        self.conn.config.block_tokens, len(self._tier.writes[0]), len(self._tier.reads[0]))
        return self._tier

    def run(self, meta: PoolMetadata) -> None:
        if not (meta.loads or meta.stores) or not self._caches:
            return
        tier = self._ensure_tier()
        for job in meta.stores:
            res = tier.store(job.gpu(), job.keys)
            if not res.ok:
                logger.warning("KVBridgePoolConnector rank %d: store of %s incomplete: %s", self.rank,
                               job.request_id, "; ".join(res.reasons)[:500])
            self._stored.add(job.request_id)
        for job in meta.loads:
            res = tier.load(job.keys, job.gpu())
            if self.conn.settings.load_async:
                self._res.finished_recving.add(job.request_id)
            if not res.ok:
                logger.warning("KVBridgePoolConnector rank %d: load of %s refused, recomputing: %s", self.rank,
                               job.request_id, "; ".join(res.reasons)[:500])
                if self.conn.settings.load_async:
                    self._res.failed_recving.add(job.request_id)
                self._failed_blocks.update(job.block_ids)  # sync: vLLM recomputes from the first of them

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        for rid in finished_req_ids:
            self._finished[rid] = None
        while len(self._finished) > MAX_FINISHED_IDS:
            self._finished.popitem(last=False)
        res, self._res = self._res, KVConnectorTransferResults()
        done = {r for r in self._stored if r in self._finished}  # vLLM accepts a finished send only of a
        res.finished_sending |= done                               # request it told us finished
        self._stored -= done
        for r in done:
            del self._finished[r]
        return res

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def close(self) -> None:
        if self._tier is not None:
            self._tier.close()
        if self._client is not None:
            self._client.close()


__all__ = ["KVBridgePoolConnector", "PoolJob", "PoolMetadata", "PoolSettings", "pool_spec", "vllm_staging"]

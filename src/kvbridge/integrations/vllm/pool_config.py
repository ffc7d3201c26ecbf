"""What both sides of KVBridgePoolConnector share: its settings, the spec it registers, its jobs.

Split from the connector so that its scheduler side (`pool_scheduler`) and worker side
(`pool_worker`) import these without importing each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvbridge.core.layout import EngineLayout
from kvbridge.core.secrets import resolve_secret
from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError, IncompatibleEngines
from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec
from kvbridge.offload.spec import GPULoadStoreSpec
from kvbridge.pool.background import one_line
from kvbridge.pool.breaker import CLOSED
from kvbridge.pool.store import P2P_METADATA, StoreConfig
from kvbridge.pool.tier import PoolConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def vllm_staging(block_tokens: int, slots: int) -> EngineLayout:
    """Pool objects of vLLM CPU caches are cut from vLLM CPU's own layout at TP 1: there a head's
    transposed K and its V are one run (in the canonical layout, each K dimension is a component
    of its own: 34 runs per object, and Mooncake's per-task cost made loads slower than prefill).
    Without vLLM's unified page (`page_bytes=0`): staging needs no padding, and each group's layers
    are then addressed alone as in the whole model."""
    return msgspec.structs.replace(vllm_cpu_layout(1, block_tokens, slots), page_bytes=0)


class PoolSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config` of KVBridgePoolConnector; an unknown key is refused (named).

    `master` is the `mooncake_master` RPC address; clients find each other by Mooncake's P2P
    handshake unless `metadata_url` names an http metadata server. `model_id` defaults to the
    model path vLLM serves (with its revision); `block_tokens` must be the same on every
    instance and a multiple of each one's block size. The secret comes from `secret_file`
    (`kvbridge.core.secrets` rules: a 0600 regular file of this user, no symlink, 16+ bytes; never
    inline: a command line is visible in `ps`); `insecure: true` runs without one (checksums,
    predictable names).

    The pool is a cache, never a dependency: a lookup not answered within `lookup_timeout_ms` is
    a miss (the request waits at most that long), a load not done within `load_timeout_ms` is
    recomputed, a store not done within `store_timeout_ms` is dropped (its blocks released); any
    of these, or an error, opens a breaker that skips the pool and probes it again after a
    backoff doubling up to `max_backoff_s`. `load_async` hands loads to vLLM's asynchronous path
    (the request waits two more engine steps); by default a load runs at the start of the step
    that computes the rest of the prompt.
    """

    master: str
    metadata_url: str = P2P_METADATA
    model_id: str = ""
    block_tokens: int = 64
    staging_blocks: int = 64
    segment_mib: int = 64
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    local_memcpy: bool = True
    prefer_own_segment: bool = True
    load: bool = True
    store: bool = True
    load_async: bool = False
    secret_file: str = ""
    insecure: bool = False
    lookup_timeout_ms: int = 1000
    load_timeout_ms: int = 10_000
    store_timeout_ms: int = 30_000
    release_ms: int = 1000
    """A finished request's blocks are released at most this long after it ends (plus a step):
    its store then has read them into the host tier or staging, or is dropped (issue 42.3)."""
    max_backoff_s: float = 30.0
    host_mib: int = 0
    """This host's shared-memory tier (`pool.host_arena`), MiB; 0: none. Every instance of the host
    with the same pool maps the same arenas, so a prefix one stores is a memory copy away from the
    others; what the host tier does not hold comes from the master's store."""

    host_dir: str = ""
    """Where the host tier's arenas are (default: this user's private `/dev/shm/kvbridge-UID/pool`)."""

    kv_events: bool = False
    """Announce what this instance queues into the pool as vLLM KV events (ownership `kvbridge-pool`,
    on the instance's `--kv-events-config` publisher), for a KV-aware router's relay
    (`kvbridge.routing.relay`), which offers them on every instance's stream as the pool's tier.
    `kvbridge serve --router-policy kv_aware` sets it."""

    def __post_init__(self) -> None:
        if not (self.secret_file or self.insecure):
            raise ConfigError("KVBridgePoolConnector needs a secret: set kv_connector_extra_config secret_file (a 0600 "
                              "file, the same on every instance), or insecure: true")
        if not 0 <= self.segment_mib <= 1 << 20:
            raise ConfigError(f"KVBridgePoolConnector segment_mib must be in [0, 2^20], got {self.segment_mib}")
        for name in ("lookup_timeout_ms", "load_timeout_ms", "store_timeout_ms", "release_ms"):
            if not 1 <= getattr(self, name) <= 3_600_000:
                raise ConfigError(f"KVBridgePoolConnector {name} must be in [1, 3600000], got {getattr(self, name)}")
        if self.host_mib and not 1 <= self.host_mib <= 1 << 24:
            raise ConfigError(f"KVBridgePoolConnector host_mib must be 0 (no host tier) or in [1, 2^24], got "
                              f"{self.host_mib}")
        if not 1.0 <= self.max_backoff_s <= 3600.0:
            raise ConfigError(f"KVBridgePoolConnector max_backoff_s must be in [1, 3600], got {self.max_backoff_s}")

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> PoolSettings:
        if "secret" in extra:
            raise ConfigError("KVBridgePoolConnector takes no inline secret (a command line is visible in ps): put it "
                              "in a 0600 file and give its path as secret_file")
        try:
            return msgspec.convert(extra, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"KVBridgePoolConnector kv_connector_extra_config: {e}") from None

    def store_config(self, lend: bool) -> StoreConfig:
        return StoreConfig(self.master, self.metadata_url or P2P_METADATA, self.local_hostname, self.protocol,
                           rdma_devices=self.rdma_devices, segment_bytes=(self.segment_mib << 20) if lend else 0,
                           local_memcpy=self.local_memcpy, prefer_own_segment=self.prefer_own_segment)

    def pool_config(self, model_id: str, kv_identity: str = "") -> PoolConfig:
        try:
            secret = resolve_secret(None, self.secret_file or None, self.insecure)
        except ConfigError as e:
            raise ConfigError(f"KVBridgePoolConnector: {e}") from None
        return PoolConfig(model_id=model_id, block_tokens=self.block_tokens, staging_blocks=self.staging_blocks,
                          secret=secret or b"", insecure=secret is None, kv_identity=kv_identity,
                          host_bytes=self.host_mib << 20, host_dir=self.host_dir)


def pool_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ModelSpec:
    """The spec every rank registers, from the configs alone (the scheduler has no tensors).

    One group of full or sliding-window attention is read off vLLM's own group; several groups (vLLM's hybrid
    allocator: full and sliding-window attention) and MLA latents come from the model's config
    through transformers, as the worker's registration derives them, so both sides agree on the
    groups, windows and latent. Recurrent state (Mamba-style) is served as vLLM keeps it per
    prefix, in its `align` mode (checkpoints at block boundaries; `registration.hybrid_spec`)."""
    mc = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    if getattr(kv_cache_config, "has_mamba_layers", False):
        from kvbridge.integrations.vllm.registration import hybrid_spec

        attn = [g.kv_cache_spec for g in groups if not hasattr(g.kv_cache_spec, "shapes")]
        spec = hybrid_spec(vllm_config, kv_cache_config, normalize_dtype(str(attn[0].dtype if attn else mc.dtype)),
                           prefix_states=True)
        allowed, what = {"full", "sliding", "recurrent"}, "attention and recurrent state"
    else:
        from kvbridge.integrations.vllm.registration import sliding_window_of

        kv = groups[0].kv_cache_spec
        window = sliding_window_of(kv)
        # One group of one kind, as the worker registers it; not a full group whose layers vLLM
        # promoted from sliding (the hybrid allocator off): the configs' groups refuse that below.
        if len(groups) == 1 and not mc.use_mla and (window or not getattr(kv, "sliding_window", None)):
            heads, head = mc.get_total_num_kv_heads(), int(kv.head_size)
            layer = LayerSpec("sliding", heads, head, head, window=window) if window else \
                LayerSpec("full", heads, head, head)
            return vllm_cpu_spec(ModelSpec((layer,) * len(groups[0].layer_names), normalize_dtype(str(kv.dtype)),
                                           str(mc.model)))
        from kvbridge.models.config import spec_from_hf_config

        spec = spec_from_hf_config(mc.hf_config.to_dict(), dtype=normalize_dtype(str(kv.dtype)), view="engine",
                                   warn=False)
        spec = vllm_cpu_spec(ModelSpec(spec.layers, spec.dtype, str(mc.model)))
        allowed, what = (({"mla"}, "plain MLA layers") if mc.use_mla else
                         ({"full", "sliding"}, "full and sliding-window attention"))
    odd = sorted({layer.kind for layer in spec.layers if not layer.is_stateless} - allowed)
    if mc.use_mla and any(layer.window is not None or layer.tokens_per_row != 1 for layer in spec.layers):
        odd.append("sliding or compressed MLA")
    if odd:
        raise IncompatibleEngines(f"KVBridgePoolConnector serves {what} through vLLM; this model also has "
                                  f"{', '.join(odd)} layers")
    if len(spec.groups) != len(groups):
        raise IncompatibleEngines(f"vLLM keeps this model's layers in {len(groups)} KV-cache group(s), kvbridge in "
                                  f"{len(spec.groups)} (one per kind); the pool serves it only with vLLM's hybrid "
                                  f"allocator on and one group per kind")
    return spec


@dataclass
class PoolJob:
    """One request's load or store: its pool keys and the device side (`GPULoadStoreSpec` fields)."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    running: bool = False
    """A store of a request that runs on: vLLM does not hold its blocks for the store, so it is
    dropped if a step hands one of them out before it has read them (the request's final store
    puts what is missing)."""

    tenant: bytes = b""
    """The request's tenant (`pool_identity.tenant_of`): its objects are encrypted under that tenant's key."""

    def gpu(self) -> GPULoadStoreSpec:
        return GPULoadStoreSpec(self.block_ids, self.group_sizes, self.block_indices)


@dataclass
class PoolMetadata(KVConnectorMetadata):
    """One step's jobs, and the device blocks the step hands out to be written (past each new
    request's local prefix-cache hit, and every new block of a running one): a running request's
    store still reading one of them is dropped before the forward writes it (its request was
    preempted, or a window slid past it)."""

    loads: list[PoolJob] = field(default_factory=list)
    stores: list[PoolJob] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    drop_running: bool = False
    """The scheduler could not tell the blocks handed out (and stores while requests run are off):
    every running request's store still in flight is dropped."""


def announce(logger: logging.Logger, master: str, side: str, tally: Any = None) -> Callable[[str, str], None]:
    """A breaker's `on_change`: the pool going away and coming back, said once each (and counted)."""
    def on_change(state: str, why: str) -> None:
        if tally is not None:
            tally.add(breaker_closed=int(state == CLOSED), breaker_opened=int(state != CLOSED))
        if state == CLOSED:
            logger.warning("KVBridgePoolConnector (%s): the pool at %s is available again", side, master)
        else:
            logger.warning("KVBridgePoolConnector (%s): the pool at %s is unavailable (%s); serving without it and "
                           "trying again with backoff", side, master, why)
    return on_change


__all__ = ["PoolJob", "PoolMetadata", "PoolSettings", "announce", "one_line", "pool_spec", "vllm_staging"]

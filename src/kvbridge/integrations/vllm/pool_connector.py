"""`KVBridgePoolConnector`: a prefix cache in Mooncake Store that `vllm serve` instances of any shape share.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgePoolConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"master": "10.0.0.5:50051",
                                                         "secret_file": "/etc/kvbridge/pool.key"}}'

It follows vLLM's scheduler hooks as its OffloadingConnector does, with the shared pool
(`kvbridge.pool`) as the medium:

* keys: a request's pool blocks (`block_tokens`, the same on every instance) are keyed by
  kvbridge's chained hash of the token ids with everything vLLM's own block hash folds in
  (`pool_identity`: the tenant's `cache_salt`, the LoRA adapter, prompt embeddings), so tenants
  and adapters never share KV; object names are MACs under the fleet's secret (`kvbridge.pool`);
* lookup at scheduling, off the scheduler's path: `get_num_new_matched_tokens` asks the store
  on a thread which leading blocks are complete, answers "not yet" (None: vLLM asks again next
  step) while it waits and a miss after `lookup_timeout_ms`; the hit beyond the local
  prefix-cache hit is reported as external (`vllm:external_prefix_cache_hits`);
* load: the allocated blocks go to every worker rank (`pool_worker`), which fetches the objects
  its heads need, checks their seals and copies them in, on its thread, waiting at most
  `load_timeout_ms` at the start of the step that computes the rest of the prompt
  (`load_async: true`: vLLM's asynchronous load, always taken for a model of several KV-cache
  groups). A chunk that fails or comes late leaves its blocks untouched and they are reported in
  `get_block_ids_with_load_errors` (one group only: vLLM stops the engine on block ids of several)
  and `failed_recving` when asynchronous: vLLM recomputes them (`kv_load_failure_policy:
  recompute`; vLLM's default `fail` fails the request);
* store after compute: when a request finishes, its full pool blocks are stored by every rank
  (the objects each writes that the store lacks), its blocks held until the rank has copied
  them out (`request_finished` -> True, released by `finished_sending`). A request that decodes
  a pool block's worth of tokens or more is also stored as its blocks fill, each step queueing
  the blocks earlier steps filled. Its blocks are not held for those stores: each step names
  the blocks it hands out to be written, and before the forward (`handle_preemptions`) a rank
  drops a running request's store still reading one (the request was preempted, or its window
  slid past the block); the final store puts what is missing.

The pool is a cache, never a dependency: errors and deadlines open a breaker (`pool.breaker`)
that makes every lookup a miss and every store a drop until a probe finds the store again; the
first failure and the recovery are logged once each.

Every KV-cache group of attention is served, full and sliding-window alike: a lookup counts
the tokens every group can supply (the full groups' whole prefix, the sliding groups' last
window before it: `offload.lookup.request_hits`), and a store writes, per group, the blocks
still on the device (a window's slid-out blocks are vLLM's null block and are skipped). MLA
latents too (DeepSeek-style; vLLM CPU's `[blocks, block, latent]` cache, its cache-write checked
at start): rank 0 writes each latent object, every rank reads it. Recurrent state (Mamba-style
layers) as vLLM keeps it per prefix in its `align` mode: the boundary states vLLM offers
(`boundary_state_offloads`) that end on a pool block are stored as checkpoints, and a load writes
the one where the hit ends (see `pool_scheduler`).
Limits, each refused in one line at start: recurrent state without prefix caching, sliding or
compressed MLA, multimodal models, groups of different block sizes, an engine block size that does not
divide `block_tokens`. A sliding group's blocks are stored while its window still holds them
(during a long decode, as they fill; otherwise those the window holds when the request ends).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.kv_identity import vllm_kv_identity
from kvbridge.integrations.vllm.pool_config import PoolJob, PoolMetadata, PoolSettings, pool_spec, vllm_staging
from kvbridge.integrations.vllm.pool_identity import pool_model_id, refuse_unkeyable
from kvbridge.integrations.vllm.pool_metrics import PoolPromMetrics, PoolStats
from kvbridge.integrations.vllm.registration import cpu_byte_order

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")


class KVBridgePoolConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's shared pool behind vLLM's KVConnectorBase_V1 (see the module doc).

    `SupportsHMA`: vLLM's hybrid allocator hands it every KV-cache group (full and sliding-window
    attention), and vLLM's MultiConnector can pair it with `KVBridgeConnector`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = PoolSettings.parse(dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))
        refuse_unkeyable(vllm_config)
        self.spec = pool_spec(vllm_config, kv_cache_config)
        if len(self.spec.groups) > 1 and not self.settings.load_async:
            # Several KV-cache groups: vLLM takes a failed load only as a failed asynchronous request
            # (block ids are per group; reported for a load at the step's start, they stop the engine).
            # Recurrent state too: vLLM's align mode copies a prefix's state from its block into the
            # step's block before the forward's `start_load_kv`, so a state loaded there is never read
            # (measured: the reader answered as with no state). On the asynchronous path the request
            # runs only after its load.
            self.settings = msgspec.structs.replace(self.settings, load_async=True)
            logger.info("KVBridgePoolConnector: %d KV-cache groups: loads take vLLM's asynchronous path",
                        len(self.spec.groups))
        self.config = self.settings.pool_config(pool_model_id(vllm_config, self.settings.model_id),
                                                vllm_kv_identity(vllm_config).digest())
        order = cpu_byte_order(vllm_config, kv_cache_config)
        if order:  # see `cpu_byte_order`: engines of another order then miss, never misread
            self.config = msgspec.structs.replace(self.config, byte_order=order)
            logger.info("KVBridgePoolConnector: this engine's attention blocks hold their bytes in vLLM CPU's own "
                        "order (%s); it shares pool objects only with engines of the same kernel, block and head size",
                        order)
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.config.block_tokens % self.block_size:
            raise ConfigError(f"KVBridgePoolConnector block_tokens {self.config.block_tokens} is not a multiple of "
                              f"this engine's block size {self.block_size}")
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvbridge.integrations.vllm.pool_scheduler import PoolScheduler
            self._scheduler = PoolScheduler(self)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from kvbridge.integrations.vllm.pool_worker import PoolWorker
            self._worker = PoolWorker(self, get_tensor_model_parallel_rank(),
                                      vllm_config.parallel_config.tensor_parallel_size)

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.lookup(request, num_computed_tokens)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads run whole in `start_load_kv`, before the forward; nothing per layer."""

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._scheduler.scheduled(scheduler_output)
        return self._scheduler.take_meta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, (block_ids,)), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids), None

    def take_events(self) -> Iterable[Any]:
        """What this instance queued into the pool, as KV events (`PoolSettings.kv_events`)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward writes blocks this step hands out: drop the stores still reading them."""
        if isinstance(kv_connector_metadata, PoolMetadata):
            self._worker.drop_overwritten(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, PoolMetadata):
            self._worker.run(meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Stores read finished requests' blocks; nothing per layer."""

    def wait_for_save(self):
        """Stores run on the rank's pool thread, from blocks vLLM holds for them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self._worker.results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    # -- metrics (vLLM adds up the scheduler's and every rank's, see `pool_metrics`) ------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.tally.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PoolStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return PoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _register() -> None:
    """Put the connector in vLLM's registry by name: inside a MultiConnector, vLLM's API server
    rebuilds a child's stats by its class name (`KVConnectorFactory.get_connector_class_by_name`),
    and a connector loaded by module path alone is not there ("Connector 'KVBridgePoolConnector'
    is not registered" failed every request of a `kvbridge serve --pool` fleet once the pool
    reported metrics). Runs when vLLM loads this module, in every process that does."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("KVBridgePoolConnector", __name__, "KVBridgePoolConnector")
    except ValueError:  # registered already (this module imported twice, or by name elsewhere)
        pass


_register()

__all__ = ["KVBridgePoolConnector", "PoolJob", "PoolMetadata", "PoolSettings", "pool_spec", "vllm_staging"]

"""KVBridgePoolConnector's figures in vLLM's `/metrics`, through vLLM's own connector-stats path.

Why vLLM's path: an operator already scrapes each instance's `/metrics`; vLLM gathers a
connector's `KVConnectorStats` from the scheduler and every worker rank each step, adds them up
and hands them to the connector's `KVConnectorPromMetrics` (MultiConnector does the same per
child). Every figure here is a count that only grows, so adding up is the whole aggregation; each
becomes a Prometheus counter `vllm:kvbridge_pool_<name>_total` labelled like vLLM's own. The
breakers' state is two counters too (opened, closed): their difference is how many of the
engine's sides (the scheduler, each rank) skip the pool now, and it survives vLLM's adding up of
several sides and steps, which a gauge would not. The master's own capacity, key count and
evictions are on its metrics port (`master_*`, see docs/pool.md).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

COUNTERS = {
    "lookups": "Requests asked about in the pool (one per request per 10 s whose prompt goes beyond its local "
               "hit, its answer kept meanwhile; the requests of one scheduler step go in one batched call to the "
               "store; none for a request vLLM reads no cache for, such as one asking for its prompt's log-probs).",
    "lookup_timeouts": "Pool lookups not answered within lookup_timeout_ms (a miss).",
    "lookups_skipped": "Pool lookups answered as a miss at once because the breaker was open.",
    "queried_tokens": "Prompt tokens beyond the local prefix-cache hit that pool lookups asked about.",
    "hit_tokens": "Tokens the pool reported as external prefix-cache hits.",
    "loads": "Pool loads that reached the device.",
    "load_failures": "Pool loads refused, failed or late: their blocks were recomputed.",
    "stores": "Pool store jobs completed (a finished request's blocks, or those a running request filled).",
    "running_blocks_queued": "Pool blocks (one per KV-cache group) of running requests queued for storing as they "
                             "filled, during long prefills and decodes rather than at the request's end.",
    "stores_dropped": "Pool stores dropped (breaker open, queue full, not done within store_timeout_ms, or a "
                      "running request's blocks handed out again before the store read them).",
    "timeouts": "Loads and stores a rank gave up on at their deadline.",
    "puts_dropped": "Puts into the store of objects a store sealed into the host tier, dropped (the put thread "
                    "behind, or its deadline passed): the host tier holds them; other hosts recompute them.",
    "objects_put": "Objects put into the store.",
    "put_failures": "Objects the store refused to take (Mooncake's code per object: no space, ...).",
    "objects_got": "Objects read from the store.",
    "bytes_put": "Payload bytes put into the store.",
    "bytes_got": "Payload bytes read from the pool (its host tier and the store).",
    "host_objects_put": "Objects sealed into this host's shared-memory tier.",
    "host_objects_got": "Objects opened out of this host's shared-memory tier (no store round trip).",
    "store_seconds": "Seconds ranks spent storing (device copy, seals, puts).",
    "load_seconds": "Seconds ranks spent loading (gets, seal checks, device copy).",
    "seal_failures": "Objects whose seal did not check (forged, damaged, another fleet's or moved): refused.",
    "missing": "Objects a load needed that the store did not hold or could not hand over (evicted, never stored, "
               "in a dead writer's memory).",
    "removed": "Objects removed because they were not what their name promised (the next writer stores them), or "
               "replaced by this rank's store because it could not read them where the store lists them.",
    "breaker_opened": "Times a breaker opened (the store down, hung or erring): the store is skipped (a host tier goes on).",
    "breaker_closed": "Times a breaker closed again (opened minus closed: sides skipping the pool now).",
}


@dataclass
class PoolStats(KVConnectorStats):
    """Additive counts since the last interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PoolPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: create_metric_per_engine(
            self._counter_cls(name=f"vllm:kvbridge_pool_{name}", documentation=doc, labelnames=labelnames),
            per_engine_labelvalues) for name, doc in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value > 0:
                self._counters[name][engine_idx].inc(value)


class StatsTally:
    """One side's counts since vLLM last asked (`take`): the scheduler and each rank keep one."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # the pool thread and the engine's thread both add

    def add(self, **counts: float) -> None:
        with self._lock:
            self._counts.update({k: v for k, v in counts.items() if v})

    def take(self) -> PoolStats | None:
        """The counts since the last call (None when there are none: vLLM then sends nothing)."""
        with self._lock:
            if not self._counts:
                return None
            data = dict(self._counts)
            self._counts.clear()
        return PoolStats(data=data)


__all__ = ["COUNTERS", "PoolPromMetrics", "PoolStats", "StatsTally"]

"""KVBridgePoolConnector with every call into the pool raising (issue 43.3's fault injection):
loaded by a real `vllm serve` through `kv_connector_module_path` (`test_vllm_pool_faults.py`).

At import, in every vLLM process that loads the connector (the scheduler's and each worker's),
each entry point of the pool library the connector calls raises `InjectedFault` on every other
call (the 2nd, 4th, ...: a fault on every call would stop the first lookup, so no store or load
would ever reach the tier's own entry points): the index's and the host tier's lookups, the
batched lookup calls, a tier's store, load, put and host check, and the store client's RPCs. The connector's own hooks are untouched: they must keep every such
fault inside the pool (a miss, a dropped store, a recomputed load), so that vLLM serves each
request as it would without a pool.
"""

from __future__ import annotations

import itertools

from kvbridge.integrations.vllm import KVBridgePoolConnector
from kvbridge.pool import index, lookups, store, tier


class InjectedFault(RuntimeError):
    """The fault this module raises (its name is in the instance's log when it was raised)."""


def _raising(name: str, original):
    calls = itertools.count()

    def fault(*args, **kwargs):
        if next(calls) % 2:
            raise InjectedFault(f"injected fault in {name}")
        return original(*args, **kwargs)
    return fault


TARGETS = {
    index.PoolIndex: ("hits",),
    lookups.BatchedLookups: ("ask", "answer", "wait", "step_ended", "asked"),
    tier.PoolTier: ("store", "load", "put_sealed", "on_host"),
    store.StoreClient: ("exists", "get", "put", "remove", "sizes", "answers"),
}
for cls, names in TARGETS.items():
    for n in names:
        if hasattr(cls, n):
            setattr(cls, n, _raising(f"{cls.__name__}.{n}", getattr(cls, n)))


class FaultyPoolConnector(KVBridgePoolConnector):
    """The pool connector itself, loaded with the faults above in place."""


__all__ = ["FaultyPoolConnector", "InjectedFault"]

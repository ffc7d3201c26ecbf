"""Probe, run with .venv-vllm's python: a rank with a host tier goes on sharing through it while
its master hangs (issue 42.3, "whatever the master does").

A real `PoolWorker` with its real threads, tiers, host tier and store client, against a real
`mooncake_master` that the probe SIGSTOPs; only vLLM's registration is skipped (the rank's cache,
spec and layout are set as `register` would set them). While the master is stopped:

* a load of blocks the host tier does not hold goes to the store and hangs there (fetch thread);
* a load of blocks the host tier holds, asked after it, must still reach the device, byte-exact;
* stores must still reach the host tier and release their blocks, one after the other: their puts
  into the store hang on the put thread, never on the store thread.

Prints one JSON object of observations; `test_vllm_pool_hung_master.py` asserts on them. Waits
are for events, bounded by `WAIT_S`, never fixed sleeps: a starved host slows the probe down
without changing what it sees.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pool"))

from pool_harness import SPEC as PLAIN, block_keys  # noqa: E402

from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec  # noqa: E402
from kvbridge.integrations.vllm.pool_config import PoolJob, PoolMetadata, PoolSettings  # noqa: E402
from kvbridge.integrations.vllm.pool_worker import PoolWorker  # noqa: E402
from kvbridge.pool.master import MooncakeMaster  # noqa: E402
from kvbridge.pool.tier import PoolTier  # noqa: E402
from kvbridge.proofs.verify import random_bytes  # noqa: E402
from kvbridge.transport.cache import RankCache  # noqa: E402

WAIT_S = 120.0
"""How long the probe waits for something that must happen while the master is stopped (the old
design never got there: a host-tier load or store queued behind a call to the hung master)."""
N = 4  # pool blocks per job (8 tokens each, one device block each)
SPEC = vllm_cpu_spec(PLAIN)  # as vLLM CPU's caches hold it


def until(check, wait_s: float = WAIT_S) -> bool:
    end = time.monotonic() + wait_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


RETURNED: list[str] = []
"""Calls to the store that returned, in order (`_remote_calls`): while the master is stopped none
does, until Mooncake's own RPC timeout."""


def _remote_calls() -> None:
    """Note when each of the tier's calls to the store (a load's gets, a store's puts) returns."""
    for name, label in (("_load_remote", "get"), ("_put_from_host", "put")):
        original = getattr(PoolTier, name)

        def wrapped(self, *args, _original=original, _label=label, **kwargs):
            try:
                return _original(self, *args, **kwargs)
            finally:
                RETURNED.append(_label)

        setattr(PoolTier, name, wrapped)


def main() -> dict:
    _remote_calls()
    faulthandler.register(signal.SIGUSR1)  # a hung probe says where: kill -USR1 PID
    work = Path(tempfile.mkdtemp(prefix="kvb-hung-"))
    master = MooncakeMaster.start(work / "master.log")
    out: dict = {}
    try:
        settings = PoolSettings(master=master.address, metadata_url=master.metadata_url, insecure=True,
                                block_tokens=8, staging_blocks=N, segment_mib=16, load_async=True,
                                host_mib=8, host_dir=str(work), load_timeout_ms=3_600_000,
                                store_timeout_ms=3_600_000, release_ms=3_600_000)
        import logging; logging.basicConfig(level=logging.INFO)  # nothing gives up on its own
        conn = SimpleNamespace(settings=settings, config=settings.pool_config("hung-master-probe"), spec=SPEC)
        worker = PoolWorker(conn, rank=0, tp_size=1)
        layout = vllm_cpu_layout(1, 8, 64)
        cache = RankCache.allocate_engine(SPEC, layout, fill=None)[0]
        random_bytes([cache], 7)
        names = [f"layer{i}" for i in range(len(cache.regions))]
        worker._caches = dict(zip(names, cache.regions))  # what `register` sets
        worker._names, worker._spec, worker._layout = names, SPEC, layout
        stored, loaded, failed = set(), set(), set()

        def job(rid: str, salt: str, first: int) -> PoolJob:
            return PoolJob(rid, block_keys(N, salt), list(range(first, first + N)), (N,), (0,))

        def _pending() -> bool:
            return bool(getattr(worker, "_puts", None) or getattr(worker, "_new_puts", None) or worker._putting)

        def poll(rids: set[str] = frozenset()) -> None:
            res = worker.results(set(rids))
            stored.update(res.finished_sending)
            loaded.update(res.finished_recving)
            failed.update(res.failed_recving)

        def blocks(first: int) -> list[bytes]:  # each layer's blocks, one after the other (vLLM CPU's cache)
            return [r.view(torch.uint8).reshape(layout.num_blocks, -1)[first:first + N].numpy().tobytes()
                    for r in cache.regions]

        worker.run(PoolMetadata(stores=[job("a", "A", 0)]))  # blocks 0-3: host tier and store
        out["a_released"] = until(lambda: (poll({"a"}), "a" in stored)[1])
        def put_done() -> bool:  # a's put queued, ended and seen (its store call queues it after the blocks go)
            poll()
            tier = worker._tiers.get("put") or worker._tiers.get("store")  # the second: the old design's
            return bool(tier and tier.stats["objects_put"]) and not _pending()

        out["a_put"] = until(put_done)
        before = blocks(10)

        # A host-tier load whose blocks the host tier loses between its queueing and its run (an
        # eviction): it moves to the fetch thread and loads from the store (the master is up here).
        gate = threading.Event()
        worker._load_thread.submit(lambda call: gate.wait(WAIT_S))  # the load thread is busy meanwhile
        worker.run(PoolMetadata(loads=[job("moved", "A", 50)]))
        store_tier = worker._tiers["store"]
        keys_a = block_keys(N, "A")
        for key, hit in zip(keys_a, store_tier.host.find(keys_a, [store_tier.reads[0]] * N)):
            if hit is not None:
                store_tier.host.forget(key, hit[1], hit[2], store_tier.layout.group_objects[0])
        out["a_gone_from_host"] = not store_tier.on_host(keys_a)
        gate.set()
        out["moved_done"] = until(lambda: (poll(), "moved" in loaded)[1])
        out["moved_failed"] = "moved" in failed
        out["moved_bytes_equal"] = blocks(50) == blocks(0)

        os.kill(master.proc.pid, signal.SIGSTOP)
        RETURNED.clear()
        stopped_at = time.monotonic()
        try:
            worker.run(PoolMetadata(loads=[job("b", "B", 30)]))  # the host tier has none of B: the store
            fetch = getattr(worker, "_fetch_thread", worker._load_thread)  # the old design: one load thread
            out["b_in_store_call"] = until(lambda: fetch.busy_for() > 0.5)
            worker.run(PoolMetadata(loads=[job("a-again", "A", 10)]))  # A is on the host tier
            out["host_load_done"] = until(lambda: (poll(), "a-again" in loaded)[1])
            out["host_load_failed"] = "a-again" in failed
            out["host_load_bytes_equal"] = blocks(10) == blocks(0) and blocks(10) != before
            out["store_calls_returned_by_host_load"] = list(RETURNED)  # b's get still hung: []
            worker.run(PoolMetadata(stores=[job("c", "C", 20)]))
            out["c_released"] = until(lambda: (poll({"c"}), "c" in stored)[1])
            worker.run(PoolMetadata(stores=[job("d", "D", 40)]))  # behind c's put on the old design
            out["d_released"] = until(lambda: (poll({"d"}), "d" in stored)[1])
            out["store_calls_returned_by_d"] = list(RETURNED)  # c's put still hung: []
            tier = worker._tiers.get("load")
            out["d_on_host"] = bool(tier is not None and tier.on_host(block_keys(N, "D")))
            out["master_stopped_throughout"] = master.proc.poll() is None
            out["seconds_while_stopped"] = round(time.monotonic() - stopped_at, 1)
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        out["b_ended_after"] = until(lambda: (poll(), "b" in loaded)[1])
        out["puts_settled_after"] = until(lambda: (poll(), not _pending())[1])
        out["tally"] = (worker.tally.take() or SimpleNamespace(data={})).data
        worker.close()
    finally:
        master.stop(kill=True)
        for f in work.iterdir():
            if f.is_file():
                f.unlink()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))

"""Probe, run with .venv-vllm's python: which in-flight pool stores a rank drops before a forward.

Why: a running request's blocks are not held for the stores of its filled blocks (issue 29: stores
as blocks fill, during long decodes). vLLM frees them when it preempts the request or a sliding
window passes them, and may hand them to another request at any later schedule; the forward
then writes them. So before every step (`handle_preemptions`, and `start_load_kv`) the rank
drops each such store that still reads a block the step hands out or loads into, without waiting
for a copy in progress (the engine thread never waits on the nice +10 store thread: the copy's bytes
are thrown away, `Call.still_allowed`), and a finished request's store (its blocks held by vLLM)
is never dropped.

The `PoolWorker`, its store thread, `Call`s and their device gates are the real ones; only the
job a store runs is replaced by one that holds the device gate until the probe releases it (a
copy out of the device in progress), so the probe needs no store and no registered cache. Prints one JSON object
of observations; `test_vllm_pool_store_drop.py` asserts on them.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import torch

from kvbridge.integrations.vllm.pool_config import PoolJob, PoolMetadata, PoolSettings
from kvbridge.integrations.vllm.pool_worker import PoolWorker

GUARD_S = 60.0
"""When the held copy is released if the drop waits for it after all (then the test fails)."""
WAIT_S = 300.0
"""How long the probe waits for a thread to get somewhere: events, never fixed sleeps, so that a
starved host slows the probe down without changing what it sees."""


def main() -> dict:
    settings = PoolSettings(master="127.0.0.1:1", insecure=True, store_timeout_ms=3_600_000,
                            release_ms=3_600_000,
                            load_timeout_ms=3_600_000)  # no store or load times out while the host is starved
    worker = PoolWorker(SimpleNamespace(settings=settings), rank=0, tp_size=1)
    worker._caches = {"layer": torch.zeros(1)}  # registered: jobs are submitted
    reads: dict[str, list[bool]] = {}
    started: dict[str, threading.Event] = {}
    release: dict[str, threading.Event] = {}  # ends the job's first copy out of the device
    proceed: dict[str, threading.Event] = {}  # lets it start the next (a lock is not fair: without it the
    # store thread may take the gate again before the drop waiting for it does)
    ended: dict[str, threading.Event] = {}
    kept: dict[str, bool] = {}

    def job(call, kind, pj: PoolJob, remote: bool = True):  # a store reading the device twice, the first read held open
        rid = pj.request_id
        started[rid].set()
        seen = reads.setdefault(rid, [])
        with call.device_access() as ok:
            seen.append(ok)
            release[rid].wait(WAIT_S)
        kept[rid] = call.still_allowed()  # False: what the held copy read is never put
        proceed[rid].wait(WAIT_S)
        with call.device_access() as ok:
            seen.append(ok)
        ended[rid].set()
        return SimpleNamespace(ok=True, reasons=[], seconds=0.0)

    worker._job = job
    out: dict = {}

    def expect(rid: str, held: bool = False) -> None:
        started[rid], release[rid], proceed[rid], ended[rid] = (threading.Event() for _ in range(4))
        if not held:
            release[rid].set()
            proceed[rid].set()

    def store(rid: str, blocks: list[int], running: bool, held: bool = False) -> PoolJob:
        expect(rid, held)
        return PoolJob(rid, [b"k"], blocks, (len(blocks),), (0,), running)

    def settle(*rids: str) -> None:
        """Until the jobs of `rids` returned and the worker saw their calls done."""
        for rid in rids:
            ended[rid].wait(WAIT_S)
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end and not all(c.done.is_set() for r in rids for c, _ in worker._stores.get(r, [])):
            time.sleep(0.01)

    # 1. A running request's store mid-copy, a finished request's store queued behind it.
    worker.run(PoolMetadata(stores=[store("running", [5, 6], True, held=True), store("finished", [7], False)]))
    started["running"].wait(WAIT_S)
    guard = threading.Timer(GUARD_S, release["running"].set)  # ends the copy if the drop waits for it
    guard.start()
    worker.drop_overwritten(PoolMetadata(allocated=[6, 7]))  # 6: handed out again; 7: a prefix hit on a held block
    out["drop_returned_during_copy"] = not release["running"].is_set()
    release["running"].set()
    guard.cancel()
    proceed["running"].set()
    settle("running", "finished")
    out["running_reads"] = reads.get("running")
    out["finished_reads"] = reads.get("finished")
    out["held_copy_kept"] = kept.get("running")
    res = worker.results({"running", "finished"})
    out["finished_sending_1"] = sorted(res.finished_sending)
    # 2. A load's blocks count as written; a store whose blocks the step leaves alone stays.
    worker.run(PoolMetadata(stores=[store("a", [10, 11], True, held=True), store("b", [12], True)]))
    started["a"].wait(WAIT_S)
    expect("loading")
    worker.run(PoolMetadata(loads=[PoolJob("loading", [b"k"], [11], (1,), (0,))]))
    release["a"].set()
    proceed["a"].set()
    settle("a", "b", "loading")
    out["a_reads"], out["b_reads"] = reads.get("a"), reads.get("b")
    out["finished_sending_2"] = sorted(worker.results({"a", "b"}).finished_sending)
    # 3. Not finished yet: nothing reported, however its stores ended.
    worker.run(PoolMetadata(stores=[store("c", [20], True)]))
    settle("c")
    out["finished_sending_3"] = sorted(worker.results(set()).finished_sending)
    out["finished_sending_4"] = sorted(worker.results({"c"}).finished_sending)
    out["dropped"] = worker.tally.take().data.get("stores_dropped", 0)
    out.update(release_bound())
    return out


def release_bound() -> dict:
    """Issue 42.3: a finished request's blocks go within `release_ms` whatever its store does. A
    store hung in the store's call (a hung master) keeps the thread; the finished request queued
    behind it is reported free once the bound passed, its store dropped; a store that read every
    block (into the host tier) lets its request go while it still puts."""
    settings = PoolSettings(master="127.0.0.1:1", insecure=True, store_timeout_ms=3_600_000, release_ms=200)
    worker = PoolWorker(SimpleNamespace(settings=settings), rank=0, tp_size=1)
    worker._caches = {"layer": torch.zeros(1)}
    hang, copied, reads = threading.Event(), threading.Event(), {}

    def job(call, kind, pj: PoolJob, remote: bool = True):
        rid = pj.request_id
        with call.device_access() as ok:
            reads[rid] = ok
        if rid == "early":
            call.device_released.set()  # its blocks read: now it puts
            copied.set()
        hang.wait(WAIT_S)  # the master does not answer
        return SimpleNamespace(ok=True, reasons=[], seconds=0.0)

    worker._job = job
    out: dict = {}

    def until_free(rids: set[str]) -> set[str]:
        seen = set(worker.results(rids).finished_sending)
        end = time.monotonic() + WAIT_S
        while not rids <= seen and time.monotonic() < end:
            time.sleep(0.01)
            seen |= worker.results(set()).finished_sending
        return seen

    worker.run(PoolMetadata(stores=[PoolJob("early", [b"k"], [40], (1,), (0,), False)]))
    copied.wait(WAIT_S)
    out["released_after_its_copy"] = sorted(until_free({"early"}))
    out["early_still_putting"] = not hang.is_set()
    worker.run(PoolMetadata(stores=[PoolJob("queued", [b"k"], [41], (1,), (0,), False)]))  # behind the hung one
    out["released_while_queued"] = sorted(until_free({"queued"}))
    out["queued_never_read"] = "queued" not in reads
    hang.set()
    worker.run(PoolMetadata(stores=[PoolJob("after", [b"k"], [42], (1,), (0,), False)]))  # queued behind it
    end = time.monotonic() + WAIT_S
    while "after" not in reads and time.monotonic() < end:  # the thread went past the dropped store
        time.sleep(0.01)
    out["queued_read_after_drop"] = reads.get("queued", "never run")
    out["release_dropped"] = worker.tally.take().data.get("stores_dropped", 0)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))

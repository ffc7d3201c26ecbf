"""Lookups batched per scheduler step (issue 42 point 3), against a real master and store client:

* the waiting requests asked in one step go in one call (keys shared by requests sent once), and
  each request's answer is what the store says of its own keys;
* with the master stopped (SIGSTOP), N requests asked in one step wait inline for one step's
  budget in all, not N times it, and nothing more is sent while the hung call is in flight; once
  the master goes on, what waited goes in one call and is answered;
* host-tier lookups (the store away) on a thread of their own are answered while a call to the
  stopped master holds the other.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvbridge.pool.background import PoolThread
from kvbridge.pool.lookups import BatchedLookups
from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.store import StoreClient, StoreConfig

WAIT_S = 120.0  # a starved host may take this long to answer: polled, never slept


def _store_hits(client: StoreClient, sent: list[list[str]]):
    def hits(call, keys: list[str], remote: bool):
        sent.append(list(keys))
        answer = client.exists(keys)
        return [a is True for a in answer], all(a is not None for a in answer)
    return hits


def _poll(lookups: BatchedLookups, rid: str):
    end = time.monotonic() + WAIT_S
    while (got := lookups.answer(rid)) is None:
        assert time.monotonic() < end, f"no answer for {rid}"
        lookups.step_ended()
        time.sleep(0.01)
    return got


def test_one_steps_lookups_go_in_one_call_and_each_gets_its_own_answer(master, lender) -> None:
    names = [f"lookup-batch/{i}" for i in range(8)]
    buf = torch.zeros(64, dtype=torch.uint8)
    lender.register(buf.data_ptr(), buf.numel())
    try:
        assert lender.put(names[:4], [[(buf.data_ptr(), 64)]] * 4) == [0] * 4  # 0-3 stored, 4-7 not
        client = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=0))
        thread, sent = PoolThread("test-lookups"), []
        try:
            lookups = BatchedLookups(thread, _store_hits(client, sent), inline_wait_s=30.0)
            asks = {"a": names[0:3], "b": names[2:6], "c": names[5:8], "d": names[0:2] + names[6:8]}
            lookups.ask("a", asks["a"], True)  # nothing in flight: sent at once
            for rid in "bcd":  # asked while "a"'s call may still be in flight: they wait for one call
                lookups.ask(rid, asks[rid], True)
            got = {rid: _poll(lookups, rid) for rid in asks}
        finally:
            thread.close()
            client.close()
    finally:
        lender.unregister(buf.data_ptr(), buf.numel())
    for rid, keys in asks.items():
        assert got[rid].keys == keys and got[rid].answered and got[rid].error is None
        assert got[rid].present == [names.index(k) < 4 for k in keys], rid
    assert lookups.calls == len(sent) <= 2  # "a" alone (or with the rest), then the rest in one
    for keys in sent:
        assert len(keys) == len(set(keys))  # a key two requests share is asked once
    assert sorted({k for keys in sent for k in keys}) == sorted({k for ks in asks.values() for k in ks})


def test_a_hung_master_stalls_a_step_once_not_once_per_request(tmp_path) -> None:
    master = MooncakeMaster.start(tmp_path / "master.log")
    client = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=0))
    thread, sent = PoolThread("test-lookups-hung"), []
    inline = 0.2
    try:
        assert client.exists(["warm"]) == [False]
        lookups = BatchedLookups(thread, _store_hits(client, sent), inline_wait_s=inline)
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            for i in range(8):  # one step: eight new requests, each asked and waited for as the scheduler does
                assert lookups.ask(f"r{i}", [f"hung/{i}"], True)
                lookups.wait(f"r{i}")
                assert lookups.answer(f"r{i}") is None
            # The step's waits together took its inline budget once (eight requests at a wait each
            # would have been 8 x 0.2 s); only the first request's call went out.
            assert sum(lookups.step_waits) <= inline + 0.01, lookups.step_waits
            assert lookups.calls == 1
            lookups.step_ended()  # the hung call is still in flight: nothing more is sent
            assert lookups.calls == 1 and lookups.step_waits == []
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        got = {f"r{i}": _poll(lookups, f"r{i}") for i in range(8)}
        assert all(g.present == [False] and g.error is None for g in got.values())
        assert lookups.calls == 2 and sorted(sent[1]) == sorted(f"hung/{i}" for i in range(1, 8))
    finally:
        thread.close(timeout=30.0)
        client.close()
        master.stop()


def test_host_tier_lookups_do_not_wait_behind_a_hung_master(tmp_path) -> None:
    # The store away (breaker open), lookups ask the host tier alone (`remote=False`: the store is
    # not called, as `PoolIndex.hits` does); with a thread of their own they are answered while a
    # call to the stopped master holds the other thread.
    master = MooncakeMaster.start(tmp_path / "master.log")
    client = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=0))
    remote_thread, host_thread, sent = PoolThread("test-lookups-remote"), PoolThread("test-lookups-host"), []
    store_hits = _store_hits(client, sent)

    def hits(call, keys, remote):
        return store_hits(call, keys, remote) if remote else ([k.startswith("host/") for k in keys], False)

    try:
        assert client.exists(["warm"]) == [False]
        lookups = BatchedLookups(remote_thread, hits, inline_wait_s=0.2, host_thread=host_thread)
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            assert lookups.ask("stuck", ["hung/0"], True)
            lookups.wait("stuck")
            assert lookups.answer("stuck") is None  # held by the stopped master
            lookups.step_ended()
            assert lookups.ask("h", ["host/1", "other/2"], False)
            got = _poll(lookups, "h")
            assert got.present == [True, False] and not got.remote and got.error is None
            assert lookups.answer("stuck") is None
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        assert _poll(lookups, "stuck").present == [False]
    finally:
        host_thread.close()
        remote_thread.close(timeout=30.0)
        client.close()
        master.stop()


def test_a_request_whose_later_call_is_refused_is_forgotten() -> None:
    # Asked while a call is in flight, then its own call refused (the thread closed meanwhile):
    # `answer` gives nothing and the request is no longer asked, so the scheduler calls it a miss
    # (it must not ask its age: there is none).
    import threading

    release = threading.Event()
    thread = PoolThread("test-lookups-refuse-later")
    lookups = BatchedLookups(thread, lambda call, keys, remote: (release.wait(60), ([False] * len(keys), True))[1],
                             inline_wait_s=0.01)
    assert lookups.ask("first", ["k1"], True)
    assert lookups.ask("later", ["k2"], True) and lookups.asked("later")  # waits for the call in flight
    end = time.monotonic() + WAIT_S
    while thread.current is None:  # "first" runs (a call still queued at close is dropped unrun)
        assert time.monotonic() < end
        time.sleep(0.01)
    thread.close(timeout=0.0)
    release.set()
    assert _poll(lookups, "first").present == [False]
    assert lookups.answer("later") is None and not lookups.asked("later")


def test_a_call_dropped_unrun_by_a_closing_thread_is_an_error_answer() -> None:
    import threading

    release = threading.Event()
    thread = PoolThread("test-lookups-dropped")
    blocker = thread.submit(lambda call: release.wait(60))  # holds the thread, so the lookup stays queued
    lookups = BatchedLookups(thread, lambda call, keys, remote: ([True] * len(keys), True), inline_wait_s=0.01)
    assert lookups.ask("x", ["k"], True)
    thread.close(timeout=0.0)  # the queued lookup is dropped: done, with neither result nor error
    release.set()
    blocker.wait(60)
    got = lookups.answer("x")
    assert got is not None and got.present == [] and isinstance(got.error, RuntimeError)


def test_a_refused_call_is_a_miss_and_forgotten() -> None:
    thread = PoolThread("test-lookups-closed")
    thread.close()
    lookups = BatchedLookups(thread, lambda call, keys, remote: ([], True), inline_wait_s=0.01)
    assert lookups.ask("x", ["k"], True) is False
    assert not lookups.asked("x") and lookups.answer("x") is None


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-v"])

"""Failures that stay inside the pool (issue 43 point 3): accounting per thread, error paths of
bounded RPCs, no engine-thread wait on a store thread's copy, and no bad environment value that
stops the connector from loading."""

from __future__ import annotations

import importlib
import threading
import time

import pytest
import torch
from pool_harness import Engine, block_keys, config

from kvbridge.errors import ConfigError
from kvbridge.pool.background import PoolThread
from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.store import StoreClient, StoreConfig


def test_a_failed_call_counts_for_its_own_thread_only(tmp_path):
    """A rank's load and store threads share one client: before, a load's unanswered call made a
    concurrent good store count the failure and open the breaker."""
    m = MooncakeMaster.start(tmp_path / "master.log")
    client = StoreClient(StoreConfig(m.address, segment_bytes=0))
    try:
        m.stop(kill=True)  # from here on every call fails at once (-900)
        seen: dict[str, int] = {}

        def loader() -> None:
            assert client.exists(["kvb3/x"]) == [None]
            seen["load"] = client.unreachable

        t = threading.Thread(target=loader)
        t.start()
        t.join(60)
        assert seen["load"] == 1 and client.unreachable == 0  # this thread made no call
        assert client.sizes(["kvb3/x", "kvb3/y"]) == [None, None]  # unanswered: as missing, nothing removed
    finally:
        client.close()


def test_sizes_answer_per_object_in_one_call(master, lender):
    buf = torch.arange(256, dtype=torch.uint8)
    lender.register(buf.data_ptr(), 256)
    try:
        assert lender.put(["kvb3/s1", "kvb3/s2"], [[(buf.data_ptr(), 100)], [(buf.data_ptr(), 37)]]) == [0, 0]
        assert lender.sizes(["kvb3/s1", "kvb3/missing", "kvb3/s2"]) == [100, None, 37]
    finally:
        lender.unregister(buf.data_ptr(), 256)


def test_dropping_a_store_never_waits_for_its_copy_and_puts_nothing_it_read():
    """The engine thread drops a running request's store before the forward rewrites its blocks.
    Before, it waited for the store thread's copy in progress (a nice +10 thread holding the
    device gate for a whole chunk: priority inversion); now it returns at once, and the copy that
    overlapped the drop is never put."""
    thread = PoolThread("test-store")
    started, release = threading.Event(), threading.Event()

    def store(call):
        with call.device_access() as ok:
            assert ok
            started.set()
            release.wait(10)  # a long copy
        return call.still_allowed()

    call = thread.submit(store)
    assert started.wait(10)
    t0 = time.monotonic()
    call.abandon(wait=False)
    assert time.monotonic() - t0 < 0.5
    release.set()
    assert call.wait(10) and call.result is False  # what it read is dropped
    thread.close()


def test_a_store_abandoned_during_its_copy_puts_nothing(master, lender, client):
    src = Engine(1, 8, seed=3).attach(master, config(staging=4), client=lender)
    try:
        keys = block_keys(2, "abandoned-during-copy")
        res = src.tiers[0].store(src.job(0, 2), keys, still_allowed=lambda: False)
        assert res.done == [False, False] and res.objects == 0
        assert client.exists(src.tiers[0].layout.keys(keys[0])) == [False] * len(src.tiers[0].layout.keys(keys[0]))
    finally:
        src.close()


def test_a_bad_idle_wait_is_one_line_naming_it_not_a_module_that_fails_to_load(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_VLLM_IDLE_WAIT_S", "soon")
    module = importlib.reload(importlib.import_module("kvbridge.integrations.vllm.idle_wake"))
    with pytest.raises(ConfigError, match="KVBRIDGE_VLLM_IDLE_WAIT_S must be seconds in .*, got 'soon'"):
        module.IdleWait("engine-bad-env")
    monkeypatch.setenv("KVBRIDGE_VLLM_IDLE_WAIT_S", "0.1")
    assert module.idle_wait_max_s() == 0.1

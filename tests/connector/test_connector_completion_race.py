"""A lost prefill side channel against the decode rank's own completions (issue 43, point 4).

Two rules, with the real shared-memory transport and real ZMQ side channels:

* bytes that arrived count: a prefill rank may learn from the transport's notification that its
  bytes were read, release and exit before the decode rank polled its own read; the decode rank
  must poll its reads before it judges the loss, whatever `transport_notify` is;
* a dropped side channel fails at once the requests still waiting on that source: a decode rank
  waiting in `progress(timeout)` wakes when the link drops instead of sleeping out its timeout.
"""

from __future__ import annotations

import time

import pytest
from connector_harness import SECRET, Cluster, Workload

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.consumer import Consumer
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.base import Handle, Transport, XferState


def _config(**kw) -> ConnectorConfig:
    return ConnectorConfig(lease_seconds=5, transfer_timeout=5, abort_timeout=1, side_channel_heartbeat=1,
                           secret=SECRET, **kw)


class HeldCompletions:
    """Hides the consumer's finished transfers from it until `show()`: the window between a read
    landing (the prefill side may already know, from the transport) and the decode rank's next poll."""

    def __init__(self, transport: Transport, monkeypatch: pytest.MonkeyPatch):
        self.real = transport.poll
        self.held = True
        self.seen: list[Handle] = []
        monkeypatch.setattr(transport, "poll", self.poll)

    def poll(self, handle: Handle) -> XferState:
        if not self.held:
            return self.real(handle)
        if all(h is not handle for h in self.seen):
            self.seen.append(handle)
        return XferState.PENDING

    def landed(self) -> bool:
        return bool(self.seen) and all(self.real(h) == XferState.DONE for h in self.seen)

    def show(self) -> None:
        self.held = False


def _wait_link_lost(consumer: Consumer, engine: str, rank: int, timeout: float = 5.0) -> None:
    """Until the consumer's link to `engine` rank `rank` has seen its drop, without a `progress` call."""
    client = consumer._links.engines[engine].clients[rank]
    end = time.monotonic() + timeout
    while not client.lost:
        assert time.monotonic() < end, "the side channel's drop was never seen"
        client.check_monitor()
        time.sleep(0.005)


@pytest.mark.parametrize("transport_notify", [True, False])
def test_a_read_that_landed_before_its_source_was_lost_succeeds(monkeypatch, transport_notify: bool) -> None:
    pre = EngineLayout(tp_size=1, block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=1, block_size=8, num_blocks=128, kv_order="NHD")
    cl = Cluster(pre, dec, config=_config(transport_notify=transport_notify), seed=43)
    try:
        cl.connect()
        wl = Workload(cl, 1, seed=43)
        (a,) = wl.requests
        consumer = cl.consumers[0]
        held = HeldCompletions(consumer.transport, monkeypatch)
        wl.receive()
        wl.add()
        cl.run_until(lambda: bool(held.seen), 5)  # the decode rank posted its read
        end = time.monotonic() + 5
        while not held.landed():
            assert time.monotonic() < end, "the read never finished"
            time.sleep(0.005)
        if transport_notify:  # the prefill rank releases on the transport's notification alone
            end = time.monotonic() + 5
            while cl.releases_of(a) != [(0, "done")]:
                assert time.monotonic() < end, cl.released
                cl.producers[0].progress(0.005)
        cl.producers[0].server.close()  # ... and exits at once: its side channel drops
        _wait_link_lost(consumer, "prefill", 0)
        held.show()
        results = {r.request_id: r for r in consumer.progress(0.0)}
        assert results[a].ok, results[a].reason
        assert consumer.lost_sources("prefill") == (0,)
        assert wl.mismatches() == []
    finally:
        cl.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_dropped_side_channel_wakes_a_waiting_decode_rank(mode: str) -> None:
    """P2 -> D1: `done` got both halves before rank 1 dropped and succeeds; `waiting` got rank 0's
    half only and fails inside the `progress` call that waits when rank 1's link drops."""
    pre = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=1, block_size=8, num_blocks=128, kv_order="NHD")
    cl = Cluster(pre, dec, mode=mode, config=_config(), seed=44)
    try:
        cl.connect()
        wl = Workload(cl, 2, seed=44)
        done, waiting = wl.requests
        wl.receive()
        wl.add([done])
        wl.add([waiting], ranks=[0])
        cl.run_until(lambda: cl.done(done) and len(cl.releases_of(waiting)) == 1, 5)
        assert cl.results[(0, done)].ok, cl.results[(0, done)].reason
        consumer = cl.consumers[0]
        wait = 3.0  # below the request's 5 s deadline
        t0 = time.monotonic()
        cl.producers[1].server.close()  # prefill rank 1 exits with `waiting` still owed
        got = []
        while not got and time.monotonic() - t0 < 2 * wait:
            got = [r for r in consumer.progress(wait) if r.request_id == waiting]
        took = time.monotonic() - t0
        assert got and not got[0].ok and "rank(s) [1] lost" in got[0].reason, got
        assert took < 1.0, f"the drop failed the request after {took:.2f} s, not at once"
    finally:
        cl.close()

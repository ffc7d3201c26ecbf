"""More faults (issue 6, item 4): a decode rank killed mid-transfer (real processes), the side
channel dropped mid-request, a prefill peer that restarts under the same engine id.

After each: no hang (every wait is bounded), the affected requests fail with reasons, the
others complete, blocks are released exactly once per prefill rank, and this process's open
descriptors and kvbridge /dev/shm segments do not grow (small tolerance for ZMQ's lazily made
I/O thread descriptors in the side-channel test). The decode-rank kill and the peer restart are
checked exactly: after a warm-up cycle of the same kind without the fault (which opens whatever
a process opens once), the fault's cycle must leave the open descriptors, the test's /dev/shm
segments and the transport agents' registered regions, peers and mapped peer segments where the
warm-up left them, in this process and in the prefill rank that survives.
"""

from __future__ import annotations

import gc
import os
import re
import time

import pytest
from connector_harness import Cluster, Workload, pumping
from test_connector_faults import CFG, _adds, _receives, _releases, _requests, _shards, engines  # noqa: F401

from kvbridge.connector import messages as m
from kvbridge.connector import processes as rp
from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.connector.producer import Producer
from kvbridge.connector.transports import make_transport
from kvbridge.core.layout import EngineLayout

SECRET = generate_secret()  # per test run, shared by both engines of every cluster here

FD_SLACK = 4
_FD_AFTER: list[int] = []
FAST = ConnectorConfig(lease_seconds=2, transfer_timeout=2, abort_timeout=1, handshake_timeout=5,
                       side_channel_heartbeat=0.2, secret=SECRET)


def _figures(tag: str) -> tuple[int, int]:
    gc.collect()
    mine = f"kvbridge-{os.getpid()}-"  # other processes on the host (other test runs) make segments too
    shm = len([n for n in os.listdir("/dev/shm") if n.startswith(mine) and tag in n]) if os.path.isdir("/dev/shm") \
        else 0
    return len(os.listdir("/proc/self/fd")), shm


@pytest.fixture
def no_growth():
    """Asserts after the test: fds within FD_SLACK, kvbridge test shm segments not more than before."""
    import zmq

    from kvbridge.connector.processes import process_context
    zmq.Context.instance()  # one-time, per-process: ZMQ's I/O thread, the process start method
    process_context()
    before = _figures("test-")
    yield
    after = _figures("test-")
    # Each test's first use of a facility (forkserver, shm transport, ZMQ sockets) opens
    # process-lifetime descriptors once; so the bound is against the highest count seen after an
    # earlier test of this module: a leak per fault would grow it test after test.
    if _FD_AFTER:
        assert after[0] <= max(_FD_AFTER) + FD_SLACK, f"fds grew {max(_FD_AFTER)} -> {after[0]} (before {before[0]})"
    _FD_AFTER.append(after[0])
    assert after[1] <= before[1], f"/dev/shm kvbridge segments grew {before[1]} -> {after[1]}"


def _levels(pids: set[int]) -> dict:
    """This process's open descriptors and agents, and the /dev/shm segments of `pids` (see the docstring)."""
    from kvbridge.transport.agent import resource_figures
    gc.collect()
    shm = sorted(n for n in os.listdir("/dev/shm")
                 if (m := re.match(r"kvbridge-(\d+)-", n)) and int(m.group(1)) in pids)
    return {"fds": _fd_names(), "shm": shm, **resource_figures()}


def _assert_same(before: dict, after: dict) -> None:
    """Equal figures; descriptors are compared by count and named in the message when they differ."""
    grew = {k: (before[k], after[k]) for k in before if k != "fds" and before[k] != after[k]}
    if len(after["fds"]) != len(before["fds"]):
        old = {x.split(":", 1)[1] for x in before["fds"]}
        grew["fds"] = (len(before["fds"]), len(after["fds"]),
                       f"opened {sorted(x for x in after['fds'] if x.split(':', 1)[1] not in old)}")
    assert not grew, f"resources did not come back to their level before the fault: {grew}"


def _fd_names() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the listing's own descriptor
            pass
    return out


def _rank_figures(pre, timeout: float = 10.0) -> dict:
    """Prefill rank 0's figures once its agent holds no decode peer (their processes are gone), or
    whatever it holds after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        fig = pre.ranks[0].call(rp.GetFigures(), rp.Figures, 10).figures
        if fig["peers"] == 0 or time.monotonic() > deadline:
            return fig
        time.sleep(0.2)


def test_decode_rank_killed_mid_transfer_prefill_releases_once(engines) -> None:  # noqa: F811
    lease = 1.0
    pl = EngineLayout(tp_size=1, block_size=16, num_blocks=64)
    dl2 = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    requests = _requests(pl, dl2, 2, seed=11)
    warm, victim = requests
    pre = engines("prefill", "prefill", pl, "pull")
    pre.start(60)
    pre.load(_shards(pl, requests), 30)
    pids = {p.pid for p in pre.ranks}
    # Warm-up cycle: a decode engine connects, completes a request and stops (cleanly).
    dec = engines("decode", "decode-a", dl2, "pull")
    pids |= {p.pid for p in dec.ranks}
    dec.start(60)
    dec.connect(pre.address, 10)
    dec.receive(_receives(requests, [warm]), 10)
    pre.add(_adds(requests, [warm]), 10)
    assert dec.wait_results([warm], 15) and all(dec.results[r][warm]["ok"] for r in (0, 1)), dec.results
    assert pre.wait_released([warm], 5)
    dec.stop()
    before, rank_before = _levels(pids), _rank_figures(pre)
    # The fault's cycle: a decode engine under the same id whose rank 1 dies mid-request.
    dec = engines("decode", "decode-a", dl2, "pull")
    pids |= {p.pid for p in dec.ranks}
    dec.start(60)
    dec.connect(pre.address, 10)
    dec.receive(_receives(requests, [victim]), 10)
    dec.ranks[1].kill()  # announced its destination, then died before reading
    t0 = time.monotonic()
    pre.add(_adds(requests, [victim], lease), 10)
    assert pre.wait_released([victim], lease + 5)
    waited = time.monotonic() - t0
    (rel,) = _releases(pre, victim)
    assert rel[1].startswith(f"lease expired after {lease:.1f} s (1/2 decode ranks done)"), rel
    assert waited < lease + 3  # released after the lease, no hang
    # The surviving decode rank completed its own share, byte-checked by the connector.
    deadline = time.monotonic() + 5
    while victim not in dec.results[0] and time.monotonic() < deadline:
        dec.ranks[0].pump(0.05)
        dec.collect(dec.ranks[0])
    assert dec.results[0][victim]["ok"], dec.results[0]
    time.sleep(1.0)
    pre.pump(0.2)
    assert len(_releases(pre, victim)) == 1  # exactly once
    assert all(p.alive() for p in pre.ranks)  # the prefill engine survived the peer's death
    # Nothing of the fault stays behind, here or in the surviving prefill rank.
    dec.stop()
    after, rank_after = _levels(pids), _rank_figures(pre)
    _assert_same(before, after)
    assert rank_after == rank_before, f"surviving prefill rank: {rank_before} before, {rank_after} after"


def _extra_producers(cluster: Cluster, engine_id: str, config: ConnectorConfig) -> list[Producer]:
    """A second set of prefill ranks over the same caches (a restarted or replacement engine)."""
    prods: list[Producer] = []
    for r in range(cluster.prefill.tp_size):
        t = make_transport("shm", f"{engine_id}/{r}/{time.monotonic_ns()}", timeout_s=config.transfer_timeout)
        prods.append(Producer(engine_id, r, cluster.src[r], t, mode=cluster.mode, config=config,
                              on_release=lambda rid, why, r=r: cluster.released.append((r, rid, why))))
    prods[0].set_peer_addresses([p.address for p in prods])
    return prods


def _close(prods: list[Producer]) -> None:
    for p in prods:
        p.close()
        p.transport.close()


def _free(cluster: Cluster) -> None:
    from kvbridge.transport.shm import free_shared
    for c in cluster.src + cluster.dst:
        free_shared(c)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_side_channel_dropped_mid_request_then_reconnect(no_growth, mode: str) -> None:
    pre = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=1, block_size=16, num_blocks=64, kv_order="NHD")
    cl = Cluster(pre, dec, mode=mode, config=FAST, seed=21)
    extra: list[Producer] = []
    try:
        cl.connect()
        wl = Workload(cl, 4, seed=21)
        a, b, c, d = wl.requests
        wl.receive([a, b])
        wl.add([a, b], ranks=[0])  # prefill rank 0 delivers its half of both
        cl.run_until(lambda: len(cl.releases_of(a)) == 1 and len(cl.releases_of(b)) == 1, 5)
        t0 = time.monotonic()
        cl.producers[1].server.close()  # prefill rank 1's side-channel endpoint goes away mid-request
        cl.run_until(lambda: cl.done(a) and cl.done(b), FAST.transfer_timeout + 2)
        assert time.monotonic() - t0 < FAST.transfer_timeout + 1
        for rid in (a, b):
            res = cl.results[(0, rid)]
            assert not res.ok and ("rank(s) [1] lost" in res.reason or "timed out" in res.reason), res.reason
        # Rank 1 still gets prefill's word for the requests: no reader can reach it, so each lease
        # expires once; the blocks are released exactly once per rank.
        wl.add([a, b], ranks=[1])
        cl.run_until(lambda: len(cl.releases_of(a)) == 2 and len(cl.releases_of(b)) == 2,
                     FAST.lease_seconds + 3)
        cl.run_for(0.5)
        for rid in (a, b):
            rel = sorted(cl.releases_of(rid))
            assert [r for r, _ in rel] == [0, 1], rel
        # Reconnect: the replacement prefill engine's side channel serves the next requests.
        extra = _extra_producers(cl, "prefill-2", FAST)
        with pumping(extra):
            assert cl.consumers[0].connect(extra[0].address, 5) == "prefill-2"
        for rid in (c, d):
            rq = wl.requests[rid]
            cl.consumers[0].receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens, engine_id="prefill-2")
            for p in extra:
                p.add_request(rid, rq.src_block_ids, rq.num_tokens, first_token=7)
        end = time.monotonic() + 10
        while not cl.done(c) or not cl.done(d):
            assert time.monotonic() < end, cl.results
            for p in extra:
                p.progress(0.001)
            cl.step()
        assert cl.results[(0, c)].ok and cl.results[(0, d)].ok
        end = time.monotonic() + 5
        while (len(cl.releases_of(c)) < 2 or len(cl.releases_of(d)) < 2) and time.monotonic() < end:
            for p in extra:
                p.progress(0.001)
        assert sorted(cl.releases_of(c)) == [(0, "done"), (1, "done")]
    finally:
        _close(extra)
        cl.close()
        _free(cl)


def test_prefill_peer_restarts_with_same_engine_id() -> None:
    pre = EngineLayout(tp_size=1, block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=1, block_size=16, num_blocks=64, kv_order="NHD")
    # Warm-up cycle: the same engines without the fault, one request, closed.
    cl = Cluster(pre, dec, config=FAST, seed=30)
    try:
        cl.connect()
        wl = Workload(cl, 1, seed=30)
        (w,) = wl.requests
        wl.receive()
        wl.add()
        cl.run_until(lambda: cl.done(w) and len(cl.releases_of(w)) == 1, 10)
        assert cl.results[(0, w)].ok
    finally:
        cl.close()
        _free(cl)
    before = _levels({os.getpid()})
    cl = Cluster(pre, dec, config=FAST, seed=31)
    restarted: list[Producer] = []
    fresh = None
    try:
        cl.connect()
        wl = Workload(cl, 3, seed=31)
        a, b, c = wl.requests
        wl.receive([a])
        t0 = time.monotonic()
        old = cl.producers[0]
        old.close()  # the prefill rank goes down with `a` in flight (announced, never added);
        old.transport.close()  # as a process that dies, it takes its transport agent with it
        cl.producers = []
        restarted = _extra_producers(cl, "prefill", FAST)  # same engine id, new address
        end = time.monotonic() + FAST.transfer_timeout + 2
        while not cl.done(a):
            assert time.monotonic() < end, "old in-flight request did not fail in time"
            for p in restarted:
                p.progress(0.001)
            cl.step()
        assert time.monotonic() - t0 < FAST.transfer_timeout + 1
        res = cl.results[(0, a)]
        assert not res.ok and res.reason, res
        assert "lost" in res.reason or "timed out" in res.reason or "closed" in res.reason, res.reason
        # Designed behaviour: the decode rank still knows engine "prefill"; a second handshake under
        # the same id is refused with a clear error rather than silently mixing two incarnations.
        with pumping(restarted), pytest.raises(m.HandshakeRefused, match="already connected"):
            cl.consumers[0].connect(restarted[0].address, 5)
        # A changed layout under the same id is refused by the topology.
        from kvbridge.errors import IncompatibleEngines
        topo = cl.consumers[0].topology
        with pytest.raises(IncompatibleEngines, match="restarted peer needs a new engine id"):
            topo.register_remote_engine("prefill", EngineLayout(tp_size=1, block_size=32, num_blocks=32))
        # A restarted decode side (fresh consumer) handshakes with the restarted peer; new requests succeed.
        from kvbridge.connector.consumer import Consumer
        t = make_transport("shm", f"decode-2/0/{time.monotonic_ns()}", timeout_s=FAST.transfer_timeout)
        fresh = Consumer("decode-2", 0, cl.dst[0], t, mode="pull", config=FAST)
        with pumping(restarted):
            assert fresh.connect(restarted[0].address, 5) == "prefill"
        for rid in (b, c):
            rq = wl.requests[rid]
            fresh.receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens)
            restarted[0].add_request(rid, rq.src_block_ids, rq.num_tokens, first_token=7, to_engine="decode-2")
        got = {}
        end = time.monotonic() + 10
        while len(got) < 2:
            assert time.monotonic() < end, got
            restarted[0].progress(0.001)
            for r in fresh.progress(0.001):
                got[r.request_id] = r
        assert got[b].ok and got[c].ok, got
        end = time.monotonic() + 5
        while (len(cl.releases_of(b)) < 1 or len(cl.releases_of(c)) < 1) and time.monotonic() < end:
            restarted[0].progress(0.001)
        assert cl.releases_of(b) == [(0, "done")] and cl.releases_of(c) == [(0, "done")]
        assert cl.releases_of(a) == []  # never added on either incarnation: nothing to release
    finally:
        if fresh is not None:
            fresh.close()
            fresh.transport.close()
        _close(restarted)
        cl.close()
        _free(cl)
    _assert_same(before, _levels({os.getpid()}))


def test_prefill_peer_restarted_at_the_same_address_is_not_resumed() -> None:
    """A lost side channel is resumed only with the same incarnation: a peer restarted under the same
    engine id at the same address answers the decode rank's re-handshake with another transport
    agent, and stays lost (requests needing it fail at once), as the topology refuses to mix two
    incarnations under one id."""
    pre = EngineLayout(tp_size=1, block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=1, block_size=16, num_blocks=64, kv_order="NHD")
    cl = Cluster(pre, dec, config=FAST, seed=41)
    restarted: list[Producer] = []
    try:
        cl.connect()
        wl = Workload(cl, 1, seed=41)
        (a,) = wl.requests
        old = cl.producers[0]
        address = old.address
        old.close()
        old.transport.close()
        cl.producers = []
        cl.run_until(lambda: cl.consumers[0].lost_sources("prefill") == (0,), 10)
        t = make_transport("shm", f"prefill/0/{time.monotonic_ns()}", timeout_s=FAST.transfer_timeout)
        restarted.append(Producer("prefill", 0, cl.src[0], t, listen=address, config=FAST))
        with pumping(restarted):
            end = time.monotonic() + FAST.handshake_timeout + 10
            while not cl.consumers[0].stats["sources_replaced"]:
                assert time.monotonic() < end, dict(cl.consumers[0].stats)
                cl.step()
        assert cl.consumers[0].lost_sources("prefill") == (0,)
        restarted[0].progress(0.1)
        assert restarted[0].stats["errors_received"] == 1  # told why, for its logs
        wl.receive([a])
        cl.run_until(lambda: cl.done(a), 2)
        res = cl.results[(0, a)]
        assert not res.ok and "rank(s) [0] lost" in res.reason, res
    finally:
        _close(restarted)
        cl.close()
        _free(cl)

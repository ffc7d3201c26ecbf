"""Fleets behind a router (issue 22 point 4), in one process with real side channels and shm:

* a prefill engine serving two decode engines of different shapes, whose requests no one names
  to it (vLLM's router does not): each request goes to the decode engine that claims it (its
  first heartbeat names the request), every byte where it belongs;
* remote engines that leave are forgotten (`ConnectorConfig.remote_engine_ttl`, as vLLM's
  transfer topology unregisters them), and over many join/leave cycles the state, descriptors
  and memory of the engine that stays are bounded.
"""

from __future__ import annotations

import gc
import os
import resource
import time

from connector_harness import SECRET, Cluster, Workload, pumping

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.consumer import Consumer
from kvbridge.connector.producer import Producer
from kvbridge.connector.transports import make_transport
from kvbridge.core.layout import EngineLayout
from kvbridge.proofs.verify import clone_caches, expected_destination, mismatch_report

PREFILL = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
CONFIG = ConnectorConfig(lease_seconds=10, transfer_timeout=10, abort_timeout=1, secret=SECRET,
                         remote_engine_ttl=0.5, heartbeat_interval=0.1)


def test_unnamed_requests_go_to_the_decode_engine_that_claims_them():
    a = Cluster(PREFILL, EngineLayout(tp_size=1, block_size=16, num_blocks=64), config=CONFIG, decode_id="decode-a")
    b = Cluster(PREFILL, EngineLayout(tp_size=2, block_size=16, num_blocks=64), config=CONFIG, decode_id="decode-b",
                prefill_id="unused")
    try:
        a.connect()
        with pumping(a.producers):
            for c in b.consumers:
                c.connect(a.address, 5.0)
        assert sorted(a.producers[0].decode_engines) == ["decode-a", "decode-b"]
        work = Workload(a, 8, seed=3)
        rids = list(work.requests)
        mine, theirs = rids[:4], rids[4:]
        before_b = clone_caches(b.dst)
        work.receive(mine)
        for rid in theirs:
            rq = work.requests[rid]
            for c in b.consumers:
                c.receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens)
        a.run_for(0.2)  # the claims (heartbeats naming each request) reach the prefill ranks
        for rid in rids:
            assert {p.claimant(rid) for p in a.producers} == {"decode-a" if rid in mine else "decode-b"}
        work.add()  # to_engine=None: nobody names the decode engine
        results = {}

        def all_done() -> bool:
            a.step()
            for c in b.consumers:
                for res in c.progress(0.001):
                    results[(c.rank, res.request_id)] = res
            return all(a.done(r) for r in mine) and len(results) == 2 * len(theirs)
        a.run_until(all_done, 20)
        assert all(a.results[(0, r)].ok for r in mine), a.results
        assert all(r.ok for r in results.values()), results
        assert not work.mismatches(mine)
        expected = clone_caches(before_b)
        for rid in theirs:
            expected_destination(expected, work.requests[rid])
        assert not mismatch_report(b.dst, expected)
    finally:
        b.close()
        a.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


LAYOUT = EngineLayout(tp_size=1, block_size=16, num_blocks=8)
CHURN = ConnectorConfig(lease_seconds=10, transfer_timeout=10, abort_timeout=1, secret=SECRET,
                        remote_engine_ttl=0.2, heartbeat_interval=0.05)
CYCLES = 25


def _endpoint(kind, name: str, cycle: int):
    from connector_harness import SPEC

    from kvbridge.connector.transports import allocate_cache
    from kvbridge.proofs.verify import random_bytes
    cache = allocate_cache("shm", SPEC, LAYOUT, 0, f"test-fleet-{name}")
    random_bytes([cache], cycle)
    return kind(name, 0, cache, make_transport("shm", f"{name}/0", timeout_s=10), config=CHURN)


def _one_request(producer: Producer, consumer: Consumer, rid: str) -> None:
    with pumping([producer]):
        engine = consumer.connect(producer.address, 5.0)
    consumer.receive(rid, [[1, 2]], num_tokens=20, engine_id=engine)
    end, got = time.monotonic() + 10, []
    while not got and time.monotonic() < end:
        if producer.claimant(rid) and rid not in producer.active:
            producer.add_request(rid, [[3, 4]], 20)  # unnamed: the claimant reads it
        producer.progress(0.001)
        got = consumer.progress(0.001)
    assert got and got[0].ok, got


def _close(endpoint) -> None:
    from kvbridge.transport.shm import release_shared
    endpoint.close()
    endpoint.transport.close()
    release_shared(endpoint.cache)  # the segment the test allocated for it


def _cycles(stays, make, count: int, known) -> list[tuple[int, int]]:
    """`count` peers made by `make(cycle)` each serve one request with `stays` and leave; returns
    (descriptors, peak RSS KiB) after each, once `known()` shows the peer forgotten."""
    figures = []
    for cycle in range(count):
        peer = make(cycle)
        try:
            if isinstance(stays, Consumer):
                _one_request(peer, stays, f"r{cycle}")
            else:
                _one_request(stays, peer, f"r{cycle}")
        finally:
            _close(peer)
        end = time.monotonic() + 5
        while known() and time.monotonic() < end:
            stays.progress(0.01)
        assert not known(), f"cycle {cycle}: the engine that left is still known"
        gc.collect()
        figures.append((_fds(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    return figures


def _bounded(figures: list[tuple[int, int]]) -> None:
    settled, last = figures[5], figures[-1]
    assert last[0] <= settled[0] + 4, figures  # descriptors flat after warm-up
    assert last[1] - settled[1] < 64 * 1024, figures  # peak RSS (KiB) grows under 64 MiB over 20 cycles


def test_engines_that_leave_are_forgotten_and_state_stays_bounded():
    """A decode engine stays while 25 prefill engines come and go (each a new incarnation with its
    own engine id, as a restarted instance is), then a prefill engine stays while 25 decode engines
    come and go: every request completes, each engine that left is forgotten within the TTL (the
    decode side after one, the prefill side after two), and descriptors and memory stop growing."""
    for (kind, name, seed), peer, known in (((Consumer, "stays-d", 0), (Producer, "prefill"),
                                             lambda e: e.prefill_engines or e.topology.remote_engine_ids),
                                            ((Producer, "stays-p", 1), (Consumer, "decode"),
                                             lambda e: e.decode_engines or e.topology.remote_engine_ids)):
        stays = _endpoint(kind, name, seed)
        try:
            figures = _cycles(stays, lambda i, peer=peer: _endpoint(peer[0], f"{peer[1]}-{i}", i), CYCLES,
                              lambda stays=stays, known=known: known(stays))
            assert stays.stats["engines_forgotten"] == CYCLES
            _bounded(figures)
        finally:
            _close(stays)


def test_a_prefill_engine_restarted_on_the_same_address_is_handshaken():
    """A prefill instance killed and started again on its ports under a new engine id (a new
    incarnation): the decode rank's connection to the old one keeps reconnecting there, and the
    new handshake must still be answered (it shared the old connection's routing id, which the new
    ROUTER ignored: 'no reply within 120 s')."""
    from connector_harness import SPEC

    from kvbridge.connector.transports import allocate_cache
    from kvbridge.proofs.vllm.cluster import free_ports
    consumer = _endpoint(Consumer, "stays-d2", 0)
    address = f"127.0.0.1:{free_ports(1)}"
    try:
        for incarnation in range(2):
            cache = allocate_cache("shm", SPEC, LAYOUT, 0, f"test-fleet-x{incarnation}")
            producer = Producer(f"prefill-x-{incarnation}", 0, cache,
                                make_transport("shm", f"x{incarnation}/0", timeout_s=10), config=CHURN, listen=address)
            try:
                _one_request(producer, consumer, f"x{incarnation}")
            finally:
                _close(producer)
            consumer.progress(0.05)  # the side channel to the dead incarnation is now lost
    finally:
        _close(consumer)


def test_a_lost_first_claim_is_named_again_within_seconds_not_a_heartbeat_period():
    """A decode rank's first claim of a request is lost (its `_claim` made a no-op here, as in a
    fleet continued from SIGSTOP, where leases waited 17-111 s): the rank names every received
    request its source ranks have not announced again each `CLAIM_REFRESH_S`, so the prefill ranks
    learn the claimant within seconds, not at the periodic heartbeat (100 s here)."""
    from kvbridge.connector.consumer import CLAIM_REFRESH_S
    slow = ConnectorConfig(lease_seconds=600, transfer_timeout=600, abort_timeout=1, secret=SECRET,
                           heartbeat_interval=100.0)
    a = Cluster(PREFILL, EngineLayout(tp_size=1, block_size=16, num_blocks=64), config=slow, decode_id="decode-a")
    try:
        a.connect()
        for c in a.consumers:
            c._claim = lambda eng, rid: None  # the first claim never leaves
        work = Workload(a, 3, seed=5)
        rids = list(work.requests)
        work.receive(rids)
        a.run_for(0.2)
        assert {p.claimant(r) for p in a.producers for r in rids} == {None}
        a.run_for(CLAIM_REFRESH_S + 2.0)
        assert {p.claimant(r) for p in a.producers for r in rids} == {"decode-a"}
        assert all(c.stats["claims_refreshed"] for c in a.consumers)
        work.add()
        a.run_until(lambda: a.step() or all(a.done(r) for r in rids), 30)
        assert all(a.results[(0, r)].ok for r in rids), a.results
        assert not work.mismatches(rids)
    finally:
        a.close()

"""The request lifecycle with the real shared-memory transport and real ZMQ side channels.

Producers and consumers live in this process (one transport agent and socket set each) and are
driven by one loop, so timing-dependent rules (leases, heartbeats, deadlines) are tested
deterministically. Every test checks the destination bytes or the release record, not only
the reported status.
"""

from __future__ import annotations

import time

import pytest
from connector_harness import SPEC, Cluster, Workload, require, snapshot

from kvbridge.connector import messages as m
from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.errors import InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec

SECRET = generate_secret()  # per test run, shared by both engines of every cluster here


def L(tp: int, block: int = 16, blocks: int = 96, **kw) -> EngineLayout:  # noqa: N802
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=blocks, **kw)


SHAPES = {
    "P2>D1": (L(2), L(1, 8, 192, kv_order="NHD")),
    "P1<D2": (L(1, 32, 48), L(2)),
    "P3-D2-nondivisible": (L(3), L(2, 8, 192, kv_order="NHD")),
}


@pytest.fixture
def cluster_factory():
    made: list[Cluster] = []

    def make(*args, **kw) -> Cluster:
        c = Cluster(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_rank_receives_every_request_byte_exact(cluster_factory, shape: str, mode: str) -> None:
    prefill, decode = SHAPES[shape]
    cl = cluster_factory(prefill, decode, mode=mode)
    cl.connect()
    work = Workload(cl, 12, seed=3)
    work.receive()
    work.add()
    cl.run_until(lambda: all(cl.done(rid) for rid in work.requests), 10)
    assert all(r.ok for r in cl.results.values()), [r.reason for r in cl.results.values() if not r.ok]
    assert work.mismatches() == []
    cl.run_until(lambda: len(cl.released) == len(work.requests) * prefill.tp_size, 5)
    for rid in work.requests:  # each prefill rank released each request exactly once, as done
        assert sorted(r for r, _ in cl.releases_of(rid)) == list(range(prefill.tp_size))
        assert all(why.startswith("done") for _, why in cl.releases_of(rid))
    # A decode rank reads from all its source ranks; its result counts their bytes.
    for c in cl.consumers:
        assert c.source_ranks("prefill") == c.topology.source_ranks("prefill")
        if mode == "pull":
            assert all(cl.results[(c.rank, rid)].nbytes > 0 for rid in work.requests)


def test_32_requests_in_flight_pull_and_push(cluster_factory) -> None:
    for mode in ("pull", "push"):
        cl = cluster_factory(L(2, 16, 256), L(3, 16, 256), mode=mode, prefill_id=f"p-{mode}", decode_id=f"d-{mode}")
        cl.connect()
        work = Workload(cl, 32, seed=11, max_tokens=64)
        work.receive()
        work.add()  # all 32 leased and announced at once, before any progress
        assert all(len(p.active) == 32 for p in cl.producers)
        cl.run_until(lambda: len(cl.results) == 32 * 3, 15)
        assert all(r.ok for r in cl.results.values())
        assert work.mismatches() == []
        cl.run_until(lambda: len(cl.released) == 32 * 2, 5)


def test_requests_announced_before_receive_are_claimed(cluster_factory) -> None:
    cl = cluster_factory(*SHAPES["P2>D1"])
    cl.connect()
    work = Workload(cl, 3, seed=5)
    work.add()
    cl.run_for(0.1)
    assert {a.request_id for a in cl.consumers[0].unclaimed()} == set(work.requests)
    work.receive()
    cl.run_until(lambda: all(cl.done(rid) for rid in work.requests), 5)
    assert all(r.ok and r.first_token == 7 for r in cl.results.values())
    assert work.mismatches() == []


def test_decode_rank_that_never_reads_is_released_after_the_lease_exactly_once(cluster_factory) -> None:
    cfg = ConnectorConfig(lease_seconds=0.6, transfer_timeout=5, abort_timeout=1, secret=SECRET)
    cl = cluster_factory(L(1), L(2), config=cfg)
    cl.connect()
    work = Workload(cl, 1, seed=1)
    (rid,) = work.requests
    work.receive(ranks=[0])  # decode rank 1 never reads
    t0 = time.monotonic()
    work.add()
    cl.run_until(lambda: cl.releases_of(rid), 5)
    waited = time.monotonic() - t0
    assert cl.releases_of(rid) == [(0, cl.releases_of(rid)[0][1])]
    assert cl.releases_of(rid)[0][1].startswith("lease expired after 0.6 s (1/2 decode ranks done)")
    assert 0.55 <= waited < 2.0
    cl.run_for(0.8)  # nothing more: exactly once
    assert len(cl.releases_of(rid)) == 1
    assert cl.results[(0, rid)].ok
    # The silent rank asking now learns at once that the request is gone (the expiry's Abort).
    rq = work.requests[rid]
    cl.consumers[1].receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens)
    cl.run_until(lambda: (1, rid) in cl.results, 2)
    assert not cl.results[(1, rid)].ok and "lease expired" in cl.results[(1, rid)].reason


def test_heartbeats_extend_the_lease(cluster_factory) -> None:
    """Lease 0.6 s, heartbeats every 0.1 s: decode rank 1 reads 1.5 s late and still finds the blocks."""
    cfg = ConnectorConfig(lease_seconds=0.6, heartbeat_interval=0.1, transfer_timeout=5, abort_timeout=1,
                          secret=SECRET)
    cl = cluster_factory(L(1), L(2), config=cfg)
    cl.connect()
    work = Workload(cl, 1, seed=2)
    (rid,) = work.requests
    rq = work.requests[rid]
    # Decode rank 0 reads at once; rank 1's engine has the request queued (expect) and heartbeats it.
    cl.consumers[0].receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens)
    cl.consumers[1].expect(rid)
    work.add()
    cl.run_for(1.5)
    assert cl.released == [] and not cl.done(rid, [1]) and cl.done(rid, [0])
    cl.consumers[1].receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens)
    cl.run_until(lambda: cl.done(rid) and cl.released, 3)
    assert all(r.ok for r in cl.results.values()) and cl.releases_of(rid) == [(0, "done")]
    assert cl.producers[0].stats["heartbeats"] >= 5
    assert work.mismatches() == []


def test_expectation_expires_and_an_expected_abort_releases_early(cluster_factory) -> None:
    cfg = ConnectorConfig(lease_seconds=5, heartbeat_interval=0.1, transfer_timeout=5, abort_timeout=1, secret=SECRET)
    cl = cluster_factory(L(1), L(1), config=cfg)
    cl.connect()
    work = Workload(cl, 1, seed=3)
    (rid,) = work.requests
    cl.consumers[0].expect(rid, timeout=0.3)
    work.add()
    cl.run_for(0.5)
    assert cl.consumers[0].stats["expectations_expired"] == 1 and cl.released == []
    cl.consumers[0].expect(rid)
    assert cl.consumers[0].abort(rid, "user cancelled")
    cl.run_until(lambda: cl.released, 2)  # long before the 5 s lease
    assert cl.releases_of(rid)[0][1].startswith("aborted by decode 'decode' rank 0: user cancelled")


def test_heartbeats_stop_and_lease_expires_without_them(cluster_factory) -> None:
    cfg = ConnectorConfig(lease_seconds=0.5, heartbeat_interval=0.1, transfer_timeout=5, abort_timeout=1,
                          secret=SECRET)
    cl = cluster_factory(L(1), L(1), config=cfg)
    cl.connect()
    work = Workload(cl, 1, seed=2)
    (rid,) = work.requests
    work.add()  # announced, never received: no heartbeats for it
    cl.run_until(lambda: cl.released, 3)
    assert cl.releases_of(rid)[0][1].startswith("lease expired")


def test_consumer_deadline_names_the_missing_source_and_aborts(cluster_factory) -> None:
    cfg = ConnectorConfig(lease_seconds=10, transfer_timeout=1.0, abort_timeout=1, secret=SECRET)
    cl = cluster_factory(L(2), L(1, 8, 192), config=cfg)
    cl.connect()
    work = Workload(cl, 2, seed=4)
    first, second = work.requests
    t0 = time.monotonic()
    work.receive([first])
    work.add([first], ranks=[0])  # prefill rank 1 never finishes this request
    cl.run_until(lambda: cl.releases_of(first), 2)  # rank 0 was read and released as done
    assert cl.releases_of(first) == [(0, "done")]
    cl.run_until(lambda: cl.done(first), 3)
    took = time.monotonic() - t0
    res = cl.results[(0, first)]
    assert not res.ok and res.quiesced
    assert res.reason == "timed out after 1.0 s: no RequestReady from prefill ranks [1]"
    assert 0.95 <= took < 2.5
    cl.run_for(0.2)  # the decode side's Abort reaches rank 1, which has not leased the request yet
    work.add([first], ranks=[1])  # rank 1 finishes late: the remembered Abort ends the lease at once
    cl.run_until(lambda: len(cl.releases_of(first)) == 2, 2)
    assert cl.releases_of(first)[1][0] == 1 and "before prefill finished" in cl.releases_of(first)[1][1]
    # The engines recover: the next request completes.
    work.receive([second])
    work.add([second])
    cl.run_until(lambda: cl.done(second), 3)
    assert cl.results[(0, second)].ok
    assert work.mismatches([first, second]) != []  # the failed request's blocks were only partly written
    assert [x for x in work.mismatches([second]) if "region" in x] == work.mismatches([second])


def test_abort_by_decode_mid_transfer(cluster_factory) -> None:
    for mode in ("pull", "push"):
        cl = cluster_factory(L(2), L(1, 8, 192), mode=mode, prefill_id=f"p-{mode}", decode_id=f"d-{mode}")
        cl.connect()
        work = Workload(cl, 2, seed=6)
        first, second = work.requests
        work.receive()
        work.add([first], ranks=[0])  # rank 0 has delivered, rank 1 not yet: the transfer is in flight
        cl.run_for(0.1)
        assert not cl.done(first)
        assert cl.consumers[0].abort(first, "client went away")
        cl.run_until(lambda: cl.done(first), 2)
        res = cl.results[(0, first)]
        assert not res.ok and res.reason == "client went away" and res.quiesced
        assert not cl.consumers[0].abort(first)  # idempotent: nothing left to abort
        work.add([first], ranks=[1])
        cl.run_until(lambda: len(cl.releases_of(first)) == 2, 2)
        assert sorted(r for r, _ in cl.releases_of(first)) == [0, 1]  # each rank exactly once
        work.add([second])
        cl.run_until(lambda: cl.done(second), 3)
        assert cl.results[(0, second)].ok
        cl.run_for(0.2)
        assert len(cl.releases_of(first)) == 2


def test_abort_by_prefill_mid_transfer_push_stops_writes_before_release(cluster_factory) -> None:
    cl = cluster_factory(L(2), L(1, 8, 192), mode="push")
    cl.connect()
    work = Workload(cl, 2, seed=8)
    first, second = work.requests
    work.receive()
    work.add([first])
    assert cl.producers[1].abort(first, "engine preempted it")  # before its writes could complete
    assert cl.releases_of(first) == [(1, "engine preempted it")]  # released synchronously, after stopping
    cl.run_until(lambda: cl.done(first), 3)
    res = cl.results[(0, first)]
    assert not res.ok and "prefill 'prefill' rank 1 aborted: engine preempted it" in res.reason and res.quiesced
    cl.run_until(lambda: len(cl.releases_of(first)) == 2, 2)
    quiet = snapshot(cl.dst)
    cl.run_for(0.2)
    assert all((a == b).all() for a, b in zip(quiet, snapshot(cl.dst)))  # nothing writes after the result
    assert not cl.producers[1].abort(first)  # idempotent
    work.add([second])
    cl.run_until(lambda: cl.done(second), 3)
    assert cl.results[(0, second)].ok


def test_duplicate_late_and_unknown_notifications_are_harmless(cluster_factory) -> None:
    cl = cluster_factory(L(1), L(1))
    cl.connect()
    work = Workload(cl, 2, seed=9)
    first, second = work.requests
    work.receive([first])
    work.add([first])
    cl.run_until(lambda: cl.done(first) and cl.released, 3)
    producer, consumer = cl.producers[0], cl.consumers[0]
    client = consumer._engines["prefill"].clients[0]
    before = dict(producer.stats)
    # A duplicate and a late ReadDone on the side channel, one for a request nobody knows, and a
    # late one as a transport notification.
    for rid in (first, first, "never-was"):
        assert client.send(m.ReadDone("decode", 0, rid))
    consumer.transport.send_notification(producer.agent_name, m.encode(m.ReadDone("decode", 0, first)))
    cl.run_for(0.3)
    assert cl.releases_of(first) == [(0, "done")]
    assert producer.stats["late_notifications"] >= before.get("late_notifications", 0) + 3
    assert producer.stats["unknown_notifications"] >= 1
    # A duplicate while the request is live (two reader notifications for one rank) counts once.
    work.receive([second])
    work.add([second])
    cl.run_until(lambda: cl.done(second), 3)
    assert client.send(m.ReadDone("decode", 0, second))
    cl.run_until(lambda: cl.releases_of(second), 2)
    cl.run_for(0.2)
    assert cl.releases_of(second) == [(0, "done")]
    assert work.mismatches() == []


def test_late_write_done_on_the_decode_side_is_harmless(cluster_factory) -> None:
    cl = cluster_factory(L(1), L(1), mode="push")
    cl.connect()
    work = Workload(cl, 1, seed=10)
    (rid,) = work.requests
    work.receive()
    work.add()
    cl.run_until(lambda: cl.done(rid) and cl.released, 3)
    producer = cl.producers[0]
    peer = producer._engines["decode"][0]
    for _ in range(2):
        assert producer.server.send(peer, m.WriteDone("prefill", 0, rid))
    cl.run_for(0.2)
    assert cl.consumers[0].stats["late_notifications"] >= 2
    assert len(cl.results) == 1 and cl.results[(0, rid)].ok and len(cl.released) == 1


def test_source_block_ids_outside_the_regions_are_refused_before_any_byte_moves(cluster_factory) -> None:
    cl = cluster_factory(L(1, blocks=16), L(1))
    cl.connect()
    work = Workload(cl, 1, seed=12, fill=False)
    (rid,) = work.requests
    rq = work.requests[rid]
    work.receive()
    producer = cl.producers[0]
    bad = tuple(tuple(b + 1000 for b in g) for g in rq.src_block_ids)
    producer.server.send(producer._engines["decode"][0], m.RequestReady("prefill", 0, rid, bad, rq.num_tokens, 5.0))
    cl.run_until(lambda: cl.done(rid), 3)
    res = cl.results[(0, rid)]
    assert not res.ok and "block id 1" in res.reason and "outside [0, 16)" in res.reason and res.nbytes == 0
    assert work.mismatches([]) == []  # the destination is untouched


def test_message_claiming_another_identity_is_refused(cluster_factory) -> None:
    cl = cluster_factory(L(1), L(2))
    cl.connect()
    work = Workload(cl, 1, seed=13)
    (rid,) = work.requests
    work.receive(ranks=[0])
    work.add()
    cl.run_until(lambda: cl.done(rid, [0]), 3)
    # Decode rank 0's connection sends a ReadDone in rank 1's name: refused, no release.
    cl.consumers[0]._engines["prefill"].clients[0].send(m.ReadDone("decode", 1, rid))
    cl.run_for(0.3)
    assert cl.released == [] and cl.producers[0].stats["refused_frames"] >= 1


def test_bad_receive_calls_are_refused(cluster_factory) -> None:
    cl = cluster_factory(L(1), L(1), mode="push")
    cl.connect()
    c = cl.consumers[0]
    with pytest.raises(InvalidRequest, match="push mode needs num_tokens"):
        c.receive("r", ((1,),))
    with pytest.raises(InvalidRequest, match=r"block id 96 outside \[0, 96\)"):
        c.receive("r", ((96,),), num_tokens=1)
    with pytest.raises(InvalidRequest, match="20 tokens need 2 blocks of 16, got 1"):
        c.receive("r", ((1,),), num_tokens=20)
    with pytest.raises(InvalidRequest, match="'nope' is not connected"):
        c.receive("r", ((1,),), num_tokens=1, engine_id="nope")
    p = cl.producers[0]
    with pytest.raises(InvalidRequest, match=r"block id -1 outside"):
        p.add_request("r", ((-1,),), 1)
    p.add_request("r", ((1,),), 1)
    with pytest.raises(InvalidRequest, match="already known"):
        p.add_request("r", ((2,),), 1)


def test_close_is_idempotent_and_releases_leases(cluster_factory) -> None:
    cl = cluster_factory(L(1), L(1))
    cl.connect()
    work = Workload(cl, 1, seed=14)
    work.add()
    cl.producers[0].close()
    cl.producers[0].close()
    (rid,) = work.requests
    assert cl.releases_of(rid) == [(0, "producer closed")]
    cl.consumers[0].close()
    cl.consumers[0].close()


@pytest.mark.parametrize("kind, mode", [("nixl", "pull"), ("mooncake", "push")])
def test_network_transports(cluster_factory, kind: str, mode: str) -> None:
    """The same lifecycle over a network engine (the multi-process tests run both modes of each)."""
    require(kind)
    cl = cluster_factory(L(2), L(1, 8, 192, kv_order="NHD"), mode=mode, transport=kind)
    cl.connect()
    work = Workload(cl, 4, seed=15)
    work.receive()
    work.add()
    cl.run_until(lambda: len(cl.results) == 4, 15)
    assert all(r.ok for r in cl.results.values()), [r.reason for r in cl.results.values()]
    assert work.mismatches() == []
    cl.run_until(lambda: len(cl.released) == 8, 5)


def test_geometry_is_shared_with_the_helpers() -> None:
    assert SPEC.num_layers == 2 and isinstance(SPEC, ModelSpec)


def test_readers_are_confirmed_once_they_speak_after_their_hello(cluster_factory) -> None:
    """What the vLLM sidecar leases by: a reader past its handshake (`Producer.confirmed_ranks`),
    confirmed by any frame of its own after its Hello (`Consumer.touch` sends an empty one)."""
    cl = cluster_factory(L(1), L(2))
    cl.connect()
    producer, (c0, c1) = cl.producers[0], cl.consumers
    cl.run_until(lambda: producer.reader_ranks("decode") == (0, 1), 5)
    assert producer.reader_ranks("decode") == (0, 1) and producer.reader_ranks("other") == ()
    assert producer.confirmed_ranks("decode") == ()  # handshook, silent since
    assert c1.touch("prefill") == ()
    cl.run_until(lambda: producer.confirmed_ranks("decode") == (1,), 5)
    assert producer.confirmed_ranks("decode") == (1,)
    assert c0.touch("prefill") == ()
    cl.run_until(lambda: producer.confirmed_ranks("decode") == (0, 1), 5)
    assert producer.confirmed_ranks("decode") == (0, 1)
    assert c0.remote_layout("prefill") == L(1)

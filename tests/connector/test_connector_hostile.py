"""Hostile or broken peers, refused before any byte moves (what the other test files do not cover).

Already covered elsewhere: source block ids outside the regions (lifecycle), a message claiming
another identity (lifecycle), unknown engine / wrong fingerprint / version / role / mode /
transport at handshake (handshake), malformed, truncated, oversized and other-version frames and
hypothesis fuzz of the decoder (messages), missing/bad/replayed MACs (auth). Here: a destination
outside the registered regions (push), a plan that would touch memory beyond the request's
blocks, messages before a handshake, and a stream of garbage frames into a live prefill rank
that keeps serving.
"""

from __future__ import annotations

import os
import random

import zmq
from connector_harness import Cluster, Workload, snapshot

from kvbridge.connector import messages as m
from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.core.layout import EngineLayout

SECRET = generate_secret()  # per test run, shared by both engines of every cluster here

CFG = ConnectorConfig(lease_seconds=5, transfer_timeout=3, abort_timeout=1, secret=SECRET)


def L(tp: int, blocks: int = 64, block: int = 16) -> EngineLayout:
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=blocks)


def test_push_destination_outside_the_regions_refused_before_any_write() -> None:
    cl = Cluster(L(1), L(1, blocks=16), mode="push", config=CFG)
    try:
        cl.connect()
        work = Workload(cl, 1, seed=21, min_tokens=20, max_tokens=20)
        (rid,) = work.requests
        rq = work.requests[rid]
        before = snapshot(cl.dst)
        work.add()
        bad = tuple(tuple(b + 1000 for b in g) for g in rq.dst_block_ids)
        # A decode peer (its real connection) names destination blocks it does not have.
        cl.consumers[0]._engines["prefill"].clients[0].send(
            m.DestinationReady("decode", 0, rid, bad, rq.num_tokens))
        cl.run_until(lambda: cl.releases_of(rid), 3)
        (release,) = cl.releases_of(rid)
        assert "invalid destination from decode rank 0" in release[1] and "outside" in release[1], release
        assert cl.producers[0].stats["bytes_written"] == 0
        assert all((a == b).all() for a, b in zip(snapshot(cl.dst), before))
    finally:
        cl.close()


def test_plan_beyond_the_requests_blocks_refused() -> None:
    """An announcement whose token count needs more blocks than it lists would read past the request."""
    cl = Cluster(L(1), L(1), config=CFG)
    try:
        cl.connect()
        work = Workload(cl, 1, seed=22, min_tokens=40, max_tokens=40, fill=False)
        (rid,) = work.requests
        rq = work.requests[rid]
        cl.consumers[0].receive(rid, rq.dst_block_ids)  # pull: token count from the announcement
        producer = cl.producers[0]
        short = tuple(g[:1] for g in rq.src_block_ids)  # 1 block of 16 for 40 tokens
        producer.server.send(producer._engines["decode"][0],
                             m.RequestReady("prefill", 0, rid, short, rq.num_tokens, 5.0))
        cl.run_until(lambda: cl.done(rid), 3)
        res = cl.results[(0, rid)]
        assert not res.ok and res.nbytes == 0 and "invalid request from prefill rank 0" in res.reason, res.reason
        assert work.mismatches([]) == []
        # More tokens than this rank's blocks hold: refused the same way.
        rid2 = "too-many-tokens"
        cl.consumers[0].receive(rid2, rq.dst_block_ids)
        producer.server.send(producer._engines["decode"][0],
                             m.RequestReady("prefill", 0, rid2, rq.src_block_ids, 10_000, 5.0))
        cl.run_until(lambda: cl.done(rid2), 3)
        res2 = cl.results[(0, rid2)]
        assert not res2.ok and res2.nbytes == 0, res2
        assert work.mismatches([]) == []
    finally:
        cl.close()


def test_messages_before_a_handshake_and_garbage_stream_are_refused_and_service_continues() -> None:
    # Unauthenticated: the raw peer's garbage must reach the decoder (tests/security covers the
    # same stream against an authenticated server).
    cl = Cluster(L(2), L(1), config=ConnectorConfig(lease_seconds=5, transfer_timeout=3, abort_timeout=1, insecure=True))
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{cl.address}")
    try:
        cl.connect()
        work = Workload(cl, 2, seed=23)
        first, second = work.requests
        # An unknown peer (no Hello) claims to be the decode engine and says it read everything.
        raw.send(m.encode(m.ReadDone("decode", 0, first)))
        raw.send(m.encode(m.Abort("decode", 0, first, "hostile")))
        rng = random.Random(5)
        frames = [os.urandom(rng.randint(0, 200)) for _ in range(200)]
        valid = m.encode(m.Heartbeat("decode", 0, (first,)))
        frames += [valid[:i] for i in range(len(valid))]  # every truncation of a valid frame
        for f in frames:
            raw.send_multipart([f] if f else [b""])
        raw.send_multipart([valid, valid, valid])  # wrong part count
        work.add()
        work.receive()
        cl.run_until(lambda: cl.done(first) and cl.done(second), 10)
        assert all(r.ok for r in cl.results.values()), cl.results
        assert work.mismatches() == []
        refused = cl.producers[0].stats["refused_frames"]
        assert refused >= len(frames) + 2, refused
        assert cl.producers[0].stats["aborts_received"] == 0  # the hostile Abort never counted
        replies = 0
        while raw.poll(100) and replies < 10_000:
            msg = m.decode(raw.recv())
            assert isinstance(msg, m.Error)
            replies += 1
        assert replies >= 1
    finally:
        raw.close(0)
        cl.close()

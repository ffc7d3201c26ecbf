"""Each backend with real processes on loopback: a plan moved byte-exactly between rank caches in
two processes (pull and push, P>D and P<D, direct and staged), notifications after the bytes,
failures with reasons within a deadline, abort, idempotent close."""

from __future__ import annotations

import glob
import os
import random
import time

import numpy as np
import pytest
import torch

from kvbridge.errors import InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.base import Runs, XferState
from kvbridge.testing.peer import PeerProcess, runs_between
from kvbridge.proofs.verify import random_request

SPEC = ModelSpec.uniform(2, 4, 16, "bfloat16", "tiny-gqa")
DEADLINE = 15.0


def options(backend: str, staged: bool) -> dict:
    if backend == "shm":
        return {"timeout_s": DEADLINE}
    if staged:  # 4 KiB windows: every transfer spans several, pipelined through 6 slots
        return {"timeout_s": DEADLINE, "slot_bytes": 4096, "staging_bytes": 6 * 4096, "stage_below": 1 << 20}
    return {"timeout_s": DEADLINE, "stage_below": 0, "staging_bytes": 0}


def setup_pair(child, here, names, backend, P, D, request, staged, p_fill="pattern"):
    """Prefill agents (one per rank) in the child, decode agents here, all connected both ways."""
    opts = options(backend, staged)
    pn = [names(f"P{r}") for r in range(P.tp_size)]
    dn = [names(f"D{r}") for r in range(D.tp_size)]
    for r, n in enumerate(pn):
        child.create(backend, n, **opts)
        child.alloc(n, SPEC, P, r, p_fill, request.src_block_ids, request.num_tokens, seed=r + 1)
    for r, n in enumerate(dn):
        here.create(backend, n, **opts)
        here.alloc(n, SPEC, D, r, "random", seed=100 + r)
    for p in pn:
        md = child.metadata(p)
        for d in dn:
            here.connect(d, p, md)
            child.connect(p, d, here.metadata(d))
    return pn, dn


SHAPES = {
    "P2-D1": (EngineLayout(tp_size=2, block_size=4, num_blocks=24), EngineLayout(tp_size=1, block_size=8, num_blocks=12)),
    "P1-D2": (EngineLayout(tp_size=1, block_size=8, num_blocks=12, kv_order="NHD"),
              EngineLayout(tp_size=2, block_size=4, num_blocks=24)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_read_plan_byte_exact_and_notified(backend, child, here, names, shape, staged):
    if backend == "shm" and staged:
        pytest.skip("shm copies directly between mapped segments; it has no staging path")
    P, D = SHAPES[shape]
    request = random_request(SPEC, P, D, 70, 0, random.Random(shape))
    plan = plan_request(SPEC, P, D, request)
    pn, dn = setup_pair(child, here, names, backend, P, D, request, staged)
    for d in dn:
        here.snapshot(d)
    expected_notes = {p: [] for p in pn}
    for di, d in enumerate(dn):
        ids = []
        for si, p in enumerate(pn):
            runs = runs_between(plan, si, di, "read")
            if len(runs):
                note = f"read-done {d} {p}".encode()
                expected_notes[p].append((d, note))
                ids.append(here.submit(d, p, "read", runs, note))
        assert here.wait(d, ids, DEADLINE) == [("done", "")] * len(ids)
        assert here.verify(d, request) == []
    for p, want in expected_notes.items():
        got = child.notifications(p, len(want), DEADLINE)
        assert sorted(got) == sorted(want)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_write_plan_notification_arrives_after_bytes(backend, child, here, names, shape, staged):
    if backend == "shm" and staged:
        pytest.skip("shm copies directly between mapped segments; it has no staging path")
    P, D = SHAPES[shape]
    request = random_request(SPEC, P, D, 70, 0, random.Random(shape + "w"))
    plan = plan_request(SPEC, P, D, request)
    pn, dn = setup_pair(child, here, names, backend, P, D, request, staged)
    for d in dn:
        here.snapshot(d)
    posted, want = [], {d: 0 for d in dn}
    for si, p in enumerate(pn):
        for di, d in enumerate(dn):
            runs = runs_between(plan, si, di, "write")
            if len(runs):
                posted.append((p, child.submit(p, d, "write", runs, f"write-done {p}".encode())))
                want[d] += 1
    # Wait on the notifications only (not on the writers' handles): each one must mean its bytes landed.
    for d in dn:
        got = here.notifications(d, want[d], DEADLINE)
        assert len(got) == want[d], got
        assert {s for s, _ in got} <= set(pn)
    for d in dn:
        assert here.verify(d, request) == []
    for p, hid in posted:
        assert child.wait(p, [hid], DEADLINE) == [("done", "")]


def test_notifications_both_ways(backend, child, here, names):
    P, D = SHAPES["P1-D2"]
    request = random_request(SPEC, P, D, 8, 0, random.Random(0))
    (p,), (d0, d1) = setup_pair(child, here, names, backend, P, D, request, False, p_fill="const")
    here.send_notification(d0, p, b"heartbeat 1")
    here.send_notification(d1, p, b"heartbeat 2")
    child.send_notification(p, d1, b"release 7")
    assert sorted(child.notifications(p, 2, DEADLINE)) == [(d0, b"heartbeat 1"), (d1, b"heartbeat 2")]
    assert here.notifications(d1, 1, DEADLINE) == [(p, b"release 7")]
    assert here.notifications(d0, 0, 0.05) == []


def test_many_runs_complete(backend, child, here, names):
    """Far more runs than Mooncake's batch bound (64), sent direct: bounded batches, all checked."""
    P, D = EngineLayout(tp_size=1, block_size=2, num_blocks=80), EngineLayout(tp_size=2, block_size=2, num_blocks=80)
    request = random_request(SPEC, P, D, 150, 0, random.Random(5))
    plan = plan_request(SPEC, P, D, request)
    (p,), dn = setup_pair(child, here, names, backend, P, D, request, False)
    runs = runs_between(plan, 0, 1, "read")
    assert len(runs) > 4 * 64
    here.snapshot(dn[1])
    hid = here.submit(dn[1], p, "read", runs)
    assert here.wait(dn[1], [hid], DEADLINE) == [("done", "")]
    assert here.verify(dn[1], request) == []


def test_invalid_runs_refused_before_anything_moves(backend, child, here, names):
    P, D = SHAPES["P2-D1"]
    request = random_request(SPEC, P, D, 20, 0, random.Random(1))
    pn, (d,) = setup_pair(child, here, names, backend, P, D, request, False, p_fill="const")
    agent = here.agents[d]
    one = np.array([0], np.int64)
    size = agent._sizes[0]
    with pytest.raises(InvalidRequest, match="outside the registered regions"):
        agent.submit(pn[0], "read", Runs(one, np.array([size - 8]), one, one, np.array([16])))
    with pytest.raises(InvalidRequest, match="region 99"):
        agent.submit(pn[0], "read", Runs(np.array([99]), one, one, one, np.array([16])))
    with pytest.raises(InvalidRequest, match="unknown peer"):
        agent.submit("nobody", "read", Runs(one, one, one, one, np.array([16])))
    with pytest.raises(InvalidRequest, match="op must be"):
        agent.submit(pn[0], "move", Runs(one, one, one, one, np.array([16])))
    with pytest.raises(InvalidRequest, match="metadata is for agent"):
        agent.connect("impostor", child.metadata(pn[0]))


def test_dead_peer_fails_with_reason_within_deadline(backend, here, names):
    """The peer process is killed (SIGKILL): reads and writes to it fail with a reason, fast."""
    P, D = SHAPES["P2-D1"]
    request = random_request(SPEC, P, D, 40, 0, random.Random(2))
    plan = plan_request(SPEC, P, D, request)
    modes = [False] if backend == "shm" else [False, True]
    doomed = PeerProcess()
    try:
        pairs = [setup_pair(doomed, here, names, backend, P, D, request, staged) for staged in modes]
        for pn, (d,) in pairs:  # live peers work
            hid = here.submit(d, pn[0], "read", runs_between(plan, 0, 0, "read"))
            assert here.wait(d, [hid], DEADLINE) == [("done", "")]
        doomed.kill()
        t0 = time.monotonic()
        ids = [(d, [here.submit(d, pn[0], "read", runs_between(plan, 0, 0, "read")),
                    here.submit(d, pn[1], "write", runs_between(plan, 1, 0, "read"), b"never")]) for pn, (d,) in pairs]
        results = [here.wait(d, hids, DEADLINE + 5) for d, hids in ids]
        elapsed = time.monotonic() - t0
    finally:
        doomed.kill()
    for result in results:
        assert [s for s, _ in result] == ["failed", "failed"], result
        assert all(reason for _, reason in result), result
    assert elapsed < DEADLINE + 2, (elapsed, results)
    with pytest.raises(Exception):
        here.send_notification(pairs[0][1][0], pairs[0][0][0], b"anyone there?")
    if backend == "shm":  # the killed owner's segments are left behind, then reaped by the next allocation
        from kvbridge.transport.shm import reap_stale_segments
        reap_stale_segments()
        assert not glob.glob(f"/dev/shm/kvbridge-{doomed.pid}-*")


def test_a_peer_starved_past_one_send_try_is_waited_for_not_failed(backend, here, names):
    """The peer process is stopped (SIGSTOP) before this side's notification channel to it has
    connected, and continued 5 s later: a starved peer is slow, not gone, so the read and its
    notification complete within the deadline (one 2 s send try used to fail the read after
    its bytes had landed)."""
    import signal
    P, D = SHAPES["P1-D2"]
    request = random_request(SPEC, P, D, 40, 0, random.Random(4))
    plan = plan_request(SPEC, P, D, request)
    opts = options(backend, staged=False)
    starved = PeerProcess()
    p, d = names("P"), names("D")
    try:
        starved.create(backend, p, **opts)
        starved.alloc(p, SPEC, P, 0, "pattern", request.src_block_ids, request.num_tokens, seed=1)
        md = starved.metadata(p)
        here.create(backend, d, **opts)
        here.alloc(d, SPEC, D, 0, "random", seed=5)
        here.snapshot(d)
        os.kill(starved.pid, signal.SIGSTOP)
        try:
            here.connect(d, p, md)
            hid = here.submit(d, p, "read", runs_between(plan, 0, 0, "read"), b"read-done")
            time.sleep(5)
        finally:
            os.kill(starved.pid, signal.SIGCONT)
        assert here.wait(d, [hid], DEADLINE + 5) == [("done", "")]
        assert here.verify(d, request) == []
        assert starved.notifications(p, 1) == [(d, b"read-done")]
    finally:
        starved.kill()


def test_abort_stops_touching_memory(backend, child, here, names):
    spec = ModelSpec.uniform(4, 8, 128, "bfloat16", "abort")
    P, D = EngineLayout(tp_size=1, block_size=16, num_blocks=40), EngineLayout(tp_size=2, block_size=16, num_blocks=40)
    request = random_request(spec, P, D, 600, 0, random.Random(3))
    plan = plan_request(spec, P, D, request)
    p, d = names("P"), names("D")
    opts = options(backend, staged=backend != "shm")
    if backend != "shm":
        opts.update(slot_bytes=64 << 10, staging_bytes=4 * (64 << 10))
    child.create(backend, p, **opts)
    child.alloc(p, spec, P, 0, "pattern", request.src_block_ids, request.num_tokens, seed=1)
    here.create(backend, d, **opts)
    here.alloc(d, spec, D, 0, "random", seed=9)
    here.connect(d, p, child.metadata(p))
    child.connect(p, d, here.metadata(d))
    runs = runs_between(plan, 0, 0, "read")
    hid = here.submit(d, p, "read", runs)
    state, reason = here.abort(d, hid)
    assert state in ("failed", "done")
    if state == "failed":
        assert "abort" in reason
    here.snapshot(d)  # after abort returned nothing may change any more
    time.sleep(0.3)
    assert here.unchanged(d) == []
    here.snapshot(d)  # and the agent still works
    hid = here.submit(d, p, "read", runs)
    assert here.wait(d, [hid], DEADLINE) == [("done", "")]
    assert here.verify(d, request) == []


def test_close_is_idempotent_and_cleans_up(backend, child, here, names):
    P, D = SHAPES["P1-D2"]
    request = random_request(SPEC, P, D, 30, 0, random.Random(4))
    plan = plan_request(SPEC, P, D, request)
    (p,), (d0, d1) = setup_pair(child, here, names, backend, P, D, request, False)
    agent = here.agents[d0]
    hid = here.submit(d0, p, "read", runs_between(plan, 0, 0, "read"))
    assert here.wait(d0, [hid], DEADLINE) == [("done", "")]
    segments = [c.shm_segment.path for c in (here.caches[d0],)] if backend == "shm" else []
    agent.close()
    agent.close()
    for path in segments:
        assert not os.path.exists(path)
    with pytest.raises(InvalidRequest, match="closed"):
        agent.submit(p, "read", runs_between(plan, 0, 0, "read"))
    assert agent.notifications() == []
    child.close_agent(p)
    child.close_agent(p)
    # The other decode agent sees the closed peer fail, not hang.
    hid = here.submit(d1, p, "read", runs_between(plan, 0, 1, "read"))
    state, reason = here.wait(d1, [hid], DEADLINE + 5)[0]
    if backend == "shm":  # the mapping outlives the peer's close: the copy is still legal
        assert state == "done"
    else:
        assert state == "failed" and reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NIXL VRAM registration needs a CUDA GPU; this host has none "
                    "(the DRAM path is what the other tests exercise)")
def test_nixl_vram_registration(names):
    from kvbridge.transport.nixl import NixlTransport
    a, b = NixlTransport(names("gpuA")), NixlTransport(names("gpuB"))
    try:
        src = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        a.register([dst])
        b.register([src])
        a.connect(b.name, b.metadata())
        one = np.array([0], np.int64)
        h = a.submit(b.name, "read", Runs(one, one, one, one, np.array([1 << 20])))
        end = time.monotonic() + DEADLINE
        while a.poll(h) == XferState.PENDING and time.monotonic() < end:
            time.sleep(0.001)
        assert h.state == XferState.DONE, h.reason
        assert torch.equal(src, dst)
    finally:
        a.close()
        b.close()

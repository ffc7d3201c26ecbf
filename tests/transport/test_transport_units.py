"""Pure pieces of the transports (stream windows, per-block splitting, the channel) and a bench smoke run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbridge.transport.staging import _slot_offsets, _window_bounds, stream_windows
from kvbridge.transport.base import Runs
from kvbridge.bench.transport import bench_transport, split_at_blocks
from kvbridge.transport.notify import NOTIFY, Channel, PeerUnreachable


@pytest.mark.parametrize("seed", range(20))
def test_stream_windows_cover_every_byte_once(seed):
    rng = np.random.default_rng(seed)
    length = rng.integers(1, 5000, size=rng.integers(1, 60)).astype(np.int64)
    slot = int(rng.choice([64, 1000, 4096]))
    run, within, plen, window = stream_windows(length, slot)
    bounds = _window_bounds(window)
    off = _slot_offsets(plen, bounds)
    assert plen.sum() == length.sum() and (plen > 0).all()
    np.testing.assert_array_equal(np.bincount(run, weights=plen, minlength=len(length)), length)
    for w in range(len(bounds) - 1):  # each window packs its pieces from 0, within one slot
        s = slice(bounds[w], bounds[w + 1])
        assert off[s][0] == 0 and (off[s][1:] == np.cumsum(plen[s])[:-1]).all()
        assert plen[s].sum() <= slot
    assert (np.diff(window) >= 0).all()
    # stream order: piece k+1 continues piece k inside the same run, or starts the next run at 0
    cont = run[1:] == run[:-1]
    assert (within[1:][cont] == (within[:-1] + plen[:-1])[cont]).all()
    assert (within[1:][~cont] == 0).all()


def test_split_at_blocks_cuts_runs_on_both_sides():
    runs = Runs(np.array([0, 1]), np.array([10, 0]), np.array([2, 3]), np.array([5, 96]), np.array([40, 70]))
    out = split_at_blocks(runs, 16, 32)
    assert out.nbytes == runs.nbytes
    assert ((out.local_offset // 16) == ((out.local_offset + out.length - 1) // 16)).all()
    assert ((out.remote_offset // 32) == ((out.remote_offset + out.length - 1) // 32)).all()
    # offsets advance together on both sides
    np.testing.assert_array_equal(out.local_offset - np.repeat([10, 0], np.bincount(out.local_region)),
                                  out.remote_offset - np.repeat([5, 96], np.bincount(out.local_region)))


def test_channel_delivers_in_order_and_refuses_dead_peers():
    a, b = Channel("a", send_timeout_ms=300), Channel("b", send_timeout_ms=300)
    try:
        a.connect("b", b.endpoint)
        for i in range(5):
            a.send("b", NOTIFY, str(i).encode())
        got, end = [], time.monotonic() + 5
        while len(got) < 5 and time.monotonic() < end:
            got += b.recv(50)
        assert got == [("a", NOTIFY, str(i).encode()) for i in range(5)]
        b.close()
        time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match="no live connection"):
            for _ in range(3):  # the first send may still find the dying connection
                a.send("b", NOTIFY, b"x")
        assert time.monotonic() - t0 < 3
        with pytest.raises(PeerUnreachable, match="not connected"):
            a.send("c", NOTIFY, b"x")
    finally:
        a.close()
        b.close()


def test_bench_transport_smoke(backend):
    r = bench_transport(backend, num_tokens=32, repeats=1)
    d = r.to_dict()
    assert d["verified"] and d["bytes"] == 32 * 32 * 2 * 8 * 128 * 2 // 1  # llama-3-8b: all of it to 2 ranks
    assert d["per_block_runs"] >= d["num_runs"] > 0
    assert d["ours_gbps"] > 0 and d["contiguous_gbps"] > 0 and d["per_block_gbps"] > 0
    assert d["contiguous_per_rank_gbps"] > 0 and d["ratio_vs_contiguous_per_rank"] > 0
    assert d["staged"] == (backend == "mooncake")



def test_releasing_a_segment_leaves_the_neighbour_that_ends_where_it_starts():
    """mmap places a new segment in the hole a freed one left, often right after a live one; the
    release found segments by a zero-length probe, which also matched the segment ending there, and
    unlinked that neighbour (a fleet test saw a prefill engine's cache vanish mid-handshake)."""
    import gc
    import os

    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.spec import ModelSpec
    from kvbridge.transport.shm import allocate_shared, release_shared

    spec = ModelSpec.uniform(num_layers=4, num_kv_heads=4, head_dim=32, dtype="float16")
    layout = EngineLayout(tp_size=1, block_size=16, num_blocks=16)
    made = [allocate_shared(spec, layout, 0, f"adj{i}") for i in range(8)]
    for cache in made[1::2]:
        release_shared(cache)
    older = made[::2]
    del made
    gc.collect()
    newer = [allocate_shared(spec, layout, 0, f"adj-again{i}") for i in range(4)]
    try:
        pairs = [(o, n) for o in older for n in newer
                 if o.shm_segment.addr + o.shm_segment.nbytes == n.shm_segment.addr]
        if not pairs:
            pytest.skip("mmap placed no new segment right after an older one on this host (the fault needs that)")
        for neighbour, cache in pairs:
            release_shared(cache)
            assert not os.path.exists(cache.shm_segment.path)
            assert os.path.exists(neighbour.shm_segment.path), "releasing one segment unlinked its neighbour"
    finally:
        for cache in older + newer:
            release_shared(cache)
    assert not any(os.path.exists(c.shm_segment.path) for c in older + newer)

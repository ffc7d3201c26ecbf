"""Faults across real processes: a prefill rank killed mid-transfer, a decode rank that never
reads, an abort mid-transfer. After each: no hang (every wait here is bounded), the affected
request fails with a reason, releases happen exactly once, and the next request succeeds.

The caches hold a pattern that encodes every element's coordinates (`kvbridge.proofs.verify`), and the
decode ranks' bytes are checked after recovery, so "succeeds" means byte-exact.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from connector_harness import SPEC, disjoint_requests

from kvbridge.connector import processes as rp
from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.proofs.rank_engines import DecodeEngine, PrefillEngine
from kvbridge.connector.processes import process_context
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request
from kvbridge.proofs.verify import expected_destination, fill_source, mismatch_report

SECRET = generate_secret()  # per test run, shared by both engines of every cluster here

CFG = ConnectorConfig(lease_seconds=4, transfer_timeout=3, abort_timeout=1, handshake_timeout=5, secret=SECRET)
PRE = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
DEC = EngineLayout(tp_size=1, block_size=8, num_blocks=128, kv_order="NHD")
DEC_FILL = 1001  # DecodeEngine's default: rank r starts as random bytes from seed 1001 + r


def _requests(prefill: EngineLayout, decode: EngineLayout, count: int, seed: int) -> dict[str, Request]:
    return disjoint_requests(SPEC, prefill, decode, count, seed, prefix=f"r{seed}-")


def _shards(layout: EngineLayout, requests: dict[str, Request]) -> list[list[np.ndarray]]:
    caches = RankCache.allocate_engine(SPEC, layout)
    for rq in requests.values():
        fill_source(caches, rq.src_block_ids, rq.num_tokens)
    return [[r.numpy().copy() for r in c.byte_regions()] for c in caches]


def _adds(requests: dict[str, Request], rids: list[str], lease: float | None = None) -> list[rp.Lease]:
    return [rp.Lease(rid, requests[rid].src_block_ids, requests[rid].num_tokens, 7, lease) for rid in rids]


def _receives(requests: dict[str, Request], rids: list[str], engine: str | None = None) -> list[rp.Incoming]:
    return [rp.Incoming(rid, requests[rid].dst_block_ids, requests[rid].num_tokens, CFG.transfer_timeout, engine)
            for rid in rids]


def _decode_mismatches(dec: DecodeEngine, requests: dict[str, Request], ok: list[str],
                       ignore: tuple[str, ...] = ()) -> list[str]:
    """Compare every decode rank's bytes with its start state plus exactly the `ok` requests.

    The rows of the `ignore`d (failed) requests may hold anything: a failure may leave a
    request's own blocks half written, never any other byte.
    """
    actual, expected = [], []
    for p in dec.ranks:
        regions = dec.regions(p.args.rank, 10)
        actual.append(RankCache(SPEC, dec.layout, p.args.rank,
                                [torch.from_numpy(r).view(torch.bfloat16) for r in regions]))
        start = RankCache.allocate(SPEC, dec.layout, p.args.rank)
        gen = torch.Generator().manual_seed(DEC_FILL + p.args.rank)
        for r in start.byte_regions():
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
        expected.append(start)
    for rid in ok:
        expected_destination(expected, requests[rid])
    for rid in ignore:
        rq = requests[rid]
        for a, e in zip(actual, expected):
            for li in range(SPEC.num_layers):
                ids = rq.dst_block_ids[SPEC.layer_group[li]]
                pos = np.arange(rq.num_tokens)
                for ci in range(2):
                    e.write_tokens(li, ci, ids, pos, a.read_tokens(li, ci, ids, pos, as_int=True))
    return mismatch_report(actual, expected)


@pytest.fixture
def engines():
    made: list = []

    def make(kind: str, engine_id: str, layout: EngineLayout, mode: str):
        ctx = process_context()
        if kind == "prefill":
            e = PrefillEngine(ctx, "shm", engine_id, SPEC, layout, mode, "127.0.0.1:0", CFG)
        else:
            e = DecodeEngine(ctx, "shm", engine_id, SPEC, layout, mode, "127.0.0.1", CFG)
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def _releases(pre: PrefillEngine, rid: str) -> list[tuple[int, str]]:
    return [(rank, why) for rank, events in pre.releases.items() for r, why in events if r == rid]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_rank_killed_mid_transfer(engines, mode: str) -> None:
    requests = _requests(PRE, DEC, 3, seed=1)
    first, second, third = requests
    pre = engines("prefill", "prefill-a", PRE, mode)
    dec = engines("decode", "decode", DEC, mode)
    pre.start(60)
    pre.load(_shards(PRE, requests), 30)
    dec.start(60)
    dec.connect(pre.address, 10)
    dec.receive(_receives(requests, [first]), 10)
    # Prefill rank 0 delivers its half; rank 1 dies before delivering its own.
    pre.ranks[0].send(rp.Add(_adds(requests, [first])))
    deadline = time.monotonic() + 10
    while not _releases(pre, first) and time.monotonic() < deadline:
        pre.pump(0.02)
    assert _releases(pre, first) == [(0, "done")]
    t0 = time.monotonic()
    pre.ranks[1].kill()
    assert dec.wait_results([first], CFG.transfer_timeout + 3)
    waited = time.monotonic() - t0
    res = dec.results[0][first]
    assert not res["ok"] and res["quiesced"]
    assert "rank(s) [1] lost" in res["reason"] or "timed out" in res["reason"], res["reason"]
    assert waited < CFG.transfer_timeout + 1.5  # failed within its timeout: no hang
    # The decode engine recovers: a fresh prefill engine serves the next requests, byte-exact.
    pre_b = engines("prefill", "prefill-b", PRE, mode)
    pre_b.start(60)
    pre_b.load(_shards(PRE, requests), 30)
    dec.connect(pre_b.address, 10)
    dec.receive(_receives(requests, [second, third], "prefill-b"), 10)
    pre_b.add(_adds(requests, [second, third]), 10)
    assert dec.wait_results([second, third], 10)
    assert dec.results[0][second]["ok"] and dec.results[0][third]["ok"]
    assert pre_b.wait_released([second, third], 5)
    # Only the killed request's own blocks may differ (half written); every other byte is exact.
    assert _decode_mismatches(dec, requests, [second, third], ignore=(first,)) == []
    pre.pump(0.2)
    assert _releases(pre, first) == [(0, "done")]  # never twice


def test_decode_rank_that_never_reads_prefill_releases_after_lease_once(engines) -> None:
    cfg_lease = 1.0
    layout_d = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    requests = _requests(PRE, layout_d, 1, seed=2)
    (rid,) = requests
    pre = engines("prefill", "prefill", EngineLayout(tp_size=1, block_size=16, num_blocks=64), "pull")
    dec = engines("decode", "decode", layout_d, "pull")
    pre.start(60)
    pre.load(_shards(pre.layout, requests), 30)
    dec.start(60)
    dec.connect(pre.address, 10)
    dec.ranks[0].call(rp.Receive(_receives(requests, [rid])), rp.Receiving, 10)  # decode rank 1 never reads
    t0 = time.monotonic()
    pre.add(_adds(requests, [rid], cfg_lease), 10)
    assert pre.wait_released([rid], 10)
    waited = time.monotonic() - t0
    (release,) = _releases(pre, rid)
    assert release[0] == 0 and release[1].startswith("lease expired after 1.0 s (1/2 decode ranks done)")
    assert cfg_lease - 0.05 <= waited < cfg_lease + 2
    time.sleep(1.0)
    pre.pump(0.1)
    assert len(_releases(pre, rid)) == 1  # exactly once
    dec.pump(0.1)
    assert dec.results[0][rid]["ok"] and rid not in dec.results[1]


def test_abort_mid_transfer_then_recover(engines) -> None:
    requests = _requests(PRE, DEC, 2, seed=3)
    first, second = requests
    pre = engines("prefill", "prefill", PRE, "pull")
    dec = engines("decode", "decode", DEC, "pull")
    pre.start(60)
    pre.load(_shards(PRE, requests), 30)
    dec.start(60)
    dec.connect(pre.address, 10)
    dec.receive(_receives(requests, [first]), 10)
    pre.ranks[0].send(rp.Add(_adds(requests, [first])))
    deadline = time.monotonic() + 10
    while not _releases(pre, first) and time.monotonic() < deadline:
        pre.pump(0.02)
    t0 = time.monotonic()
    assert dec.ranks[0].call(rp.Abort(first, "request cancelled by the user"), rp.Aborted, 5).aborted is True
    assert dec.wait_results([first], 3)
    assert time.monotonic() - t0 < 1.5
    res = dec.results[0][first]
    assert not res["ok"] and res["reason"] == "request cancelled by the user" and res["quiesced"]
    time.sleep(0.2)  # the Abort reaches prefill rank 1 before it finishes the request
    pre.ranks[1].send(rp.Add(_adds(requests, [first])))
    assert pre.wait_released([first], 3)  # released at once, not after the 4 s lease
    assert "before prefill finished: request cancelled by the user" in dict(_releases(pre, first))[1]
    dec.receive(_receives(requests, [second]), 10)
    pre.add(_adds(requests, [second]), 10)
    assert dec.wait_results([second], 10) and dec.results[0][second]["ok"]
    assert pre.wait_released([second], 5)
    pre.pump(0.2)
    assert sorted(r for r, _ in _releases(pre, first)) == [0, 1]
    assert sorted(r for r, _ in _releases(pre, second)) == [0, 1]
    assert _decode_mismatches(dec, requests, [second], ignore=(first,)) == []

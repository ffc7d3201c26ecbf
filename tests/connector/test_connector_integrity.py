"""End-to-end integrity in the connector (`ConnectorConfig(checksum=True)`).

Each prefill rank sends its share of every decode rank's logical checksum with the request's
announcement; each decode rank recomputes over what landed. Bytes flipped in flight (in the
source after the checksum was taken, before the read or write) fail the request with its id and
a reason; intact requests pass, whatever the TP shapes on either side.
"""

from __future__ import annotations

import pytest
from connector_harness import Cluster, Workload

from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.core.layout import EngineLayout

SECRET = generate_secret()  # per test run, shared by both engines of every cluster here

CFG = ConnectorConfig(lease_seconds=5, transfer_timeout=5, abort_timeout=1, checksum=True, secret=SECRET)


def _flip_source_byte(cluster: Cluster, workload: Workload, rid: str) -> None:
    """Flip one byte of the request's first source block on prefill rank 0 (after the checksum)."""
    rq = workload.requests[rid]
    cache = cluster.src[0]
    block = rq.src_block_ids[0][0]
    rows = cache.read_tokens(0, 0, rq.src_block_ids[0], [0])  # token 0, layer 0, K
    flipped = rows.clone()
    flipped.view(-1).view(__import__("torch").uint8)[0] ^= 0xFF
    cache.write_tokens(0, 0, rq.src_block_ids[0], [0], flipped)
    assert block >= 0


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("shapes", [(2, 3), (3, 1)])
def test_checksum_detects_corruption_in_flight(mode: str, shapes: tuple[int, int]) -> None:
    pre = EngineLayout(tp_size=shapes[0], block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=shapes[1], block_size=8, num_blocks=128, kv_order="NHD")
    cluster = Cluster(pre, dec, mode=mode, config=CFG)
    try:
        cluster.connect()
        work = Workload(cluster, 3, seed=5, min_tokens=20, max_tokens=60)
        good, bad, good2 = list(work.requests)
        work.add()  # checksums are taken here, before any reader is told
        _flip_source_byte(cluster, work, bad)
        work.receive()
        cluster.run_until(lambda: all(cluster.done(r) for r in work.requests), 10)
        for rid in (good, good2):
            assert all(cluster.results[(d, rid)].ok for d in range(dec.tp_size)), cluster.results
        results = [cluster.results[(d, bad)] for d in range(dec.tp_size)]
        assert any(not r.ok for r in results), "the corrupted request passed"
        # Exactly the decode rank whose rows include the flipped byte (token 0, layer 0, the first head
        # of prefill rank 0) fails the check. It aborts the request at prefill rank 0, so a decode rank
        # still reading from that rank when the abort lands fails with that abort (timing decides).
        detected = [r for r in results if r.reason.startswith("integrity check failed on decode rank")]
        assert len(detected) == 1 and "corrupted" in detected[0].reason, results
        assert detected[0].reason.startswith("integrity check failed on decode rank 0:"), detected[0].reason
        aborted = [r for r in results if not r.ok and r not in detected]
        for res in results:
            assert res.request_id == bad
            assert res.ok or res.quiesced
        for res in aborted:
            assert res.reason.startswith("prefill 'prefill' rank 0 aborted: aborted by decode 'decode' rank 0: "
                                         "integrity check failed"), res.reason
        assert sum(c.stats["checksum_mismatches"] for c in cluster.consumers) == 1
        assert sum(c.stats["checksums_verified"] for c in cluster.consumers) == 3 * dec.tp_size - len(aborted)
        cluster.run_until(lambda: all(len({r for r, _ in cluster.releases_of(x)}) == pre.tp_size
                                      for x in work.requests), 5)
        cluster.run_for(0.1)
        for rid in work.requests:
            assert len(cluster.releases_of(rid)) == pre.tp_size  # exactly once per prefill rank
    finally:
        cluster.close()


def test_checksum_detects_corruption_in_destination_before_verification() -> None:
    """Bytes changed in the destination after landing (before the last source finished) fail too."""
    pre = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    dec = EngineLayout(tp_size=1, block_size=16, num_blocks=64)
    cluster = Cluster(pre, dec, mode="pull", config=CFG)
    try:
        cluster.connect()
        work = Workload(cluster, 1, seed=9, min_tokens=30, max_tokens=30)
        (rid,) = work.requests
        rq = work.requests[rid]
        work.receive()
        cluster.producers[0].add_request(rid, rq.src_block_ids, rq.num_tokens)
        cluster.run_until(lambda: rid in [r for r, _ in [(x, y) for _, x, y in cluster.released]], 5)
        # Rank 0's half landed; scribble on it before rank 1 delivers (and verification runs).
        import torch
        cache = cluster.dst[0]
        rows = cache.read_tokens(0, 0, rq.dst_block_ids[0], [3]).clone()
        rows.view(-1).view(torch.uint8)[1] ^= 0x01
        cache.write_tokens(0, 0, rq.dst_block_ids[0], [3], rows)
        cluster.producers[1].add_request(rid, rq.src_block_ids, rq.num_tokens)
        cluster.run_until(lambda: cluster.done(rid), 5)
        res = cluster.results[(0, rid)]
        assert not res.ok and res.request_id == rid and "integrity check failed" in res.reason
    finally:
        cluster.close()


def test_checksum_required_but_prefill_sends_none_fails_clearly() -> None:
    pre = EngineLayout(tp_size=1, block_size=16, num_blocks=32)
    dec = EngineLayout(tp_size=1, block_size=16, num_blocks=32)
    cluster = Cluster(pre, dec, config=CFG, prefill_config=ConnectorConfig(lease_seconds=5, transfer_timeout=5,
                                                                          abort_timeout=1, secret=SECRET))
    try:
        cluster.connect()
        work = Workload(cluster, 1, seed=3)
        (rid,) = work.requests
        work.add()
        work.receive()
        cluster.run_until(lambda: cluster.done(rid), 5)
        res = cluster.results[(0, rid)]
        assert not res.ok and "sent no checksum" in res.reason
    finally:
        cluster.close()

"""The end-to-end request checksum: layout- and TP-independent, catches corrupted and misplaced rows."""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge.core.integrity import destination_checksums, source_checksums, verify_request
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.local import LocalExecutor
from kvbridge.proofs.verify import fill_source, random_bytes, random_case, random_request


def moved(seed: int):
    spec, src, dst, req = random_case(random.Random(seed))
    s = RankCache.allocate_engine(spec, src, fill=None)
    d = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(s, seed)
    random_bytes(d, seed + 1)
    fill_source(s, req.src_block_ids, req.num_tokens)
    plan = plan_request(spec, src, dst, req)
    LocalExecutor(s, d).execute(plan)
    return s, d, req, plan


@pytest.mark.parametrize("seed", range(40))
def test_intact_transfer_verifies_and_one_flipped_byte_fails(seed):
    s, d, req, plan = moved(7000 + seed)
    assert verify_request(s, d, req) == []
    if not len(plan):
        return
    r = random.Random(seed).randrange(len(plan))
    region = d[int(plan.dst_rank[r])].byte_regions()[int(plan.dst_region[r])]
    region[int(plan.dst_offset[r]) + random.Random(seed).randrange(int(plan.length[r]))] ^= 0x01
    reasons = verify_request(s, d, req)
    assert len(reasons) == 1 and f"destination rank {int(plan.dst_rank[r])}" in reasons[0]


def test_swapped_rows_fail_although_every_byte_arrived():
    spec = ModelSpec.uniform(1, 4, 8, "float32")
    src = EngineLayout(tp_size=1, block_size=4, num_blocks=4)
    dst = EngineLayout(tp_size=2, block_size=4, num_blocks=4)
    req = random_request(spec, src, dst, 8, 0, random.Random(0))
    s, d = RankCache.allocate_engine(spec, src), RankCache.allocate_engine(spec, dst)
    fill_source(s, req.src_block_ids, req.num_tokens)
    LocalExecutor(s, d).execute(plan_request(spec, src, dst, req))
    assert verify_request(s, d, req) == []
    view = d[0].logical_view(0, 0)  # swap two tokens' K rows in one block: same multiset of bytes
    kb = req.dst_block_ids[0][0]
    view[kb, [0, 1]] = view[kb, [1, 0]].clone()
    assert verify_request(s, d, req) != []


def test_checksum_independent_of_layout_and_tp():
    """The same logical content gives the same sum however it is laid out and sharded."""
    spec = ModelSpec.uniform(2, 4, 8, "bfloat16", kinds=("sliding", "full"), window=6)
    a = EngineLayout(tp_size=1, block_size=8, num_blocks=6)
    b = EngineLayout(tp_size=4, block_size=4, num_blocks=12, kv_order="NHD", kv_placement="blocks_first")
    c = EngineLayout(tp_size=8, block_size=16, num_blocks=4, kernel_block_size=4)  # replicated heads
    req = random_request(spec, a, b, 21, 3, random.Random(1))
    src = RankCache.allocate_engine(spec, a)
    fill_source(src, req.src_block_ids, req.num_tokens)
    per_b, per_c = source_checksums(src, req, b), source_checksums(src, req, c)
    d = RankCache.allocate_engine(spec, b)
    LocalExecutor(src, d).execute(plan_request(spec, a, b, req))
    assert destination_checksums(d, req) == per_b
    # Every logical row lands once on TP=4 (no replication); on TP=8 each head is held twice.
    total = sum(per_b) & ((1 << 64) - 1)
    assert sum(per_c) & ((1 << 64) - 1) == (2 * total) & ((1 << 64) - 1)


def test_cpu_tensors_only_touch_no_destination_bytes():
    s, d, req, _ = moved(7100)
    before = [r.clone() for c in d for r in c.byte_regions()]
    verify_request(s, d, req)
    assert all(torch.equal(x, y) for x, y in zip(before, [r for c in d for r in c.byte_regions()]))

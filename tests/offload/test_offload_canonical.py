"""The TP-independent (canonical) pool: every head written once, clear refusals, loads on other shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.errors import ShardingError
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.offload.errors import NotCanonicalizable
from kvbridge.offload.pool import CPUPool, canonical_layout
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvbridge.offload.worker import OffloadWorker
from kvbridge.core.spec import LayerSpec, ModelSpec
from kvbridge.proofs.verify import random_bytes

MQA = ModelSpec.uniform(2, 1, 16, "bfloat16")  # one KV head: replicated on every rank of TP > 1
HYBRID = ModelSpec.uniform(2, 4, 8, "bfloat16", kinds=("sliding", "full"), window=6)


def disjoint(region: np.ndarray, offset: np.ndarray, length: np.ndarray) -> bool:
    order = np.lexsort((offset, region))
    r, o, n = region[order], offset[order], length[order]
    same = r[1:] == r[:-1]
    return bool(np.all(~same | (o[:-1] + n[:-1] <= o[1:])))


def test_replicated_heads_are_stored_once():
    device = EngineLayout(tp_size=4, block_size=4, num_blocks=8)
    caches = RankCache.allocate_engine(MQA, device, fill=None)
    canonical = CPUPool.canonical(MQA, 8, 4, pin_memory=False)
    mirror = CPUPool.mirror(MQA, device, 2, 4, pin_memory=False)
    job = (GPULoadStoreSpec([1, 2, 3, 4], (4,), (0,)), CPULoadStoreSpec([0, 3]))  # 4 blocks x 4 tokens
    with OffloadWorker(caches, canonical) as w:
        _, runs = w.plan(job)
    assert runs.nbytes == 16 * MQA.bytes_per_token() and disjoint(runs.dst_region, runs.dst_offset, runs.length)
    with OffloadWorker(caches, mirror) as w:
        _, mirrored = w.plan(job)
    assert mirrored.nbytes == 4 * runs.nbytes  # vLLM's format keeps one copy per rank


def test_per_rank_workers_write_each_head_once_together():
    """In a deployment each rank's worker stores into the shared canonical pool; together they cover it exactly."""
    spec = ModelSpec.uniform(2, 2, 8, "float16")  # 2 heads over TP 4: ranks (0,1) and (2,3) replicate
    device = EngineLayout(tp_size=4, block_size=4, num_blocks=8, kv_order="NHD")
    caches = RankCache.allocate_engine(spec, device, fill=None)
    pool = CPUPool.canonical(spec, 4, 4, pin_memory=False)
    job = (GPULoadStoreSpec([5, 6], (2,), (0,)), CPULoadStoreSpec([1, 2]))
    parts = []
    for c in caches:
        with OffloadWorker([c], pool) as w:
            parts.append(w.plan(job)[1])
    region = np.concatenate([p.dst_region for p in parts])
    offset = np.concatenate([p.dst_offset for p in parts])
    length = np.concatenate([p.length for p in parts])
    assert int(length.sum()) == 8 * spec.bytes_per_token() and disjoint(region, offset, length)
    assert sum(p.nbytes > 0 for p in parts) == 2  # one replica of each head writes


def test_canonical_layout_is_parallelism_free():
    lay = canonical_layout(32, 100)
    assert (lay.tp_size, lay.kv_order, lay.kv_placement, lay.layer_placement, lay.kernel_size) == (
        1, "HND", "kv_first", "per_layer", 32)
    assert canonical_layout(32, 100, kernel_tokens=8).kernel_size == 8
    with pytest.raises(NotCanonicalizable, match="kernel block of 12 tokens must divide the 32-token block"):
        CPUPool.canonical(HYBRID, 32, 2, pin_memory=False, kernel_tokens=12)


def test_a_canonical_kernel_of_the_device_block_keeps_pages_whole():
    spec = ModelSpec.uniform(2, 8, 16, "bfloat16")
    device = EngineLayout(tp_size=1, block_size=16, num_blocks=8)
    caches = RankCache.allocate_engine(spec, device, fill=None)
    job = (GPULoadStoreSpec([1, 3, 5, 7], (4,), (0,)), CPULoadStoreSpec([0]))
    runs = {}
    for kernel in (None, 16):
        with OffloadWorker(caches, CPUPool.canonical(spec, 64, 1, pin_memory=False, kernel_tokens=kernel)) as w:
            runs[kernel] = len(w.plan(job)[1])
    assert runs[16] == 4 * 2 * 2 and runs[None] == 8 * runs[16]  # one run per page, or one per head


@pytest.mark.parametrize("spec, device, message", [
    (HYBRID, EngineLayout(tp_size=2, block_size=3), r"device block size 3 does not divide the canonical pool's "
                                                    r"block of 8 tokens"),
    (ModelSpec.uniform(2, 4, 8, "float16"), EngineLayout(), r"KV dtype differs: device float16, canonical offload "
                                                            r"pool bfloat16"),
    (ModelSpec((LayerSpec("sliding", 4, 8, 8, 6), LayerSpec("full", 2, 8, 8)), "bfloat16"), EngineLayout(),
     r"layer 1 num_kv_heads differs: device 2, canonical offload pool 4"),
    (HYBRID, EngineLayout(block_size=4, kv_placement="blocks_first", layer_placement="cross_layer"),
     r"keeps the layers of all 2 KV-cache groups in one region"),
])
def test_refused_with_a_clear_error(spec, device, message):
    pool = CPUPool.canonical(HYBRID, 8, 2, pin_memory=False)
    with pytest.raises(NotCanonicalizable, match=message):
        pool.factor_for(spec, device)


def test_unshardable_tp_is_refused_before_anything_moves():
    pool = CPUPool.canonical(HYBRID, 8, 2, pin_memory=False)
    with pytest.raises(ShardingError, match="cannot shard 4 KV heads over TP=3"):
        pool.factor_for(HYBRID, EngineLayout(tp_size=3, block_size=4))


def test_a_recurrent_checkpoint_moves_between_tp_sizes_unit_by_unit():
    """A checkpoint stored from TP 1 lands in a TP 2 engine's state slot, each rank its own units
    (Mamba2's conv B/C by group, x and the SSM state by head), and nothing else is written."""
    from kvbridge.core.spec import Component

    mamba = LayerSpec("recurrent", state=(Component("conv_x", 4, 3), Component("conv_b", 1, 6),
                                          Component("ssm", 4, 8, "float32")), recurrent_type="mamba2", conv_rows=3)
    spec = ModelSpec((LayerSpec("full", 4, 8, 8), mamba), "bfloat16")
    writer = RankCache.allocate_engine(spec, EngineLayout(block_size=4, num_blocks=6), fill=None)
    reader = RankCache.allocate_engine(spec, EngineLayout(tp_size=2, block_size=8, num_blocks=6), fill=None)
    random_bytes(writer, 1)
    random_bytes(reader, 2)
    before = [[r.clone() for r in c.regions] for c in reader]
    pool = CPUPool.canonical(spec, 8, 3, pin_memory=False)
    with OffloadWorker(writer, pool) as w:  # the checkpoint in device block 5 -> slot 2
        w.wait([w.submit((GPULoadStoreSpec([5], (0, 1), (0, 1)), CPULoadStoreSpec([2])))])
    for rc in reader:
        with OffloadWorker([rc], pool) as w:  # slot 2 -> the reader's block 3
            w.wait([w.submit((CPULoadStoreSpec([2]), GPULoadStoreSpec([3], (0, 1), (0, 0))))])
    for rc, old in zip(reader, before):
        a, units = rc.addr, set()
        for ci, comp in enumerate(mamba.state):
            u0, n = int(a.first_head[1, ci]), int(a.heads[1, ci])
            got = rc.logical_view(1, ci, as_int=True)[3, 0]
            assert torch.equal(got, writer[0].logical_view(1, ci, as_int=True)[5, 0, u0:u0 + n])
            start = int(a.base[1, ci]) + 3 * int(a.block_stride[1, ci])
            units |= set(range(start, start + n * int(a.row_bytes[1, ci])))
        changed = [(i, set((r.view(torch.uint8) != o.view(torch.uint8)).nonzero().flatten().tolist()))
                   for i, (r, o) in enumerate(zip(rc.regions, old))]
        assert all(not d or (i == int(a.region[1, 0]) and d <= units) for i, d in changed)  # nothing else changed


def test_a_single_group_cross_layer_engine_round_trips_through_the_canonical_pool():
    spec = ModelSpec.uniform(3, 4, 8, "bfloat16")
    cross = EngineLayout(tp_size=2, block_size=4, num_blocks=8, kv_placement="blocks_first",
                         layer_placement="cross_layer", kv_order="NHD")
    caches = RankCache.allocate_engine(spec, cross, fill=None)
    random_bytes(caches, 5)
    before = [RankCache(spec, cross, c.rank, [r.clone() for r in c.regions]) for c in caches]
    pool = CPUPool.canonical(spec, 8, 3, pin_memory=False)
    gpu, cpu = GPULoadStoreSpec([6, 1, 3], (3,), (1,)), CPULoadStoreSpec([2, 0])
    with OffloadWorker(caches, pool) as w:
        for job in ((gpu, cpu), (cpu, gpu)):
            if job[0] is cpu:  # wipe the device between store and load
                for c in caches:
                    for r in c.byte_regions():
                        r.zero_()
            job_id = w.submit(job)
            w.wait([job_id])
            assert w.get_finished()[0].success
    for now, then in zip(caches, before):
        for li in range(3):
            for ci in range(2):
                for b in (6, 1, 3):
                    assert torch.equal(now.logical_view(li, ci, True)[b], then.logical_view(li, ci, True)[b])
                assert int(now.logical_view(li, ci, True)[0].abs().sum()) == 0  # not in the job: still zero

"""The worker: asynchronous jobs, one compiled copy call per job, byte-exact sub-block mapping."""

from __future__ import annotations

import time

import pytest
import torch

import kvbridge.offload.worker as worker_mod
from kvbridge.errors import IncompatibleEngines, InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.offload.errors import SpecMismatch
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvbridge.offload.worker import OffloadWorker, TransferResult, cuda_copy_mode
from kvbridge.core.spec import ModelSpec
from kvbridge.proofs.verify import random_bytes


def snapshot(caches: list[RankCache]) -> list[torch.Tensor]:
    return [r.clone() for c in caches for r in c.byte_regions()]


HYBRID = ModelSpec.uniform(4, 4, 8, "bfloat16", kinds=("sliding", "full"), window=5)  # groups (0, 2), (1, 3)
DEVICE = EngineLayout(tp_size=2, block_size=4, num_blocks=32)
EXAMPLE = (GPULoadStoreSpec([10, 11, 12, 13, 14, 20, 21, 22], (5, 3), (1, 0)), CPULoadStoreSpec([7, 2, 9]))
EXAMPLE_PAIRS = {0: [(10, 29), (11, 30), (12, 31), (13, 8), (14, 9)], 1: [(20, 36), (21, 37), (22, 38)]}


def setup(spec=HYBRID, layout=DEVICE, factor=4, slots=16, seed=0):
    device = RankCache.allocate_engine(spec, layout, fill=None)
    pool = CPUPool.mirror(spec, layout, factor, slots, pin_memory=False)
    random_bytes(device, seed)
    random_bytes(pool.caches, seed + 1)
    return device, pool


def page_bytes(spec, layout, group):
    """Bytes of one device block of one group on one rank (vLLM's page, summed over the group's layers)."""
    a = layout.addressing(spec, 0)
    return sum(int(a.heads[li, c] * a.row_bytes[li, c]) * layout.block_size
               for li in spec.groups[group] for c in range(int(a.num_components[li])))


def expect_mapping(spec, src_caches, dst_caches, before, pairs, src_is_device):
    """Mapped sub-blocks equal their source; every other destination byte is what it was."""
    for rank, (s, d) in enumerate(zip(src_caches, dst_caches)):
        expected = RankCache(d.spec, d.layout, d.rank, [t.clone() for t in before[rank]])
        for li in range(spec.num_layers):
            for ci in range(2):
                sv, ev = s.logical_view(li, ci, True), expected.logical_view(li, ci, True)
                for dev_block, sub in pairs[spec.layer_group[li]]:
                    src_row, dst_row = (dev_block, sub) if src_is_device else (sub, dev_block)
                    ev[dst_row] = sv[src_row]
        for got, want in zip(d.byte_regions(), expected.byte_regions()):
            assert torch.equal(got, want)


def finish(worker, job_id):
    worker.wait([job_id])
    (res,) = worker.get_finished()
    assert res.job_id == job_id and res.success
    return res


def test_worked_example_store_then_load_bytes():
    device, pool = setup()
    per_rank = [[r.clone() for r in c.regions] for c in pool.caches]
    with OffloadWorker(device, pool) as w:
        t0 = time.perf_counter()
        res = finish(w, w.submit(EXAMPLE))
        wall = time.perf_counter() - t0
        assert res.job_id == 1 and 0 < res.seconds < wall
        assert res.bytes == DEVICE.tp_size * (5 * page_bytes(HYBRID, DEVICE, 0) + 3 * page_bytes(HYBRID, DEVICE, 1))
        # store: sub-blocks (7,0), (2,2), (2,3) and (9,3) are not part of the job and keep their bytes
        expect_mapping(HYBRID, device, pool.caches, per_rank, EXAMPLE_PAIRS, src_is_device=True)
        random_bytes(device, 9)  # the device forgets; the load brings exactly those blocks back
        per_rank = [[r.clone() for r in c.regions] for c in device]
        loaded = finish(w, w.submit(EXAMPLE[::-1]))
        assert loaded.job_id == 2 and loaded.bytes == res.bytes
        expect_mapping(HYBRID, pool.caches, device, per_rank, EXAMPLE_PAIRS, src_is_device=False)


def test_one_copy_call_per_job_over_all_groups(monkeypatch):
    calls = []
    real = worker_mod.copy_runs

    def counting(*args):
        calls.append(len(args[-1]))
        return real(*args)

    spec = ModelSpec.uniform(6, 2, 8, "float16", kinds=("sliding", "full", "mla"), window=7)  # 3 groups
    layout = EngineLayout(tp_size=2, block_size=2, num_blocks=40, kv_order="NHD")
    device, pool = setup(spec, layout, factor=3, slots=12)
    gpu = GPULoadStoreSpec([3, 4, 5, 6, 30, 31, 32, 33, 34, 35, 36, 1], (4, 7, 1), (2, 0, 5))
    cpu = CPULoadStoreSpec([0, 1, 2, 3, 4, 5])  # cdiv(4+2, 3) + cdiv(7, 3) + cdiv(1+2, 3) = 2 + 3 + 1
    with OffloadWorker(device, pool) as w:
        monkeypatch.setattr(worker_mod, "copy_runs", counting)  # after the worker compiled the kernel
        _, runs = w.plan((gpu, cpu))
        finish(w, w.submit((gpu, cpu)))
        finish(w, w.submit((cpu, gpu)))
    assert calls == [len(runs), len(runs)] and len(runs) > 3  # many runs, one call each job


def test_results_arrive_in_order_per_direction():
    device, pool = setup()
    stores = [(GPULoadStoreSpec([i], (1, 0), (0, 0)), CPULoadStoreSpec([i])) for i in range(5)]
    with OffloadWorker(device, pool) as w:
        ids = [w.submit(j) for j in stores] + [w.submit(stores[0][::-1])]
        assert ids == [1, 2, 3, 4, 5, 6]
        w.wait()
        results = w.get_finished()
        assert w.get_finished() == []
    assert [r.job_id for r in results if r.job_id <= 5] == [1, 2, 3, 4, 5] and {r.job_id for r in results} == set(ids)
    assert all(isinstance(r, TransferResult) and r.success and r.bytes == 2 * page_bytes(HYBRID, DEVICE, 0)
               for r in results)


def test_a_failed_copy_is_reported_not_raised(monkeypatch):
    def broken(*args):
        raise MemoryError("simulated")

    device, pool = setup()
    with OffloadWorker(device, pool) as w:
        monkeypatch.setattr(worker_mod, "copy_runs", broken)
        job_id = w.submit(EXAMPLE)
        w.wait([job_id])
        assert w.get_finished() == [TransferResult(job_id, False, 0, 0.0)]
        assert isinstance(w.error(job_id), MemoryError) and w.error(999) is None


class _Disk(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "DISK"


@pytest.mark.parametrize("job, error, message", [
    ((CPULoadStoreSpec([1]), _Disk()), SpecMismatch, r"no handler moves CPU -> DISK"),
    ((CPULoadStoreSpec([1]), CPULoadStoreSpec([2])), SpecMismatch, r"no handler moves CPU -> CPU"),
    ("not a job", SpecMismatch, r"a job is a \(source spec, destination spec\) pair"),
    ((GPULoadStoreSpec([1], (1,), (0,)), CPULoadStoreSpec([1])), SpecMismatch, r"describes 1 KV-cache groups"),
    ((EXAMPLE[0], CPULoadStoreSpec([7, 2, 9, 3])), SpecMismatch, r"consume 3 CPU ids, the CPU spec has 4"),
    ((GPULoadStoreSpec([10, 99], (2, 0), (0, 0)), CPULoadStoreSpec([1])), InvalidRequest, r"block id 99 outside"),
    ((GPULoadStoreSpec([10], (1, 0), (0, 0)), CPULoadStoreSpec([16])), InvalidRequest, r"block id 16 outside"),
])
def test_bad_jobs_raise_at_submit_and_move_nothing(job, error, message):
    device, pool = setup()
    before = snapshot(device) + snapshot(pool.caches)
    with OffloadWorker(device, pool) as w:
        with pytest.raises(error, match=message):
            w.submit(job)
        w.wait()
        assert w.get_finished() == []
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(device) + snapshot(pool.caches)))


def test_worker_serves_one_engine():
    device, pool = setup()
    other = RankCache.allocate(HYBRID, EngineLayout(tp_size=2, block_size=8, num_blocks=32), 1)
    with pytest.raises(IncompatibleEngines, match="one worker serves one engine"):
        OffloadWorker([device[0], other], pool)
    with pytest.raises(IncompatibleEngines, match="at least one device rank cache"):
        OffloadWorker([], pool)


def test_a_worker_per_rank_moves_only_its_rank():
    device, pool = setup()
    rank0 = [[r.clone() for r in pool.caches[0].regions]]
    rank1 = snapshot(pool.caches[1:])
    with OffloadWorker(device[:1], pool) as w:
        res = finish(w, w.submit(EXAMPLE))
    assert res.bytes == 5 * page_bytes(HYBRID, DEVICE, 0) + 3 * page_bytes(HYBRID, DEVICE, 1)
    expect_mapping(HYBRID, device[:1], pool.caches[:1], rank0, EXAMPLE_PAIRS, src_is_device=True)
    assert all(torch.equal(a, b) for a, b in zip(rank1, snapshot(pool.caches[1:])))  # rank 1's pool untouched


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device in this environment: the CUDA handler (pinned pool, one stream per job, "
                           "stores ordered after the compute stream, FIFO by end events), both copy modes, passed on an H100 on 2026-11-27 (scripts/gpu_run.sh, docs/gpu.md)")
@pytest.mark.parametrize("mode", ["kernel", "memcpy"])
def test_cuda_round_trip(mode):  # pragma: no cover - needs a CUDA device
    device = RankCache.allocate_engine(HYBRID, DEVICE, device="cuda", fill=None)
    for c in device:
        for r in c.byte_regions():
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, device="cuda"))
    original = [RankCache(HYBRID, DEVICE, c.rank, [r.cpu().clone() for r in c.regions]) for c in device]
    pool = CPUPool.mirror(HYBRID, DEVICE, 4, 16)
    assert all(r.is_pinned() for r in pool.byte_regions())
    with OffloadWorker(device, pool, cuda_copy=mode) as w:
        assert w.backend == f"cuda-{mode}"
        finish(w, w.submit(EXAMPLE))
        for c in device:
            for r in c.byte_regions():
                r.zero_()
        finish(w, w.submit(EXAMPLE[::-1]))
    for rank, c in enumerate(device):
        for li in range(HYBRID.num_layers):
            for dev_block, _ in EXAMPLE_PAIRS[HYBRID.layer_group[li]]:
                for ci in range(2):
                    assert torch.equal(c.logical_view(li, ci, True)[dev_block].cpu(),
                                       original[rank].logical_view(li, ci, True)[dev_block])
        assert int(c.logical_view(0, 0, True)[0].abs().sum()) == 0  # blocks outside the job stay zero


def test_cuda_copy_mode_needs_pinned_pool_for_the_kernel():
    """The kernel reaches the pool through its unified address, which only pinned memory has: a
    pageable pool falls back to per-run copies under "auto" and is refused under "kernel"."""
    pageable = [torch.zeros(64, dtype=torch.uint8)]
    assert cuda_copy_mode("auto", pageable) == "memcpy"
    assert cuda_copy_mode("memcpy", pageable) == "memcpy"
    with pytest.raises(IncompatibleEngines, match="pinned"):
        cuda_copy_mode("kernel", pageable)
    with pytest.raises(IncompatibleEngines, match="auto, kernel or memcpy"):
        cuda_copy_mode("fast", pageable)

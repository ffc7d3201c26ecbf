"""Staged moves (gather, one contiguous copy, scatter) against the direct executor, on real CPU
torch tensors and plans from the real planner over random legal shape pairs."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import EngineLayout, ModelSpec, RankCache
from kvbridge.core.plan import Request, plan_request
from kvbridge.errors import InvalidRequest
from kvbridge.proofs.verify import clone_caches, converted_components, fill_source, random_bytes, random_case
from kvbridge.transport.device_staging import (
    DEFAULT_THRESHOLD_BYTES,
    StagedExecutor,
    choose_path,
    gather,
    pair_mask,
    rank_pairs,
    scatter,
    staging_layout,
)
from kvbridge.transport.local import LocalExecutor

CASES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THRESHOLDS = st.sampled_from([0, 1, 16, 64, 256, 4096, DEFAULT_THRESHOLD_BYTES, 2**62])


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(seed: int, all_axes: bool):
    spec, src, dst, req = random_case(random.Random(seed), all_axes=all_axes)
    src_caches = RankCache.allocate_engine(spec, src, fill=None)
    dst_caches = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(src_caches, seed)
    random_bytes(dst_caches, seed + 1)
    fill_source(src_caches, req.src_block_ids, req.num_tokens, converted_components(spec, src, dst))
    return spec, src, dst, req, src_caches, dst_caches, plan_request(spec, src, dst, req)


def _written(plan, caches: list[RankCache]) -> list[list[torch.Tensor]]:
    """Per destination rank and region: which bytes some run writes."""
    masks = [[torch.zeros(r.numel(), dtype=torch.bool) for r in c.byte_regions()] for c in caches]
    for d, g, o, n in zip(plan.dst_rank, plan.dst_region, plan.dst_offset, plan.length):
        masks[int(d)][int(g)][int(o):int(o) + int(n)] = True
    return masks


@CASES
@given(st.integers(0, 2**31), st.booleans(), THRESHOLDS)
def test_staged_executor_writes_what_direct_writes(seed, all_axes, threshold):
    spec, src, dst, req, src_caches, dst_caches, plan = _setup(seed, all_axes)
    before = clone_caches(dst_caches)
    expected = clone_caches(dst_caches)
    LocalExecutor(src_caches, expected).execute(plan)
    report = StagedExecutor(src_caches, dst_caches, threshold_bytes=threshold).execute(plan)
    written = _written(plan, dst_caches)
    for rank, (a, e, b) in enumerate(zip(dst_caches, expected, before)):
        for i, (ra, re, rb) in enumerate(zip(a.byte_regions(), e.byte_regions(), b.byte_regions())):
            assert torch.equal(ra, re), (rank, i, spec.describe(), src.describe(), dst.describe(), req, report)
            outside = ~written[rank][i]
            assert torch.equal(ra[outside], rb[outside]), (rank, i)
    # The choice follows the threshold, and every pair with runs is reported once.
    assert [(p.src_rank, p.dst_rank) for p in report.pairs] == rank_pairs(plan)
    for p in report.pairs:
        m = pair_mask(plan, p.src_rank, p.dst_rank)
        assert p.num_runs == int(m.sum()) and p.bytes == int(plan.length[m].sum())
        converts = plan.needs_conversion and bool((plan.convert[m] >= 0).any())
        want = "direct" if converts or p.mean_run_bytes >= threshold else "staged"
        assert p.path == want, (p, threshold)


@CASES
@given(st.integers(0, 2**31), st.booleans())
def test_gather_scatter_round_trip_per_pair(seed, overlapping_rows):
    """gather + scatter alone (both scatter variants) put every run where the direct path does."""
    *_, src_caches, dst_caches, plan = _setup(seed, False)
    expected = clone_caches(dst_caches)
    LocalExecutor(src_caches, expected).execute(plan)
    for s, d in rank_pairs(plan):
        pair = plan.select(pair_mask(plan, s, d))
        layout = staging_layout(pair)
        buf = gather(pair, src_caches[s].byte_regions(), layout)
        assert buf.numel() == pair.nbytes and buf.is_contiguous()
        scatter(buf.clone(), pair, dst_caches[d].byte_regions(), layout, overlapping_rows=overlapping_rows)
    for a, e in zip(dst_caches, expected):
        for ra, re in zip(a.byte_regions(), e.byte_regions()):
            assert torch.equal(ra, re)


def test_buffer_holds_each_run_contiguously_and_groups_stay_aligned():
    spec = ModelSpec.uniform(2, 8, 16, "bfloat16", "t")
    src, dst = EngineLayout(tp_size=1, block_size=4, num_blocks=4), EngineLayout(tp_size=2, block_size=4, num_blocks=4,
                                                                                   kv_order="HND")
    plan = plan_request(spec, src, dst, Request(((0, 1),), ((2, 3),), 7))
    pair = plan.select(pair_mask(plan, 0, 1))
    groups, size = staging_layout(pair)
    assert size == pair.nbytes and sum(len(g.runs) * g.length for g in groups) == size
    assert all(g.start % g.width == 0 for g in groups)
    caches = RankCache.allocate_engine(spec, src, fill=None)
    random_bytes(caches, 3)
    buf = gather(pair, caches[0].byte_regions(), (groups, size))
    region = caches[0].byte_regions()
    for g in groups:
        for k, r in enumerate(g.runs):
            o, n = int(pair.src_offset[r]), int(pair.length[r])
            got = buf[g.start + k * g.length:g.start + (k + 1) * g.length]
            assert torch.equal(got, region[int(pair.src_region[r])][o:o + n])


def test_choice_follows_the_mean_run_size():
    spec = ModelSpec.uniform(2, 8, 16, "bfloat16", "t")
    src, dst = EngineLayout(tp_size=1, block_size=4, num_blocks=4), EngineLayout(tp_size=2, block_size=4, num_blocks=4)
    plan = plan_request(spec, src, dst, Request(((0, 1),), ((2, 3),), 7))
    means = {(p.src_rank, p.dst_rank): p.mean_run_bytes for p in choose_path(plan, 0)}
    assert all(p.path == "direct" for p in choose_path(plan, 0))
    assert all(p.path == "staged" for p in choose_path(plan, 2**40))
    for pair, mean in means.items():
        at = {(p.src_rank, p.dst_rank): p.path for p in choose_path(plan, int(mean))}
        above = {(p.src_rank, p.dst_rank): p.path for p in choose_path(plan, int(mean) + 1)}
        assert at[pair] == "direct" and above[pair] == "staged"  # at the threshold: direct
    with pytest.raises(InvalidRequest, match="threshold"):
        choose_path(plan, -1)


def test_bad_plan_refused_before_any_byte_moves():
    spec = ModelSpec.uniform(1, 2, 8, "float16", "t")
    lay = EngineLayout(tp_size=1, block_size=4, num_blocks=3)
    plan = plan_request(spec, lay, lay, Request(((0, 1),), ((1, 2),), 8))
    plan.dst_offset = plan.dst_offset.copy()
    plan.dst_offset[-1] += 10**9
    src = RankCache.allocate_engine(spec, lay, fill=None)
    dst = RankCache.allocate_engine(spec, lay)
    random_bytes(src, 1)
    with pytest.raises(InvalidRequest, match="outside"):
        StagedExecutor(src, dst, threshold_bytes=2**40).execute(plan)
    assert all(int(r.count_nonzero()) == 0 for c in dst for r in c.byte_regions())


def test_staging_layout_refuses_converting_runs():
    for seed in range(200):
        *_, plan = _setup(seed, True)
        if plan.needs_conversion:
            with pytest.raises(InvalidRequest, match="convert"):
                staging_layout(plan)
            assert all(p.path == "direct" for p in choose_path(plan, 2**62)
                       if (plan.convert[pair_mask(plan, p.src_rank, p.dst_rank)] >= 0).any())
            return
    pytest.fail("no converting case among 200 seeds")


def test_empty_plan_moves_nothing():
    spec = ModelSpec.uniform(1, 2, 8, "float16", "t")
    lay = EngineLayout(tp_size=1, block_size=4, num_blocks=3)
    plan = plan_request(spec, lay, lay, Request(((),), ((),), 0))
    caches = RankCache.allocate_engine(spec, lay)
    report = StagedExecutor(caches, RankCache.allocate_engine(spec, lay)).execute(plan)
    assert len(plan) == 0 and report.pairs == []


def test_bench_runs_side_by_side_on_a_small_request():
    """The bench runs and reports consistent figures (no timing is asserted)."""
    from kvbridge.bench.staging import bench_staging
    results = bench_staging(num_tokens=32, repeats=1)
    assert [r.prefill.split()[0] for r in results] and len(results) == 2
    for r in results:
        assert r.bytes > 0 and r.num_runs > 0 and r.staged_seconds > 0 and r.contiguous_seconds > 0
        assert r.default_choice.endswith("direct")

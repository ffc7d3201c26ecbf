"""Property tests of the planner and the local executor over any legal shape pair.

Shapes: heads and TP sizes legal for them (including non-divisible pairs such as P=3/D=2 with 6
heads and replicated P with P > D), any block / kernel block sizes, NHD/HND, kv_first /
blocks_first / cross_layer, dtypes, full + several sliding-window groups, MLA with or without a
window (alone or next to attention layers), different K and V dims, stateless layers anywhere, any token count and
prefix-cache hit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import EngineLayout, LayerSpec, ModelSpec, RankCache
from kvbridge.core.plan import Plan, Request, plan_request
from kvbridge.core.shard import cp_block_span, overlapping_ranks
from kvbridge.transport.local import LocalExecutor
from kvbridge.proofs.verify import (check_case, clone_caches, expected_destination, fill_source, mismatch_report,
                             moved_positions, random_bytes)

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8"]
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN_ONLY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tensors here are tiny; torch's intra-op thread pool only adds wake-up latency (badly so
    when the cores are busy: repeat_interleave went from ~0.02 ms to ~6 ms per call under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def legal_tps(heads: int | None, limit: int = 8) -> list[int]:
    if heads is None:  # MLA only: every TP size is legal
        return list(range(1, limit + 1))
    return [t for t in range(1, limit + 1) if heads % t == 0 or t % heads == 0]


@st.composite
def specs(draw) -> ModelSpec:
    kind = draw(st.sampled_from(["gqa", "gqa", "hybrid", "mla", "mla+attn"]))
    dtype = draw(st.sampled_from(DTYPES))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    n_layers = draw(st.integers(1, 4))
    dims = st.sampled_from([1, 2, 3, 4, 8, 16])
    layers = []
    windows = draw(st.lists(st.integers(2, 40), min_size=1, max_size=2))
    for i in range(n_layers):
        if kind == "mla" or (kind == "mla+attn" and i % 2 == 0):
            # MLA with a window too: dots3's sliding MLA layers (vLLM's SlidingWindowMLASpec)
            layers.append(LayerSpec("mla", 1, draw(dims), window=draw(st.sampled_from([None, *windows]))))
            continue
        k_dim, v_dim = draw(dims), draw(dims)  # K and V dims may differ
        if kind == "hybrid" and draw(st.booleans()):
            layers.append(LayerSpec("sliding", heads, k_dim, v_dim, draw(st.sampled_from(windows))))
        else:
            layers.append(LayerSpec("full", heads, k_dim, v_dim))
    # stateless layers (Nemotron-H's MLP / MoE blocks) anywhere in the stack: no cache, no group, no region
    for at in draw(st.lists(st.integers(0, n_layers), max_size=2)):
        layers.insert(at, LayerSpec("stateless"))
    return ModelSpec(tuple(layers), dtype, f"hyp-{kind}")


@st.composite
def layouts(draw, spec: ModelSpec, num_tokens: int) -> EngineLayout:
    attn = [layer.num_kv_heads for layer in spec.layers if layer.components and not layer.replicated]
    tp = draw(st.sampled_from(legal_tps(attn[0] if attn else None)))
    kernel = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    block = kernel * draw(st.sampled_from([1, 1, 2, 3, 4]))
    placement = draw(st.sampled_from(["kv_first", "blocks_first", "cross_layer", "per_head", "per_head cross_layer"]))
    need = -(-num_tokens // block)
    return EngineLayout(
        tp_size=tp, block_size=block, num_blocks=need + draw(st.integers(1, 4)), kernel_block_size=kernel,
        kv_order="HND" if placement.startswith("per_head") else draw(st.sampled_from(["NHD", "HND"])),
        kv_placement=placement.split()[0] if placement != "cross_layer" else "blocks_first",
        layer_placement="cross_layer" if placement.endswith("cross_layer") else "per_layer")


@st.composite
def block_ids(draw, spec: ModelSpec, lay: EngineLayout, num_tokens: int) -> tuple[tuple[int, ...], ...]:
    need = -(-num_tokens // lay.block_size)
    return tuple(tuple(draw(st.permutations(range(lay.num_blocks)))[:need]) for _ in spec.groups)


@st.composite
def cases(draw, max_tokens: int = 48):
    spec = draw(specs())
    num_tokens = draw(st.integers(0, max_tokens))
    cached = draw(st.one_of(st.just(0), st.integers(0, num_tokens)))
    src, dst = draw(layouts(spec, num_tokens)), draw(layouts(spec, num_tokens))
    req = Request(draw(block_ids(spec, src, num_tokens)), draw(block_ids(spec, dst, num_tokens)), num_tokens, cached)
    return spec, src, dst, req


def analytic_bytes(spec: ModelSpec, dst: EngineLayout, req: Request) -> int:
    total = 0
    for li, layer in enumerate(spec.layers):
        if layer.is_stateless:
            continue
        tokens = len(moved_positions(spec, spec.layer_group[li], req))
        for comp in layer.components:
            local_heads = 1 if layer.replicated else max(1, comp.heads // dst.tp_size)
            total += tokens * local_heads * comp.dim * spec.itemsize * dst.tp_size
    return total


# --------------------------------------------------------------------------------------------
# Byte-exact end to end
# --------------------------------------------------------------------------------------------

@FAST
@given(cases(), st.integers(0, 2**16))
def test_every_destination_byte_is_right(case, seed):
    spec, src, dst, req = case
    result = check_case(spec, src, dst, req, seed=seed)
    assert result.ok, (result.mismatches, spec.describe(), src.describe(), dst.describe(), req)


# --------------------------------------------------------------------------------------------
# Properties of the plan itself
# --------------------------------------------------------------------------------------------

def structure_problems(plan: Plan) -> list[str]:
    """Violations of the plan invariants (empty when the plan is well formed)."""
    spec, src, dst = plan.spec, plan.src, plan.dst
    problems = []
    if len(plan) == 0:
        return problems
    if np.any(plan.length <= 0):
        problems.append("empty or negative run")

    # Destination byte ranges never overlap: every destination byte is written exactly once.
    order = np.lexsort((plan.dst_offset, plan.dst_region, plan.dst_rank))
    r, g, o, ln = plan.dst_rank[order], plan.dst_region[order], plan.dst_offset[order], plan.length[order]
    same = (r[1:] == r[:-1]) & (g[1:] == g[:-1])
    if np.any(same & (o[1:] < o[:-1] + ln[:-1])):
        problems.append("overlapping destination runs")

    # Every run lies inside its regions on both sides.
    for side, rank_arr, region, offset, length, lay in (
            ("source", plan.src_rank, plan.src_region, plan.src_offset, plan.src_length, src),
            ("destination", plan.dst_rank, plan.dst_region, plan.dst_offset, plan.length, dst)):
        sizes = {(q, i): s for q in range(lay.world_size) for i, s in enumerate(lay.addressing(spec, q).region_nbytes)}
        limit = np.array([sizes[(int(a), int(b))] for a, b in zip(rank_arr, region)])
        if np.any(offset < 0) or np.any(offset + length > limit):
            problems.append(f"{side} run outside its region")

    # Runs are maximal: no run ends where another (same ranks, regions, conversion) begins on both sides.
    ends = set(zip(plan.dst_rank.tolist(), plan.src_rank.tolist(), plan.src_region.tolist(),
                   (plan.src_offset + plan.src_length).tolist(), plan.dst_region.tolist(),
                   (plan.dst_offset + plan.length).tolist(), plan.convert.tolist()))
    starts = set(zip(plan.dst_rank.tolist(), plan.src_rank.tolist(), plan.src_region.tolist(),
                     plan.src_offset.tolist(), plan.dst_region.tolist(), plan.dst_offset.tolist(),
                     plan.convert.tolist()))
    if ends & starts:
        problems.append("two runs touch on both sides and were not merged")

    # Reads stay inside vLLM's handshake set (it is a superset of what is read), in TP coordinates.
    # (A DCP source spreads a head's tokens over its replicas: vLLM widens the set to the DCP ranks.)
    for d, s in set(zip(plan.dst_rank.tolist(), plan.src_rank.tolist())) if src.dcp_size == 1 else ():
        if src.rank_coords(s).tp not in overlapping_ranks(dst.tp_size, dst.rank_coords(d).tp, src.tp_size):
            problems.append(f"destination rank {d} reads source rank {s} outside its handshake set")
    return problems


@PLAN_ONLY
@given(cases(max_tokens=96))
def test_plan_structure(case):
    spec, src, dst, req = case
    plan = plan_request(spec, src, dst, req)
    assert plan.nbytes == analytic_bytes(spec, dst, req)
    assert plan.stats.bytes_total == plan.nbytes and plan.stats.num_runs == len(plan)
    assert structure_problems(plan) == []


def test_structure_checks_can_fail():
    spec = ModelSpec.uniform(1, 2, 8, "bfloat16")
    lay = EngineLayout(tp_size=1, block_size=4, num_blocks=2)
    plan = plan_request(spec, lay, lay, Request.single_group([0, 1], [0, 1], 8))
    assert structure_problems(plan) == [] and len(plan) == 1  # whole region: both sides identical
    runs = plan.runs()
    half = int(runs["length"][0]) // 2
    split = {k: np.concatenate([v, v]) for k, v in runs.items()}
    split["length"][:] = half
    split["src_offset"][1] += half
    split["dst_offset"][1] += half
    assert structure_problems(Plan(spec, lay, lay, split)) == ["two runs touch on both sides and were not merged"]
    dup = {k: np.concatenate([v, v]) for k, v in runs.items()}
    assert "overlapping destination runs" in structure_problems(Plan(spec, lay, lay, dup))
    out = {k: v.copy() for k, v in runs.items()}
    out["dst_offset"][0] += 1
    assert structure_problems(Plan(spec, lay, lay, out)) == ["destination run outside its region"]


@PLAN_ONLY
@given(cases(max_tokens=64))
def test_dst_ranks_subset_is_a_slice_of_the_full_plan(case):
    spec, src, dst, req = case
    full = plan_request(spec, src, dst, req)
    for d in range(dst.tp_size):
        part = plan_request(spec, src, dst, req, dst_ranks=[d])
        sel = full.select(full.dst_rank == d)
        for name, arr in part.runs().items():
            assert np.array_equal(arr, getattr(sel, name)), name


def _run_backend(backend, src_caches, spec, dst, plan, seed):
    dst_caches = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(dst_caches, seed + 1)
    LocalExecutor(src_caches, dst_caches, backend=backend).execute(plan)
    return [r.clone() for c in dst_caches for r in c.byte_regions()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**16))
def test_numba_and_torch_backends_agree(case, seed):
    spec, src, dst, req = case
    src_caches = RankCache.allocate_engine(spec, src, fill=None)
    random_bytes(src_caches, seed)
    fill_source(src_caches, req.src_block_ids, req.num_tokens)
    plan = plan_request(spec, src, dst, req)
    by_numba = _run_backend("numba", src_caches, spec, dst, plan, seed)
    by_torch = _run_backend("torch", src_caches, spec, dst, plan, seed)
    assert len(by_numba) == len(by_torch)
    for a, b in zip(by_numba, by_torch):
        assert torch.equal(a, b)


def test_torch_backend_region_not_multiple_of_copy_width():
    # Regression: the torch backend used to view each whole region as the widest int type dividing
    # every run (int64 for 8-B runs) and failed on a 12-byte region.
    spec = ModelSpec((LayerSpec("mla", 1, 1),), "bfloat16")
    src = EngineLayout(tp_size=1, block_size=4, num_blocks=2, kv_order="NHD")
    dst = EngineLayout(tp_size=1, block_size=2, num_blocks=3, kv_order="NHD")
    assert dst.addressing(spec, 0).region_nbytes == (12,)
    req = Request(((0,),), ((0, 1),), 4)
    assert check_case(spec, src, dst, req, backend="numba").ok
    assert check_case(spec, src, dst, req, backend="torch").ok


# --------------------------------------------------------------------------------------------
# The checker can fail
# --------------------------------------------------------------------------------------------

def _corrupt(plan: Plan, field: str, delta: int, index: int = 0) -> Plan:
    runs = {k: v.copy() for k, v in plan.runs().items()}
    runs[field][index] += delta
    return Plan(plan.spec, plan.src, plan.dst, runs)


def _execute_and_report(spec, src, dst, req, plan: Plan, backend: str = "numba") -> list[str]:
    src_caches = RankCache.allocate_engine(spec, src, fill=None)
    dst_caches = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(src_caches, 1)
    random_bytes(dst_caches, 2)
    fill_source(src_caches, req.src_block_ids, req.num_tokens)
    expected = clone_caches(dst_caches)
    expected_destination(expected, req)
    LocalExecutor(src_caches, dst_caches, backend=backend).execute(plan)
    return mismatch_report(dst_caches, expected)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize(("field", "delta"), [("src_offset", 2), ("dst_offset", 2), ("length", -2),
                                             ("src_rank", 1), ("src_offset", 4096)])
def test_checker_catches_a_corrupted_plan(backend, field, delta):
    spec = ModelSpec.uniform(2, 4, 16, "bfloat16")
    src = EngineLayout(tp_size=2, block_size=16, num_blocks=8)
    dst = EngineLayout(tp_size=1, block_size=8, num_blocks=8, kv_order="NHD")
    req = Request.single_group([3, 5], [0, 2, 4, 6], 30)
    plan = plan_request(spec, src, dst, req)
    assert _execute_and_report(spec, src, dst, req, plan, backend) == []
    bad = _corrupt(plan, field, delta, index=len(plan) // 2)
    report = _execute_and_report(spec, src, dst, req, bad, backend)
    assert report, f"corrupting {field} by {delta} went unnoticed"
    assert all("bytes differ" in line for line in report)


def test_checker_catches_a_dropped_run():
    spec = ModelSpec.uniform(1, 2, 8, "float16")
    src = EngineLayout(tp_size=1, block_size=4, num_blocks=4)
    dst = EngineLayout(tp_size=2, block_size=4, num_blocks=4)
    req = Request.single_group([1, 2], [3, 0], 8)
    plan = plan_request(spec, src, dst, req)
    keep = np.ones(len(plan), dtype=bool)
    keep[-1] = False
    assert _execute_and_report(spec, src, dst, req, plan.select(keep))


# --------------------------------------------------------------------------------------------
# More axes: PP stages, DCP/PCP token shards, per-group block sizes, KV dtype, clipped windows
# --------------------------------------------------------------------------------------------

KV_DTYPES = [None, "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]


@st.composite
def axes_layouts(draw, spec: ModelSpec, num_tokens: int, prefill: bool) -> EngineLayout:
    """Any legal engine: TP x PP (even or uneven split) x PCP (prefill) with DCP inside TP, per-group
    block sizes, a CP interleave, a KV dtype with per-tensor or per-head scales."""
    attn = [layer.num_kv_heads for layer in spec.layers if layer.components and not layer.replicated]
    tp = draw(st.sampled_from(legal_tps(attn[0] if attn else None)))
    n = spec.num_layers
    pp = draw(st.integers(1, min(3, n)))
    split: tuple[int, ...] = ()
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
        split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n]))
    comps = [(c.heads, layer.replicated) for layer in spec.layers for c in layer.components]
    dcp = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0 and all(
        (tp if rep else tp // h if tp > h else 1) % d == 0 for h, rep in comps)]))
    pcp = draw(st.sampled_from([1, 2])) if prefill else 1
    kernel = draw(st.sampled_from([1, 2, 4, 8]))
    placement = draw(st.sampled_from(["kv_first", "blocks_first", "cross_layer"]))
    groups = len(spec.groups)
    if placement != "cross_layer" and groups > 1 and draw(st.booleans()):
        sizes = tuple(kernel * draw(st.sampled_from([1, 2, 3, 4])) for _ in range(groups))
    else:
        sizes = (kernel * draw(st.sampled_from([1, 2, 3, 4])),) * groups
    # Any interleave: dividing the blocks (vLLM's virtual blocks) or not (pages smaller than the
    # interleave, vLLM's compact-local pages, as DeepSeek-V4's 64/8/4-token pages under 256).
    interleave = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    kv_dtype = draw(st.sampled_from(KV_DTYPES))
    scales: tuple = ()
    if draw(st.booleans()):
        per_head = draw(st.booleans())
        scale = st.sampled_from([0.02, 0.125, 0.5, 1.0, 3.0])
        scales = tuple(tuple(tuple(draw(scale) for _ in range(c.heads if per_head else 1)) for c in layer.components)
                       for layer in spec.layers)
    need = max(cp_block_span(0, num_tokens, b, pcp * dcp, interleave)[1] for b in sizes)
    return EngineLayout(
        tp_size=tp, block_size=sizes[0], num_blocks=need + draw(st.integers(1, 3)), kernel_block_size=kernel,
        kv_order=draw(st.sampled_from(["NHD", "HND"])),
        kv_placement="kv_first" if placement == "kv_first" else "blocks_first",
        layer_placement="cross_layer" if placement == "cross_layer" else "per_layer",
        pp_size=pp, layer_split=split, dcp_size=dcp, pcp_size=pcp, cp_interleave=interleave,
        group_block_sizes=sizes if len(set(sizes)) > 1 else (), kv_dtype=kv_dtype, kv_scales=scales)


@st.composite
def axes_block_ids(draw, spec: ModelSpec, lay: EngineLayout, num_tokens: int) -> tuple[tuple[int, ...], ...]:
    out = []
    for g in range(len(spec.groups)):
        ids = tuple(draw(st.permutations(range(lay.num_blocks)))[:lay.block_ids_needed(g, num_tokens)])
        window = spec.group_layer(g).window
        if window is not None and draw(st.booleans()):  # vLLM sends sliding lists clipped to the window
            ids = ids[lay.block_span(g, spec.group_layer(g).tokens_kept(num_tokens), num_tokens)[0]:]
        out.append(ids)
    return tuple(out)


@st.composite
def axes_cases(draw, max_tokens: int = 48):
    spec = draw(specs())
    num_tokens = draw(st.integers(0, max_tokens))
    cached = draw(st.one_of(st.just(0), st.integers(0, num_tokens)))
    src, dst = draw(axes_layouts(spec, num_tokens, True)), draw(axes_layouts(spec, num_tokens, False))
    req = Request(draw(axes_block_ids(spec, src, num_tokens)), draw(axes_block_ids(spec, dst, num_tokens)),
                  num_tokens, cached)
    return spec, src, dst, req


def axes_bytes(spec: ModelSpec, dst: EngineLayout, req: Request) -> int:
    """Every moved token lands once per TP rank of its CP rank: tp / dcp copies per stage."""
    d_spec = dst.engine_spec(spec)
    total = 0
    for li, layer in enumerate(d_spec.layers):
        tokens = len(moved_positions(spec, spec.layer_group[li], req))
        for comp in layer.components:
            local_heads = 1 if layer.replicated else max(1, comp.heads // dst.tp_size)
            total += tokens * local_heads * comp.dim * d_spec.component_itemsize(comp) * dst.tp_size // dst.dcp_size
    return total


@FAST
@given(axes_cases(), st.integers(0, 2**16))
def test_every_destination_byte_is_right_on_every_axis(case, seed):
    """Any legal pair over TP x PP x CP x block sizes x groups x KV dtypes: every destination byte
    of the request is its source element (converted by the reference rule when the dtypes or
    scales differ) and no other destination byte changes."""
    spec, src, dst, req = case
    result = check_case(spec, src, dst, req, seed=seed)
    assert result.ok, (result.mismatches, spec.describe(), src.describe(), dst.describe(), req)


@PLAN_ONLY
@given(axes_cases(max_tokens=96))
def test_axes_plan_structure(case):
    """Each destination byte written exactly once, every run inside its regions on both sides,
    runs maximal, reads inside vLLM's TP handshake set; the byte count is the analytic one."""
    spec, src, dst, req = case
    plan = plan_request(spec, src, dst, req)
    assert plan.nbytes == axes_bytes(spec, dst, req)
    assert structure_problems(plan) == []


@PLAN_ONLY
@given(axes_cases(max_tokens=64))
def test_axes_reads_follow_the_shards(case):
    """A destination rank reads a layer only from the source stage holding it, writes only its own
    stage's regions, and converts exactly the components whose dtype or scales differ."""
    spec, src, dst, req = case
    plan = plan_request(spec, src, dst, req)
    for d in range(dst.world_size):
        sel = plan.dst_rank == d
        lo, hi = dst.stage_layers(spec.num_layers, dst.rank_coords(d).pp)
        assert set(plan.dst_region[sel].tolist()) <= set(range(hi - lo if dst.layer_placement == "per_layer" else 1))
        for s in set(plan.src_rank[sel].tolist()):
            s_lo, s_hi = src.stage_layers(spec.num_layers, src.rank_coords(s).pp)
            assert s_lo < hi and lo < s_hi  # the stages overlap
    from kvbridge.proofs.verify import converted_components
    if not converted_components(spec, src, dst):
        assert not plan.needs_conversion and np.array_equal(plan.length, plan.src_length)


@PLAN_ONLY
@given(axes_cases(max_tokens=64))
def test_clipped_window_lists_plan_like_full_ones(case):
    """A sliding-window list clipped to the window (as vLLM sends it) gives the plan of the full list."""
    spec, src, dst, req = case

    def full(lay: EngineLayout, ids):
        return tuple(tuple([0] * (lay.block_ids_needed(g, req.num_tokens) - len(x))) + tuple(x)
                     for g, x in enumerate(ids))
    padded = Request(full(src, req.src_block_ids), full(dst, req.dst_block_ids), req.num_tokens,
                     req.num_cached_tokens)
    a, b = plan_request(spec, src, dst, req), plan_request(spec, src, dst, padded)
    for name, arr in a.runs(conversion=True).items():
        assert np.array_equal(arr, b.runs(conversion=True)[name]), name


def test_pp_layer_range_is_vllms_get_pp_indices():
    from kvbridge.core.shard import pp_layer_range
    # vLLM's tests/distributed/test_pipeline_partition.py (custom partitions)
    assert [pp_layer_range(20, 4, r, (5, 5, 5, 5)) for r in range(4)] == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert [pp_layer_range(20, 4, r, (4, 6, 6, 4)) for r in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]
    assert [pp_layer_range(16, 2, r, (10, 6)) for r in range(2)] == [(0, 10), (10, 16)]
    # even split: the remainder goes to the stages before the last, from the second to last backwards
    assert [pp_layer_range(5, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [pp_layer_range(10, 4, r) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    from kvbridge.errors import ShardingError
    with pytest.raises(ShardingError, match="must give 2 stages"):
        pp_layer_range(16, 2, 0, (10, 5))


def test_cp_slots_follow_vllms_virtual_blocks():
    """Block size 4, CP 2, interleave 2: tokens 0-1 rank 0 slots 0-1, 2-3 rank 1 slots 0-1, 4-5
    rank 0 slots 2-3 ... one block id per 8 tokens (the vllm-ascend / vLLM slot mapping)."""
    from kvbridge.core.shard import cp_slots
    vb, rank, off = cp_slots(np.arange(10), 4, 2, 2)
    assert vb.tolist() == [0] * 8 + [1, 1]
    assert rank.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert off.tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 0, 1]
    vb, rank, off = cp_slots(np.arange(6), 2, 3, 1)  # token interleave over 3 ranks
    assert (rank.tolist(), off.tolist()) == ([0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 1, 1])


def test_rank_numbering_round_trips_and_default_is_tp():
    lay = EngineLayout(tp_size=4, pp_size=3, pcp_size=2, dcp_size=2, num_blocks=4)
    seen = set()
    for r in range(lay.world_size):
        c = lay.rank_coords(r)
        assert lay.flat_rank(c.tp, c.pp, c.pcp) == r and c.dcp == c.tp % 2 and c.cp == c.pcp * 2 + c.dcp
        seen.add((c.tp, c.pp, c.pcp))
    assert len(seen) == 24
    assert [EngineLayout(tp_size=4).rank_coords(r).tp for r in range(4)] == [0, 1, 2, 3]


def test_conversion_is_the_reference_cast_element_by_element():
    """bf16 -> fp8 e4m3 with per-head scales, and back: each element is torch's cast of
    (x * src_scale) / dst_scale, saturated to fp8's range, on the executor's copy path."""
    spec = ModelSpec.uniform(2, 2, 8, "bfloat16")
    src = EngineLayout(tp_size=2, block_size=4, num_blocks=4)
    scales = (((0.5, 0.25), (1.0, 2.0)), ((0.125,), (0.0625,)))
    dst = EngineLayout(tp_size=1, block_size=8, num_blocks=3, kv_dtype="fp8", kv_scales=scales)
    req = Request.single_group([0, 1, 2], [2, 0], 11)
    plan = plan_request(spec, src, dst, req)
    assert plan.needs_conversion and {c.dst_dtype for c in plan.conversions} == {"float8_e4m3fn"}
    assert check_case(spec, src, dst, req).ok
    back = Request.single_group([2, 0], [0, 1, 2], 11)
    assert check_case(spec, dst, src, back).ok  # fp8 -> bf16 dequantizes with the same scales
    from kvbridge.core.plan import Conversion
    from kvbridge.transport.convert import convert_elements
    x = torch.tensor([1.0, -3.0, 1000.0, -1e6], dtype=torch.bfloat16)
    y = convert_elements(x, Conversion("bfloat16", "float8_e4m3fn", 1.0, 0.5))
    assert y.to(torch.float32).tolist() == [2.0, -6.0, 448.0, -448.0]  # saturated, never NaN


def test_axes_errors_are_one_line():
    from kvbridge.errors import IncompatibleEngines, InvalidRequest, ShardingError
    spec = ModelSpec.uniform(2, 4, 8)
    with pytest.raises(ShardingError, match="decode context parallel size 2 needs TP 4"):
        plan_request(spec, EngineLayout(tp_size=4, dcp_size=2, num_blocks=4), EngineLayout(num_blocks=4),
                     Request.single_group([0], [0], 4))
    with pytest.raises(IncompatibleEngines, match="DCP size 3 must divide TP size 4"):
        EngineLayout(tp_size=4, dcp_size=3)
    with pytest.raises(IncompatibleEngines, match="layer split"):
        plan_request(spec, EngineLayout(pp_size=2, layer_split=(1, 2), num_blocks=4), EngineLayout(num_blocks=4),
                     Request.single_group([0], [0], 4))
    with pytest.raises(IncompatibleEngines, match="the CP interleave must be >= 1"):
        EngineLayout(block_size=16, cp_interleave=0)
    with pytest.raises(InvalidRequest, match=r"need 2 block ids, got 3"):
        plan_request(spec, EngineLayout(block_size=4, dcp_size=2, tp_size=8, num_blocks=8), EngineLayout(num_blocks=4),
                     Request.single_group([0, 1, 2], [0], 16))


@pytest.mark.parametrize("seed", range(30))
def test_verify_draws_every_axis_and_checks_it(seed):
    """`verify`'s all-axes draw (what `kvbridge verify` should use): byte-exact, checksum when no conversion."""
    import random

    from kvbridge.proofs.verify import random_case
    spec, src, dst, req = random_case(random.Random(seed * 7919), all_axes=True)
    result = check_case(spec, src, dst, req, seed=seed, checksum=True)
    assert result.ok, (result.mismatches, spec.describe(), src.describe(), dst.describe(), req)


# --------------------------------------------------------------------------------------------
# Cached templates (the fast path) against token-by-token planning (the reference)
# --------------------------------------------------------------------------------------------

def _ordered(req: Request) -> Request:
    """The request with each group's ids ascending: neighbouring blocks get consecutive ids, so
    runs continue across blocks and must be merged (fresh vLLM allocations look like this)."""
    return Request(tuple(tuple(sorted(ids)) for ids in req.src_block_ids),
                   tuple(tuple(sorted(ids)) for ids in req.dst_block_ids), req.num_tokens, req.num_cached_tokens)


def assert_same_plan(fast: Plan, reference: Plan) -> None:
    assert fast.conversions == reference.conversions
    for name, arr in reference.runs(conversion=True).items():
        np.testing.assert_array_equal(fast.runs(conversion=True)[name], arr, err_msg=name)


@PLAN_ONLY
@given(cases(max_tokens=160), st.booleans())
def test_templates_plan_like_the_reference(case, ordered):
    """Block sizes, kernel blocks, NHD/HND, kv_first/blocks_first/cross_layer, non-divisible TP,
    prefix hits and partial blocks: the template path gives exactly the token-by-token runs."""
    spec, src, dst, req = case
    req = _ordered(req) if ordered else req
    assert_same_plan(plan_request(spec, src, dst, req), plan_request(spec, src, dst, req, templates=False))


@PLAN_ONLY
@given(axes_cases(max_tokens=160), st.booleans())
def test_templates_plan_like_the_reference_on_every_axis(case, ordered):
    """PP (uneven splits), PCP/DCP with interleaves, group block sizes, KV dtypes with scales,
    clipped window lists: the template path gives exactly the token-by-token runs."""
    spec, src, dst, req = case
    req = _ordered(req) if ordered else req
    assert_same_plan(plan_request(spec, src, dst, req), plan_request(spec, src, dst, req, templates=False))
    ranks = [d for d in range(dst.world_size) if d % 2]
    assert_same_plan(plan_request(spec, src, dst, req, ranks),
                     plan_request(spec, src, dst, req, ranks, templates=False))


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("placement", ["kv_first", "blocks_first", "cross_layer"])
@pytest.mark.parametrize(("src_shape", "dst_shape"), [((1, 16), (2, 16)), ((2, 16), (1, 32)), ((4, 32), (2, 16)),
                                                      ((8, 16), (3, 16))])
def test_common_pairs_take_the_template_path(order, placement, src_shape, dst_shape):
    """The usual engine pairs do get templates (the fast path is not silently skipped), and their
    plans for a request with a partial last block match the reference."""
    from kvbridge.core.plan_template import plan_template
    spec = ModelSpec.uniform(4, 24, 8, "bfloat16")
    lay = lambda tp, block: EngineLayout(  # noqa: E731
        tp_size=tp, block_size=block, num_blocks=64, kv_order=order,
        kv_placement="kv_first" if placement == "kv_first" else "blocks_first",
        layer_placement="cross_layer" if placement == "cross_layer" else "per_layer")
    src, dst = lay(*src_shape), lay(*dst_shape)
    assert all(plan_template(spec, src, dst, d, 0) is not None for d in range(dst.world_size))
    rng = np.random.default_rng(0)
    tokens = 1000 - 7
    req = Request((tuple(rng.permutation(64)[:-(-tokens // src.block_size)].tolist()),),
                  (tuple(rng.permutation(64)[:-(-tokens // dst.block_size)].tolist()),), tokens, 48)
    assert_same_plan(plan_request(spec, src, dst, req), plan_request(spec, src, dst, req, templates=False))
    assert_same_plan(plan_request(spec, src, dst, _ordered(req)),
                     plan_request(spec, src, dst, _ordered(req), templates=False))


@pytest.mark.parametrize("dst", ["float8_e4m3fn", "float8_e5m2", "float16", "bfloat16", "float32"])
def test_conversion_divides_truly_and_writes_one_nan(dst):
    """Every fp8 source value: `(x * s) / d` in float32 with a true division (CUDA turns a division
    by a host scalar into a multiplication by its reciprocal, which rounds otherwise), and every NaN
    as one bit pattern whatever its sign (a cast keeps or drops it by device)."""
    from kvbridge.core.plan import Conversion
    from kvbridge.transport.cache import TORCH_DTYPES
    from kvbridge.transport.convert import convert_elements
    x = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = convert_elements(x, Conversion("float8_e4m3fn", dst, 0.03, 0.03))
    f32 = x.float().numpy()
    want = torch.from_numpy((f32 * np.float32(0.03)) / np.float32(0.03))
    if dst.startswith("float8"):
        want = want.clamp(-torch.finfo(out.dtype).max, torch.finfo(out.dtype).max)
    want = want.to(TORCH_DTYPES[dst])
    finite = ~torch.from_numpy(np.isnan(f32))
    assert torch.equal(out[finite].float(), want[finite].float())
    bits = out.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[out.element_size()])[~finite]
    assert len(bits) == 2 and bits.unique().numel() == 1 and torch.isnan(out[~finite]).all()

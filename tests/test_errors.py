"""Bad input gives a clear `KVBridgeError` subclass naming the offending values, and nothing is
written to the destination."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge import (ConfigError, EngineLayout, IncompatibleEngines, InvalidRequest, KVBridgeError, LayerSpec,
                      ModelSpec, RankCache, ShardingError)
from kvbridge.core.plan import Plan, Request, plan_request
from kvbridge.core.shard import check_shardable
from kvbridge.core.topology import TransferTopology
from kvbridge.transport.local import LocalExecutor, execute_plan
from kvbridge.proofs.verify import fill_source, random_bytes

SPEC = ModelSpec.uniform(2, 4, 8, "bfloat16")
SWA = ModelSpec.uniform(2, 4, 8, "bfloat16", kinds=("sliding", "full"), window=5)  # 2 groups
SRC = EngineLayout(tp_size=2, block_size=4, num_blocks=6)
DST = EngineLayout(tp_size=1, block_size=8, num_blocks=4)


def engines(spec=SPEC, src=SRC, dst=DST):
    s = RankCache.allocate_engine(spec, src, fill=None)
    d = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(s, 3)
    random_bytes(d, 4)
    return s, d


def snapshot(caches):
    return [r.clone() for c in caches for r in c.byte_regions()]


def assert_unchanged(caches, before):
    after = snapshot(caches)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert torch.equal(a, b)


def assert_rejected(exc_type, request, *fragments, spec=SPEC, src=SRC, dst=DST):
    """Planning + executing `request` raises `exc_type` naming `fragments`; destination untouched."""
    s, d = engines(spec, src, dst)
    before = snapshot(d)
    with pytest.raises(exc_type) as e:
        plan = plan_request(spec, src, dst, request)
        execute_plan(plan, s, d)
    assert isinstance(e.value, KVBridgeError) and isinstance(e.value, ValueError)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    assert_unchanged(d, before)
    return e.value


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

def test_too_few_source_block_ids():
    # 12 tokens, source block 4 -> 3 ids needed
    assert_rejected(InvalidRequest, Request.single_group([0, 1], [0, 1], 12), "source", "12 tokens",
                    "block size 4", "need 3", "got 2")


def test_too_many_destination_block_ids():
    assert_rejected(InvalidRequest, Request.single_group([0, 1, 2], [0, 1, 2], 12), "destination", "need 2",
                    "got 3")


@pytest.mark.parametrize(("side", "bad"), [("source", 6), ("source", 99), ("source", -1), ("destination", 4),
                                           ("destination", -3)])
def test_block_id_out_of_range(side, bad):
    src_ids, dst_ids = [0, 1, 2], [0, 1]
    limit = SRC.num_blocks if side == "source" else DST.num_blocks
    if side == "source":
        src_ids[1] = bad
    else:
        dst_ids[1] = bad
    assert_rejected(InvalidRequest, Request.single_group(src_ids, dst_ids, 12), side, f"block id {bad}",
                    f"[0, {limit})")


def test_block_ids_that_hold_no_moved_token_are_not_checked():
    # Documented: entries before the window or inside the cached prefix are never read (vLLM's null
    # block sits there), so they may be anything, even out of range.
    req = Request.single_group([-1, 99, 2], [-7, 1], 12, num_cached_tokens=8)
    plan = plan_request(SPEC, SRC, DST, req)
    assert plan.nbytes > 0


def test_wrong_number_of_groups():
    assert_rejected(InvalidRequest, Request.single_group([0, 1, 2], [0, 1], 12, num_groups=1), "source",
                    "1 KV-cache groups", "the model has 2", spec=SWA)
    assert_rejected(InvalidRequest, Request(((0, 1, 2), (3, 4, 5)), ((0, 1),), 12), "destination", "1 KV-cache",
                    "has 2", spec=SWA)
    assert_rejected(InvalidRequest, Request.single_group([0, 1, 2], [0, 1], 12, num_groups=3), "3 KV-cache",
                    "has 1")


@pytest.mark.parametrize(("tokens", "cached"), [(12, 13), (4, 100), (12, -1), (-1, 0)])
def test_cached_tokens_out_of_bounds(tokens, cached):
    n = max(tokens, 0)
    req = Request.single_group(list(range(-(-n // 4))), list(range(-(-n // 8))), tokens, cached)
    assert_rejected(InvalidRequest, req, str(cached), str(tokens))


def test_destination_rank_out_of_range():
    with pytest.raises(InvalidRequest, match="destination rank 1 outside TP size 1"):
        plan_request(SPEC, SRC, DST, Request.single_group([0, 1, 2], [0, 1], 12), dst_ranks=[1])


def test_duplicate_destination_block_ids_rejected():
    # Two logical blocks on one physical block would be written twice (overlapping runs).
    assert_rejected(InvalidRequest, Request.single_group([0, 1, 2], [1, 1], 12), "block id 1")


# --------------------------------------------------------------------------------------------
# Engines and geometry
# --------------------------------------------------------------------------------------------

def test_impossible_tp_sharding():
    spec = ModelSpec.uniform(1, 6, 8)
    bad = EngineLayout(tp_size=4, block_size=4, num_blocks=4)
    good = EngineLayout(tp_size=2, block_size=4, num_blocks=4)
    for src, dst, side in ((bad, good, "source engine"), (good, bad, "destination engine")):
        with pytest.raises(ShardingError) as e:
            plan_request(spec, src, dst, Request.single_group([0], [0], 4))
        assert "6 KV heads" in str(e.value) and "TP=4" in str(e.value) and side in str(e.value)
    with pytest.raises(ShardingError, match="6 KV heads over TP=4"):
        RankCache.allocate(spec, bad, 0)
    with pytest.raises(ShardingError, match="TP size must be >= 1, got 0"):
        check_shardable(6, 0)


@pytest.mark.parametrize(("block", "kernel"), [(16, 6), (16, 32), (12, 8), (16, -4)])
def test_kernel_block_size_must_divide_block_size(block, kernel):
    with pytest.raises(IncompatibleEngines) as e:
        EngineLayout(block_size=block, kernel_block_size=kernel)
    assert str(block) in str(e.value) and "kernel block size" in str(e.value)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(tp_size=0), "got 0, 16, 1024"), (dict(block_size=0), "got 1, 0, 1024"), (dict(num_blocks=0), "got 1, 16, 0"),
    (dict(kv_order="HDN"), "'HDN'"), (dict(kv_placement="v_first"), "'v_first'"),
    (dict(layer_placement="per_block"), "'per_block'"),
    (dict(kv_placement="kv_first", layer_placement="cross_layer"), "blocks_first"),
])
def test_bad_layout_fields(kwargs, fragment):
    with pytest.raises(IncompatibleEngines) as e:
        EngineLayout(**kwargs)
    assert fragment in str(e.value)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(kind="attention", num_kv_heads=1, key_dim=8, value_dim=8), "'attention'"),
    (dict(kind="full", num_kv_heads=0, key_dim=8, value_dim=8), "0"),
    (dict(kind="sliding", num_kv_heads=2, key_dim=8, value_dim=8), "window"),
    (dict(kind="sliding", num_kv_heads=2, key_dim=8, value_dim=8, window=1), "window >= 2, got 1"),
    (dict(kind="full", num_kv_heads=2, key_dim=8, value_dim=8, window=4), "window 4"),
    (dict(kind="mla", num_kv_heads=2, key_dim=8), "MLA"),
    (dict(kind="full", num_kv_heads=2, key_dim=8), "value_dim >= 1, got 0"),
])
def test_bad_layer_spec(kwargs, fragment):
    with pytest.raises(ConfigError) as e:
        LayerSpec(**kwargs)
    assert fragment in str(e.value)


def test_bad_model_spec():
    with pytest.raises(ConfigError, match="at least one layer"):
        ModelSpec(())
    with pytest.raises(ConfigError) as e:
        ModelSpec.uniform(1, 2, 8, "float64")
    assert "'float64'" in str(e.value) and "bfloat16" in str(e.value)


@pytest.mark.parametrize(("remote", "values"), [
    (ModelSpec.uniform(2, 4, 16, "bfloat16"), ("8", "16")),
    (ModelSpec.uniform(2, 2, 8, "bfloat16"), ("4", "2")),
    (ModelSpec.uniform(2, 4, 8, "float16"), ("bfloat16", "float16")),
    (ModelSpec.uniform(1, 4, 8, "bfloat16"), ("2", "1")),
    (SWA, ("full", "sliding")),
])
def test_mismatched_geometry_refused_at_registration(remote, values):
    t = TransferTopology("D", SPEC, DST)
    with pytest.raises(IncompatibleEngines) as e:
        t.register_remote_engine("P", SRC, remote)
    for v in values:
        assert v in str(e.value)
    with pytest.raises(KVBridgeError, match="unknown engine 'P'"):
        t.get_engine_info("P")


def test_rank_cache_with_wrong_regions():
    regions = [torch.empty(10, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(IncompatibleEngines, match="region 0 of rank 0 must be a contiguous tensor of"):
        RankCache(SPEC, DST, 0, regions)
    with pytest.raises(IncompatibleEngines, match="layout needs 2 regions, got 1"):
        RankCache(SPEC, DST, 0, regions[:1])
    need = DST.addressing(SPEC, 0).region_nbytes[0] // 2
    strided = torch.empty(2 * need, dtype=torch.bfloat16)[::2]
    with pytest.raises(IncompatibleEngines, match="not contiguous"):
        RankCache(SPEC, DST, 0, [strided, torch.empty(need, dtype=torch.bfloat16)])
    with pytest.raises(InvalidRequest, match="rank 2 outside TP size 2"):
        SRC.addressing(SPEC, 2)


# --------------------------------------------------------------------------------------------
# The executor refuses a plan whose runs leave the regions, before writing any byte
# --------------------------------------------------------------------------------------------

def _valid_plan():
    req = Request.single_group([4, 0, 2], [3, 1], 12)
    return req, plan_request(SPEC, SRC, DST, req)


def _with(plan: Plan, index: int, **changes) -> Plan:
    runs = {k: v.copy() for k, v in plan.runs().items()}
    for k, v in changes.items():
        runs[k][index] = v
    return Plan(plan.spec, plan.src, plan.dst, runs)


def _bad_plans():
    _, plan = _valid_plan()
    last = len(plan) - 1  # earlier runs are valid: a partial copy would show
    dst_size = DST.addressing(SPEC, 0).region_nbytes[0]
    src_size = SRC.addressing(SPEC, 0).region_nbytes[0]
    return {
        "dst past end": _with(plan, last, dst_offset=dst_size - 1),
        "dst negative": _with(plan, last, dst_offset=-2),
        "src past end": _with(plan, last, src_offset=src_size),
        "src negative": _with(plan, last, src_offset=-64),
        "length overrun": _with(plan, last, length=dst_size + 2),
        "hand-built": Plan(SPEC, SRC, DST, {
            "dst_rank": np.array([0, 0]), "src_rank": np.array([0, 1]), "src_region": np.array([0, 1]),
            "src_offset": np.array([0, 0]), "dst_region": np.array([0, 1]),
            "dst_offset": np.array([0, dst_size]), "length": np.array([64, 64])}),
    }


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("which", list(_bad_plans()))
def test_executor_refuses_out_of_region_runs_without_writing(backend, which):
    bad = _bad_plans()[which]
    req, _ = _valid_plan()
    s, d = engines()
    fill_source(s, req.src_block_ids, req.num_tokens)
    before = snapshot(d)
    with pytest.raises(InvalidRequest) as e:
        LocalExecutor(s, d, backend=backend).execute(bad)
    assert "falls outside the registered regions" in str(e.value)
    assert_unchanged(d, before)


DST2 = EngineLayout(tp_size=2, block_size=8, num_blocks=4)


@pytest.mark.parametrize("field", ["dst_region", "src_region"])
def test_executor_refuses_region_index_outside_its_rank(field):
    # Regression: offsets were checked against the flattened region list of all ranks only, so
    # dst_region 2 of rank 0 (which has regions 0, 1) landed in rank 1's region 0.
    req = Request.single_group([4, 0, 2], [3, 1], 12)
    plan = plan_request(SPEC, SRC, DST2, req)
    first = int(np.flatnonzero((plan.dst_rank == 0) & (plan.src_rank == 0))[0])
    bad = _with(plan, first, **{field: 2})
    s, d = engines(dst=DST2)
    before = snapshot(d)
    with pytest.raises(InvalidRequest):
        LocalExecutor(s, d).execute(bad)
    assert_unchanged(d, before)


def test_executor_refuses_plan_for_other_tp_sizes():
    _, plan = _valid_plan()
    s, d = engines()
    before = snapshot(d)
    with pytest.raises(InvalidRequest, match=r"plan is for TP 2 -> 1, executor holds 1 -> 1"):
        LocalExecutor(s[:1], d).execute(plan)
    assert_unchanged(d, before)


def test_backend_selection_on_cpu():
    s, d = engines()
    assert LocalExecutor(s, d, backend="auto").backend == "numba"
    assert LocalExecutor(s, d, backend="torch").backend == "torch"

"""vLLM's topology vectors (shared/reference/topology.md §2.1-2.6, §3, §4.A, §4.B, §5) as unit
tests of `TransferTopology` and `kvbridge.core.shard`.

Convention: NIXL pull, so the topology is built on the decode (D) side and the prefill (P)
engine is the registered remote, unless a test says otherwise (Mooncake push builds it on P).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge import EngineLayout, IncompatibleEngines, KVBridgeError, LayerSpec, ModelSpec, ShardingError
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.shard import assign_sources, head_range, holders, overlapping_ranks
from kvbridge.core.topology import StageInfo, TransferTopology


def topo(local_tp: int, rank: int, remote_tp: int, heads: int = 8, mla: bool = False,
         remote_id: str = "remote") -> TransferTopology:
    spec = (ModelSpec.uniform(2, 1, 576, kinds=("mla",)) if mla else ModelSpec.uniform(2, heads, 128))
    t = TransferTopology("local", spec, EngineLayout(tp_size=local_tp), rank)
    t.register_remote_engine(remote_id, EngineLayout(tp_size=remote_tp))
    return t


# --------------------------------------------------------------------------------------------
# tp_ratio (§2.1, §4.A derived row)
# --------------------------------------------------------------------------------------------

TP_RATIO_TABLE = [((1, 1), 1), ((2, 1), 2), ((1, 2), -2), ((4, 2), 2), ((2, 4), -2), ((8, 2), 4),
                  ((2, 8), -4), ((16, 8), 2), ((8, 16), -2), ((6, 2), 3), ((1, 6), -6)]


@pytest.mark.parametrize(("pair", "expected"), TP_RATIO_TABLE)
def test_tp_ratio_table(pair, expected):
    local, remote = pair
    # 48 heads shard over every TP size of the table; K=1 (all replicated) must give the same ratio.
    for heads in (48, 1):
        t = topo(local, 0, remote, heads=heads)
        assert t.tp_ratio("remote") == expected
        assert t.tp_ratio("remote") != 0
        # Sign: positive iff local >= remote (several local ranks share one remote rank).
        assert (t.tp_ratio("remote") > 0) == (local >= remote)


def test_tp_ratio_flips_sign_from_the_other_side():
    # §2.1: the ratio is from the caller's side. P TP=1 sees D TP=2 as -2; D sees P as +2 (§3.1).
    d_side = topo(2, 0, 1)
    p_side = topo(1, 0, 2)
    assert d_side.tp_ratio("remote") == 2
    assert p_side.tp_ratio("remote") == -2


@pytest.mark.parametrize(("local", "remote"), [(3, 2), (2, 3), (6, 4), (4, 6)])
def test_tp_ratio_non_divisible_raises_sharding_error(local, remote):
    # kvbridge plans these pairs, but tp_ratio is vLLM's and defined for divisible pairs only (§5.1).
    t = topo(local, 0, remote, heads=12)
    with pytest.raises(ShardingError) as e:
        t.tp_ratio("remote")
    assert str(max(local, remote)) in str(e.value) and str(min(local, remote)) in str(e.value)
    assert "not divisible" in str(e.value)


def test_non_divisible_pair_is_still_planned():
    # P=3 / D=2 with 6 heads: no tp_ratio, but source slices cover every head D needs.
    t = topo(2, 0, 3, heads=6)
    assert t.handshake_target_ranks("remote") == (0, 1)
    assert [tuple(s) for s in t.head_slices("remote")] == [(0, 0, 2), (1, 2, 3)]
    t1 = topo(2, 1, 3, heads=6)
    assert [tuple(s) for s in t1.head_slices("remote")] == [(1, 3, 4), (2, 4, 6)]


# --------------------------------------------------------------------------------------------
# Handshake target ranks (§2.2, every row of §4.A)
# --------------------------------------------------------------------------------------------

HANDSHAKE_ROWS = [
    # (local tp, local rank, remote tp, expected targets)
    # TestDensePlanStructure / TestTPMappingStructure
    (2, 1, 2, (1,)), (4, 2, 2, (1,)), (1, 0, 2, (0, 1)),
    # test_prefill_tp_size_greater_than_decode_tp_size: remote agents {0,1} and {0..5}
    (1, 0, 6, (0, 1, 2, 3, 4, 5)),
    # test_kv_producer_heterogeneous_tp (Mooncake, P local rank 0 of 2)
    (2, 0, 1, (0,)), (2, 0, 4, (0, 1)),
    # TestNoDcp
    (2, 0, 2, (0,)), (4, 0, 2, (0,)), (4, 3, 2, (1,)),
]
HANDSHAKE_ROWS += [(8, r, 4, (r // 2,)) for r in range(8)]  # derived tp 8 / 4
HANDSHAKE_ROWS += [(4, r, 8, (2 * r, 2 * r + 1)) for r in range(4)]  # derived tp 4 / 8
HANDSHAKE_ROWS += [(16, r, 8, (r // 2,)) for r in range(16)]  # derived tp 16 / 8
HANDSHAKE_ROWS += [(8, r, 16, (2 * r, 2 * r + 1)) for r in range(8)]  # derived tp 8 / 16


@pytest.mark.parametrize(("local_tp", "rank", "remote_tp", "expected"), HANDSHAKE_ROWS)
def test_handshake_target_ranks(local_tp, rank, remote_tp, expected):
    for heads, mla in ((48, False), (8, False), (1, False), (1, True)):
        if not mla and heads % local_tp and local_tp % heads:
            continue
        if not mla and heads % remote_tp and remote_tp % heads:
            continue
        assert topo(local_tp, rank, remote_tp, heads=heads, mla=mla).handshake_target_ranks("remote") == expected
    assert overlapping_ranks(local_tp, rank, remote_tp) == expected


@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 1), (2, 1), (1, 2), (8, 2), (2, 8), (16, 8), (8, 16)])
def test_handshake_formula_for_divisible_pairs(local_tp, remote_tp):
    # §2.2: ratio > 0 -> [r // ratio]; ratio < 0 -> [r*a .. r*a+a-1]; inverse mapping too.
    for r in range(local_tp):
        got = overlapping_ranks(local_tp, r, remote_tp)
        if local_tp >= remote_tp:
            assert got == (r // (local_tp // remote_tp),)
        else:
            a = remote_tp // local_tp
            assert got == tuple(range(r * a, r * a + a))
    for q in range(remote_tp):
        users = tuple(r for r in range(local_tp) if q in overlapping_ranks(local_tp, r, remote_tp))
        if local_tp >= remote_tp:
            ratio = local_tp // remote_tp
            assert users == tuple(range(q * ratio, q * ratio + ratio))
        else:
            assert users == (q // (remote_tp // local_tp),)


# --------------------------------------------------------------------------------------------
# Replication predicates (§2.4): strict '>'
# --------------------------------------------------------------------------------------------

def test_is_kv_replicated_is_strict():
    assert topo(8, 0, 8, heads=8).is_kv_replicated("remote") is False  # TP 8, K 8: sharded
    assert topo(8, 0, 16, heads=8).is_kv_replicated("remote") is True  # TP 16, K 8: replicated
    assert topo(8, 0, 4, heads=8).is_kv_replicated("remote") is False
    # it is about the remote engine only
    assert topo(16, 0, 8, heads=8).is_kv_replicated("remote") is False
    assert topo(16, 0, 8, heads=8).local_replicates_kv_cache is True
    assert topo(8, 0, 16, heads=8).local_replicates_kv_cache is False


def test_replicates_kv_cache_for_mla_and_gqa():
    for local, remote in ((1, 1), (2, 4), (4, 2), (8, 1)):
        t = topo(local, 0, remote, mla=True)
        assert t.is_mla
        assert t.total_num_kv_heads == 1
        assert t.replicates_kv_cache("remote") is True
        assert t.local_replicates_kv_cache is True
    assert topo(2, 0, 8, heads=8).replicates_kv_cache("remote") is False
    assert topo(2, 0, 16, heads=8).replicates_kv_cache("remote") is True


# --------------------------------------------------------------------------------------------
# Head sharding (§2.3)
# --------------------------------------------------------------------------------------------

def test_head_ranges_sharded_and_contiguously_replicated():
    assert [head_range(8, 4, q) for q in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [head_range(8, 8, q) for q in range(8)] == [(q, q + 1) for q in range(8)]
    # K=8, T=16: ranks (2h, 2h+1) -> head h
    assert [head_range(8, 16, q) for q in range(16)] == [(q // 2, q // 2 + 1) for q in range(16)]
    assert [tuple(holders(8, 16, h)) for h in range(8)] == [(2 * h, 2 * h + 1) for h in range(8)]
    assert head_range(1, 4, 3, replicated=True) == (0, 1)
    assert tuple(holders(1, 4, 0, replicated=True)) == (0, 1, 2, 3)


# --------------------------------------------------------------------------------------------
# Source ranks (current upstream read set, §2.2, §3.6, §4.A, §4.B, §3.3, §3.4)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("local_tp", "rank", "remote_tp", "expected"), [
    (2, 1, 2, (1,)),  # test_source_ranks_homogeneous
    (4, 2, 2, (1,)),  # test_source_ranks_d_gt_p
    (1, 0, 2, (0, 1)),  # test_source_ranks_p_gt_d
])
def test_source_ranks_dense_plan_structure(local_tp, rank, remote_tp, expected):
    assert topo(local_tp, rank, remote_tp, heads=8).source_ranks("remote") == expected


def test_gqa_dedup_p16_d2_k8():
    # §3.6: P TP=16 -> D TP=2, K=8: D0 reads [0,2,4,6]; D1 [8,10,12,14]
    assert topo(2, 0, 16, heads=8).source_ranks("remote") == (0, 2, 4, 6)
    assert topo(2, 1, 16, heads=8).source_ranks("remote") == (8, 10, 12, 14)
    # handshake still covers the whole group
    assert topo(2, 0, 16, heads=8).handshake_target_ranks("remote") == tuple(range(8))


@pytest.mark.parametrize(("d_tp", "p_tp", "expected"), [
    (1, 2, {0: (0, 1)}),                      # 2p1d
    (1, 4, {0: (0, 2)}),                      # 4p1d
    (2, 4, {0: (0,), 1: (2,)}),               # 4p2d
    (4, 1, {r: (0,) for r in range(4)}),      # 1p4d
    (4, 2, {r: (r // 2,) for r in range(4)}),  # 2p4d
    (8, 4, {r: (r // 2,) for r in range(8)}),  # 4p8d
])
def test_section_4b_attention_sources_k2(d_tp, p_tp, expected):
    for r, want in expected.items():
        t = topo(d_tp, r, p_tp, heads=2)
        assert t.source_ranks("remote") == want


def test_section_4b_replication_flags_k2():
    assert topo(4, 0, 1, heads=2).local_replicates_kv_cache  # 1p4d: D replicated
    t = topo(4, 0, 2, heads=2)  # 2p4d: D replicated, P NOT (2 == K)
    assert t.local_replicates_kv_cache and not t.is_kv_replicated("remote")
    t = topo(8, 0, 4, heads=2)  # 4p8d: both replicated
    assert t.local_replicates_kv_cache and t.is_kv_replicated("remote")


def test_replicated_p_larger_than_d_reads_one_rank_per_head():
    # §3.3 reverse (P TP=16 -> D TP=8, K=8): vLLM rejects dense; kvbridge goes beyond and reads
    # attention from [2d] only, as compute_tp_mapping does for Mamba hybrids.
    for d in range(8):
        t = topo(8, d, 16, heads=8)
        assert t.tp_ratio("remote") == -2
        assert t.is_kv_replicated("remote")
        assert t.source_ranks("remote") == (2 * d,)
        assert t.handshake_target_ranks("remote") == (2 * d, 2 * d + 1)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(4, 2), (2, 4), (2, 1), (1, 2), (8, 1), (3, 2), (2, 3)])
def test_mla_source_rank_is_floor_r_p_over_d(p_tp, d_tp):
    # §3.4 / §2.6: one source rank floor(r*P/D), offset 0, whole latent block.
    for r in range(d_tp):
        t = topo(d_tp, r, p_tp, mla=True)
        assert t.source_ranks("remote") == (r * p_tp // d_tp,)
        assert [tuple(s) for s in t.head_slices("remote")] == [(r * p_tp // d_tp, 0, 1)]
    if p_tp % d_tp == 0:  # P > D: handshake with the group, read its first rank
        a = p_tp // d_tp
        for r in range(d_tp):
            assert topo(d_tp, r, p_tp, mla=True).handshake_target_ranks("remote") == tuple(range(r * a, r * a + a))


def test_reader_ranks_are_inverse_of_source_ranks():
    # Push side (Mooncake): which D ranks read from this P rank.
    for p_tp, d_tp, heads in ((16, 2, 8), (4, 2, 2), (1, 4, 8), (2, 4, 8), (4, 8, 2), (3, 2, 6)):
        spec = ModelSpec.uniform(1, heads, 16)
        for p in range(p_tp):
            t = TransferTopology("P", spec, EngineLayout(tp_size=p_tp), p)
            t.register_remote_engine("D", EngineLayout(tp_size=d_tp))
            readers = t.reader_ranks("D")
            expected = tuple(d for d in range(d_tp)
                             if p in {s.src_rank for s in assign_sources(heads, p_tp, d_tp, d)})
            assert readers == expected
    # P16 -> D2 K8: only even P ranks are read (first replica)
    spec = ModelSpec.uniform(1, 8, 16)
    for p in range(16):
        t = TransferTopology("P", spec, EngineLayout(tp_size=16), p)
        t.register_remote_engine("D", EngineLayout(tp_size=2))
        assert t.reader_ranks("D") == ((p // 8,) if p % 2 == 0 else ())


def test_read_set_within_handshake_set_for_divisible_pairs():
    # §2.2: the handshake set is a superset of what is read.
    for heads in (1, 2, 4, 8):
        for p_tp in (1, 2, 4, 8, 16):
            for d_tp in (1, 2, 4, 8, 16):
                if max(p_tp, d_tp) % min(p_tp, d_tp):
                    continue
                for r in range(d_tp):
                    t = topo(d_tp, r, p_tp, heads=heads)
                    assert set(t.source_ranks("remote")) <= set(t.handshake_target_ranks("remote"))


def test_current_read_plan_for_d_ge_p():
    # §2.2: when L_tp >= R_tp the attention source is [floor(r*R/L)], for any K.
    for heads in (1, 2, 4, 8):
        for p_tp, d_tp in ((1, 2), (2, 4), (4, 8), (8, 16), (1, 8), (2, 2)):
            for r in range(d_tp):
                assert topo(d_tp, r, p_tp, heads=heads).source_ranks("remote") == (r * p_tp // d_tp,)


def test_current_read_plan_for_p_gt_d_is_first_rank_per_distinct_head():
    # §2.2: candidates r*a..r*a+a-1, head key floor(q*K/R), keep first rank per key.
    for heads in (1, 2, 4, 8):
        for p_tp, d_tp in ((2, 1), (4, 1), (4, 2), (8, 2), (16, 2), (16, 4), (16, 8)):
            a = p_tp // d_tp
            for r in range(d_tp):
                seen, want = set(), []
                for q in range(r * a, r * a + a):
                    key = q * heads // p_tp
                    if key not in seen:
                        seen.add(key)
                        want.append(q)
                assert topo(d_tp, r, p_tp, heads=heads).source_ranks("remote") == tuple(want)


# --------------------------------------------------------------------------------------------
# Registration (§2.11, §5.3) and geometry validation at handshake
# --------------------------------------------------------------------------------------------

def test_register_remote_engine_is_idempotent():
    spec = ModelSpec.uniform(2, 8, 128)
    t = TransferTopology("D", spec, EngineLayout(tp_size=2))
    a = t.register_remote_engine("P", EngineLayout(tp_size=4))
    b = t.register_remote_engine("P", EngineLayout(tp_size=4))
    c = t.register_remote_engine("P", EngineLayout(tp_size=4), spec)
    assert a is b is c
    assert t.get_engine_info("P") is a
    assert t.remote_engine_ids == ("P",)
    assert t.get_engine_info("D") is t.local


def test_registering_local_engine_id_raises():
    t = TransferTopology("D", ModelSpec.uniform(2, 8, 128), EngineLayout(tp_size=2))
    with pytest.raises(KVBridgeError, match="'D'"):
        t.register_remote_engine("D", EngineLayout(tp_size=2))
    assert t.remote_engine_ids == ()


def test_changed_layout_under_same_id_raises():
    t = TransferTopology("D", ModelSpec.uniform(2, 8, 128), EngineLayout(tp_size=2))
    first = t.register_remote_engine("P", EngineLayout(tp_size=4))
    for changed in (EngineLayout(tp_size=8), EngineLayout(tp_size=4, kv_order="NHD"),
                    EngineLayout(tp_size=4, block_size=32)):
        with pytest.raises(IncompatibleEngines) as e:
            t.register_remote_engine("P", changed)
        assert "'P'" in str(e.value)
    assert t.get_engine_info("P") is first


def test_changed_spec_under_same_id_names_the_change():
    # Same layout, different geometry: the message must name the changed field, not the layout twice.
    t = TransferTopology("D", ModelSpec.uniform(2, 8, 128), EngineLayout(tp_size=2))
    t.register_remote_engine("P", EngineLayout(tp_size=4))
    with pytest.raises(IncompatibleEngines) as e:
        t.register_remote_engine("P", EngineLayout(tp_size=4), ModelSpec.uniform(2, 8, 64))
    assert "64" in str(e.value)


def _sliding(window: int) -> ModelSpec:
    return ModelSpec.uniform(2, 8, 128, kinds=("sliding", "full"), window=window)


@pytest.mark.parametrize(("local", "remote", "values"), [
    (ModelSpec.uniform(2, 8, 128), ModelSpec.uniform(3, 8, 128), ("2", "3")),                      # layers
    (ModelSpec.uniform(2, 8, 128), ModelSpec.uniform(2, 4, 128), ("8", "4")),                      # heads
    (ModelSpec.uniform(2, 8, 128), ModelSpec.uniform(2, 8, 64), ("128", "64")),                    # head dim
    (ModelSpec.uniform(2, 8, 128), ModelSpec.uniform(2, 8, 128, "float16"), ("bfloat16", "float16")),  # dtype
    (ModelSpec.uniform(2, 1, 576, kinds=("mla",)), ModelSpec.uniform(2, 1, 576), ("mla", "full")),  # MLA vs not
    (_sliding(4096), _sliding(1024), ("4096", "1024")),                                             # window
    (ModelSpec((LayerSpec("full", 8, 128, 128),)), ModelSpec((LayerSpec("full", 8, 128, 64),)), ("128", "64")),  # V dim
])
def test_geometry_mismatch_raises_naming_both_values(local, remote, values):
    t = TransferTopology("D", local, EngineLayout(tp_size=1))
    with pytest.raises(IncompatibleEngines) as e:
        t.register_remote_engine("P", EngineLayout(tp_size=1), remote)
    msg = str(e.value)
    for v in values:
        assert v in msg, msg
    assert "'P'" in msg
    assert t.remote_engine_ids == ()


def test_illegal_sharding_raises():
    spec = ModelSpec.uniform(2, 6, 64)
    with pytest.raises(ShardingError, match=r"6 KV heads over TP=4"):
        TransferTopology("D", spec, EngineLayout(tp_size=4))
    t = TransferTopology("D", spec, EngineLayout(tp_size=2))
    with pytest.raises(ShardingError, match=r"6 KV heads over TP=4"):
        t.register_remote_engine("P", EngineLayout(tp_size=4))
    assert t.remote_engine_ids == ()
    with pytest.raises(ShardingError):
        TransferTopology("D", spec, EngineLayout(tp_size=2), tp_rank=2)


def test_unknown_engine_raises_listing_known():
    t = topo(2, 0, 4)
    with pytest.raises(KVBridgeError, match="'nope'.*remote"):
        t.tp_ratio("nope")


# --------------------------------------------------------------------------------------------
# Head-slice byte offsets through the planner (§3.1, §3.3)
# --------------------------------------------------------------------------------------------

def _k_runs(spec, src, dst, d, src_ids, dst_ids, num_tokens):
    """(src block, src offset within block, dst block, dst offset within block, length) of K runs."""
    plan = plan_request(spec, src, dst, Request.single_group(src_ids, dst_ids, num_tokens), dst_ranks=[d])
    s_addr = src.addressing(spec, 0)
    d_addr = dst.addressing(spec, d)
    out = []
    for so, do, ln, sr in zip(plan.src_offset, plan.dst_offset, plan.length, plan.src_rank):
        s_addr = src.addressing(spec, int(sr))
        k_src_bytes = src.num_kernel_blocks * int(s_addr.block_stride[0, 0])
        if so >= k_src_bytes:  # V part of the kv_first region
            assert do >= dst.num_kernel_blocks * int(d_addr.block_stride[0, 0])
            continue
        sb, sw = divmod(int(so), int(s_addr.block_stride[0, 0]))
        db, dw = divmod(int(do), int(d_addr.block_stride[0, 0]))
        out.append((int(sr), sb, sw, db, dw, int(ln)))
    return out


def test_section_3_1_p1_d2_head_slice_offsets():
    # K=8, head_dim 128, block 16, bf16, HND: D rank r reads [r*16384, (r+1)*16384) of each K block.
    spec = ModelSpec.uniform(1, 8, 128, "bfloat16")
    src = EngineLayout(tp_size=1, block_size=16, num_blocks=8, kv_order="HND")
    dst = EngineLayout(tp_size=2, block_size=16, num_blocks=8, kv_order="HND")
    assert int(src.addressing(spec, 0).block_stride[0, 0]) == 32768
    assert int(dst.addressing(spec, 0).block_stride[0, 0]) == 16384
    src_ids, dst_ids = [5, 2, 7], [1, 6, 3]  # non-contiguous so runs cannot merge across blocks
    for r in range(2):
        runs = _k_runs(spec, src, dst, r, src_ids, dst_ids, 48)
        assert sorted(runs) == sorted((0, s, r * 16384, d, 0, 16384) for s, d in zip(src_ids, dst_ids))


def test_section_3_1_blocks_first_variant():
    # per-layer block_len 32768 on D, 65536 on P; K at b*65536 + r*16384, V at +32768.
    spec = ModelSpec.uniform(1, 8, 128, "bfloat16")
    src = EngineLayout(tp_size=1, block_size=16, num_blocks=8, kv_placement="blocks_first")
    dst = EngineLayout(tp_size=2, block_size=16, num_blocks=8, kv_placement="blocks_first")
    for r in range(2):
        plan = plan_request(spec, src, dst, Request.single_group([5], [3], 16), dst_ranks=[r])
        got = sorted(zip(plan.src_offset.tolist(), plan.dst_offset.tolist(), plan.length.tolist()))
        assert got == [(5 * 65536 + r * 16384, 3 * 32768, 16384),
                       (5 * 65536 + 32768 + r * 16384, 3 * 32768 + 16384, 16384)]


def test_section_3_3_d16_p8_reads_whole_p_block():
    # K=8, D 16 / P 8: D ranks 2h, 2h+1 read all of P rank h's block at offset 0 (issue #45330).
    spec = ModelSpec.uniform(1, 8, 128, "bfloat16")
    src = EngineLayout(tp_size=8, block_size=16, num_blocks=8)
    dst = EngineLayout(tp_size=16, block_size=16, num_blocks=8)
    src_ids, dst_ids = [4, 1], [2, 6]
    for r in range(16):
        runs = _k_runs(spec, src, dst, r, src_ids, dst_ids, 32)
        assert sorted(runs) == sorted((r // 2, s, 0, d, 0, 4096) for s, d in zip(src_ids, dst_ids))


def test_plan_pull_and_push_partition_the_request():
    spec = ModelSpec.uniform(2, 8, 32)
    p_layout, d_layout = EngineLayout(tp_size=16, num_blocks=8), EngineLayout(tp_size=2, num_blocks=8)
    req = Request.single_group([3, 1], [0, 5], 20)
    full = plan_request(spec, p_layout, d_layout, req)
    key = lambda p: sorted(zip(p.dst_rank.tolist(), p.src_rank.tolist(), p.src_offset.tolist(),  # noqa: E731
                               p.dst_offset.tolist(), p.length.tolist()))
    pulls = []
    for d in range(2):
        t = TransferTopology("D", spec, d_layout, d)
        t.register_remote_engine("P", p_layout)
        pulls += key(t.plan_pull("P", req))
    assert sorted(pulls) == key(full)
    pushes = []
    for p in range(16):
        t = TransferTopology("P", spec, p_layout, p)
        t.register_remote_engine("D", d_layout)
        plan = t.plan_push("D", req)
        assert np.all(plan.src_rank == p)
        pushes += key(plan)
    assert sorted(pushes) == key(full)


# --------------------------------------------------------------------------------------------
# Pipeline and context parallel (shared/reference/topology.md §2.11, §4.O)
# --------------------------------------------------------------------------------------------

def test_remote_engine_per_pp_stage_and_what_each_rank_reads():
    """P: TP 2 x PP 2 with vLLM's split "3,1"; D: TP 1. D reads layers 0-2 from the first stage's
    two TP ranks and layer 3 from the second stage's."""
    spec = ModelSpec.uniform(4, 4, 8)
    d = TransferTopology("D", spec, EngineLayout(tp_size=1, num_blocks=8))
    d.register_remote_engine("P", EngineLayout(tp_size=2, pp_size=2, layer_split=(3, 1), num_blocks=8))
    assert d.remote_stages("P") == (StageInfo("P", 0, 0, 3, (0, 1)), StageInfo("P", 1, 3, 4, (2, 3)))
    assert d.get_stage("P", 1).start_layer == 3
    reads = {r.rank: (r.tp_rank, r.pp_rank, r.layers) for r in d.read_sources("P")}
    assert reads == {0: (0, 0, (0, 1, 2)), 1: (1, 0, (0, 1, 2)), 2: (0, 1, (3,)), 3: (1, 1, (3,))}
    assert d.handshake_target_ranks("P") == (0, 1, 2, 3)
    req = Request.single_group([1, 2], [3, 4], 20)
    plan = d.plan_pull("P", req)
    assert set(plan.src_rank.tolist()) == {0, 1, 2, 3} and set(plan.dst_rank.tolist()) == {0}
    assert "reads rank 2 (tp 0, pp 1, cp 0) layers 3" in d.describe()


def test_decode_pp_rank_reads_only_its_layers_and_push_targets_follow():
    spec = ModelSpec.uniform(4, 4, 8)
    p_layout, d_layout = EngineLayout(tp_size=1, num_blocks=8), EngineLayout(tp_size=2, pp_size=2, num_blocks=8)
    d = TransferTopology("D", spec, d_layout, 3)  # tp 1, pp 1: layers 2, 3
    d.register_remote_engine("P", p_layout)
    assert (d.tp_rank, d.pp_rank, d.layers) == (1, 1, (2, 4))
    assert [(r.rank, r.layers) for r in d.read_sources("P")] == [(0, (2, 3))]
    p = TransferTopology("P", spec, p_layout, 0)
    p.register_remote_engine("D", d_layout)
    assert p.reader_ranks("D") == (0, 1, 2, 3)
    req = Request.single_group([1, 2], [3, 4], 20)
    push = p.plan_push("D", req)
    full = plan_request(spec, p_layout, d_layout, req)
    assert push.nbytes == full.nbytes and set(push.dst_rank.tolist()) == {0, 1, 2, 3}
    assert d.plan_pull("P", req).nbytes == int(full.length[full.dst_rank == 3].sum())


@pytest.mark.parametrize(("local", "remote", "expected"), [
    ((4, 1), (4, 4), [[0, 1, 2, 3]] * 4),
    ((4, 4), (4, 4), [[0], [1], [2], [3]]),
    ((8, 8), (4, 4), [[r % 4] for r in range(8)]),
    ((2, 1), (8, 8), [list(range(8))] * 2),
])
def test_dcp_read_sets_are_vllms(local, remote, expected):
    """§4.O: MLA with DCP on either side; local = decode reading the remote prefill."""
    spec = ModelSpec.uniform(2, 1, 16, kinds=("mla",))
    for r, want in enumerate(expected):
        t = TransferTopology("D", spec, EngineLayout(tp_size=local[0], dcp_size=local[1], num_blocks=8), r)
        t.register_remote_engine("P", EngineLayout(tp_size=remote[0], dcp_size=remote[1], num_blocks=8))
        assert list(t.source_ranks("P")) == want, r
        assert set(want) <= set(t.handshake_target_ranks("P"))


def test_gqa_dcp_reads_the_replica_holding_the_tokens():
    """K = 2, P: TP 4 with DCP 2 (ranks 0, 1 hold head 0, split by tokens); D: TP 1 reads all four."""
    spec = ModelSpec.uniform(1, 2, 8)
    t = TransferTopology("D", spec, EngineLayout(tp_size=1, num_blocks=8))
    t.register_remote_engine("P", EngineLayout(tp_size=4, dcp_size=2, num_blocks=8))
    assert t.source_ranks("P") == (0, 1, 2, 3)
    t2 = TransferTopology("D", spec, EngineLayout(tp_size=4, dcp_size=2, num_blocks=8), 3)
    t2.register_remote_engine("P", EngineLayout(tp_size=1, num_blocks=8))
    assert t2.source_ranks("P") == (0,)


def test_pp_stage_rank_outside_the_engine_is_refused():
    spec = ModelSpec.uniform(4, 4, 8)
    with pytest.raises(ShardingError, match=r"the engine's 4 ranks \(TP 2 x PCP 1 x PP 2\)"):
        TransferTopology("D", spec, EngineLayout(tp_size=2, pp_size=2), 4)
    t = TransferTopology("D", spec, EngineLayout(tp_size=2))
    with pytest.raises(IncompatibleEngines, match="layer split"):
        t.register_remote_engine("P", EngineLayout(tp_size=2, pp_size=2, layer_split=(1, 2)))


def test_a_peer_in_another_kv_dtype_is_refused_unless_the_executor_converts():
    spec = ModelSpec.uniform(2, 4, 8)
    t = TransferTopology("D", spec, EngineLayout(tp_size=2, kv_dtype="fp8"))
    with pytest.raises(IncompatibleEngines, match="KV dtype or scales differ: local float8_e4m3fn, remote 'P' bfloat16"):
        t.register_remote_engine("P", EngineLayout(tp_size=2))
    assert t.remote_engine_ids == ()
    c = TransferTopology("D", spec, EngineLayout(tp_size=2, kv_dtype="fp8"), converts=True)
    c.register_remote_engine("P", EngineLayout(tp_size=2))
    assert c.plan_pull("P", Request.single_group([0], [1], 8)).needs_conversion

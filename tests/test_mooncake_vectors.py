"""vLLM Mooncake sender-plan vectors (shared/reference/topology.md §4.L, mooncake_plan.md §2.3,
§3, §4.1, §4.3) expressed through kvbridge's planner.

vLLM's `_compute_sender_transfer_plan(P rank, D rank)` returns `(send?, src_off, dst_off, len)`
inside one block of one region. kvbridge plans every (P rank, D rank) pair of a request at once,
so for a pair we take `plan.select((plan.src_rank == p) & (plan.dst_rank == d))`, move one block
on each side, and convert each run to (component, offset inside the source block's component,
offset inside the destination block's component, length).

Mapping of vLLM's inputs:
* `local_len` / `remote_len` are the per-region block bytes of P and D (era A / T1: K and V are
  separate regions in a KV-first layout). kvbridge's HND kv_first layout keeps K for all blocks
  then V in one per-layer region, so a vLLM K region's block is kvbridge's K component block,
  `heads_local * block_size * head_dim * itemsize`. We pick K, block size and head dim so those
  byte counts equal vLLM's, and compare the K component (V is checked to mirror K).
* vLLM's "replicated" producer flag is `MLA or P_tp > K`. With equal local/remote lengths and no
  K given (legacy rows) it is an MLA cache: we use an MLA spec (one latent row per token).
* "not sent" (False) means kvbridge must not read from that P rank for that D rank (GQA dedup /
  first replica): the pair has no run at all.

Rows that do not map cleanly (not tested as such):
* §4.L legacy rule for a *GQA* replicated P wider than D (`r > 1 and prodRepl` without MLA): it is
  the #52516 under-transfer bug; kvbridge follows the GQA-aware rule (tested below).
* "8->1, K hint 4, region has 8 heads": vLLM infers the head count from byte lengths (UNSURE
  formula). kvbridge has no hint, the spec is the truth; we test the byte-implied geometry (K=8).
* Region-length validation rows (`_validate_asymmetric_region_lengths`, §4.1(c)) validate
  registered byte lengths; kvbridge derives lengths from the spec and validates geometry at
  registration (tests/test_topology.py), so there is no byte-length input to feed.
* Era B (LBHNC, K|V packed per head, mooncake_plan.md §3.3/§3.4): kvbridge keeps K and V as
  separate components, never packed per head. The head-slab pattern of §3.4 is tested with
  kvbridge's per-component head bytes instead of the packed 8192-B slab.
* The C2 "don't send" tuples carry leftover offsets/lengths; only `send? == False` is meaningful.
"""

from __future__ import annotations

import pytest

from kvbridge import EngineLayout, LayerSpec, ModelSpec
from kvbridge.core.plan import Request, plan_request

SRC_BLOCK, DST_BLOCK = 1, 2  # one block each side, not the last block (no K/V merge at the seam)
NUM_BLOCKS = 4


def gqa(heads: int, head_dim: int, dtype: str = "bfloat16") -> ModelSpec:
    return ModelSpec((LayerSpec("full", heads, head_dim, head_dim),), dtype, "gqa")


def mla(latent: int, dtype: str = "bfloat16") -> ModelSpec:
    return ModelSpec((LayerSpec("mla", 1, latent),), dtype, "mla")


def layout(tp: int, block: int, placement: str = "kv_first") -> EngineLayout:
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=NUM_BLOCKS, kv_order="HND", kv_placement=placement)


def _component_of(addr, lay: EngineLayout, offset: int) -> tuple[int, int, int]:
    """(component, kernel block, offset inside that block's component part) of a layer-0 byte."""
    for ci in range(int(addr.num_components[0])):
        rel = offset - int(addr.base[0, ci])
        if rel < 0:
            continue
        blk, within = divmod(rel, int(addr.block_stride[0, ci]))
        comp_bytes = int(addr.heads[0, ci]) * lay.kernel_size * int(addr.row_bytes[0, ci])
        if blk < lay.num_kernel_blocks and within < comp_bytes:
            return ci, blk, within
    raise AssertionError(f"offset {offset} is in no component")


def pair_plan(spec: ModelSpec, p_layout: EngineLayout, d_layout: EngineLayout, p: int, d: int,
              src_block: int = SRC_BLOCK, dst_block: int = DST_BLOCK) -> dict[int, list[tuple[int, int, int]]]:
    """Runs of P rank p -> D rank d for one full block: {component: [(src_off, dst_off, len)]}."""
    assert p_layout.block_size == d_layout.block_size
    req = Request.single_group([src_block], [dst_block], p_layout.block_size)
    plan = plan_request(spec, p_layout, d_layout, req)
    pair = plan.select((plan.src_rank == p) & (plan.dst_rank == d))
    sa, da = p_layout.addressing(spec, p), d_layout.addressing(spec, d)
    out: dict[int, list[tuple[int, int, int]]] = {}
    for so, do, ln in zip(pair.src_offset.tolist(), pair.dst_offset.tolist(), pair.length.tolist()):
        sc, sb, sw = _component_of(sa, p_layout, so)
        dc, db, dw = _component_of(da, d_layout, do)
        assert sc == dc and sb == src_block and db == dst_block
        # A run must stay inside one component block on both sides.
        assert sw + ln <= int(sa.heads[0, sc]) * p_layout.kernel_size * int(sa.row_bytes[0, sc])
        assert dw + ln <= int(da.heads[0, dc]) * d_layout.kernel_size * int(da.row_bytes[0, dc])
        out.setdefault(sc, []).append((sw, dw, ln))
    return {c: sorted(v) for c, v in out.items()}


def check(spec, p_layout, d_layout, p, d, expected):
    """`expected` is vLLM's (send, src_off, dst_off, len) for the K region (or the MLA latent)."""
    runs = pair_plan(spec, p_layout, d_layout, p, d)
    send, src_off, dst_off, length = expected
    if not send:
        assert runs == {}, f"P{p}->D{d} must not be read, got {runs}"
        return
    assert runs.get(0) == [(src_off, dst_off, length)], runs
    if spec.layers[0].kind != "mla":  # V mirrors K (same head dim)
        assert runs.get(1) == [(src_off, dst_off, length)], runs
    else:
        assert set(runs) == {0}


def k_block_bytes(spec: ModelSpec, lay: EngineLayout, rank: int = 0) -> int:
    a = lay.addressing(spec, rank)
    return int(a.heads[0, 0]) * lay.kernel_size * int(a.row_bytes[0, 0])


def check_lengths(spec, p_layout, d_layout, local_len, remote_len):
    assert k_block_bytes(spec, p_layout) == local_len
    assert k_block_bytes(spec, d_layout) == remote_len


# --------------------------------------------------------------------------------------------
# Legacy rule rows (§4.L first table)
# --------------------------------------------------------------------------------------------

def test_legacy_p8_rank2_to_d1_replicated_not_sent():
    spec = mla(128)  # 16 * 128 * 2 = 4096 B per block
    P, D = layout(8, 16), layout(1, 16)
    check_lengths(spec, P, D, 4096, 4096)
    check(spec, P, D, 2, 0, (False, 0, 0, 4096))
    check(spec, P, D, 0, 0, (True, 0, 0, 4096))  # the one rank read: floor(0*8/1)
    for p in range(1, 8):
        check(spec, P, D, p, 0, (False, 0, 0, 0))


@pytest.mark.parametrize("d", range(8))
def test_legacy_p1_to_d8_replicated_all_sent(d):
    spec = mla(128)
    P, D = layout(1, 16), layout(8, 16)
    check_lengths(spec, P, D, 4096, 4096)
    check(spec, P, D, 0, d, (True, 0, 0, 4096))


@pytest.mark.parametrize(("p", "d", "send"), [(0, 0, True), (1, 0, False), (2, 1, True), (3, 1, False)])
@pytest.mark.parametrize("cache", ["mla", "mqa"])
def test_legacy_p4_to_d2_replicated(p, d, send, cache):
    # MLA, or K=1 (GQA-aware row "4->2, K=1" below), both replicated on P.
    spec = mla(128) if cache == "mla" else gqa(1, 128)
    P, D = layout(4, 16), layout(2, 16)
    check_lengths(spec, P, D, 4096, 4096)
    check(spec, P, D, p, d, (send, 0, 0, 4096))


def test_legacy_p2_to_d1_sharded_gather():
    # (2,0) -> (1,0): local 4096, remote 8192, not replicated: (True, 0, 0, 4096). K=2, 4096 B/head.
    spec = gqa(2, 128)
    P, D = layout(2, 16), layout(1, 16)
    check_lengths(spec, P, D, 4096, 8192)
    check(spec, P, D, 0, 0, (True, 0, 0, 4096))
    check(spec, P, D, 1, 0, (True, 0, 4096, 4096))  # row 4 of §2.3: dst_off = (p mod r)*Lkv


@pytest.mark.parametrize("d", [0, 1])
def test_legacy_p2_to_d4_sharded_scatter(d):
    # (2,0) -> (4,d): local 4096, remote 2048, not replicated: (True, (d%2)*2048, 0, 2048). K=4.
    spec = gqa(4, 64)
    P, D = layout(2, 16), layout(4, 16)
    check_lengths(spec, P, D, 4096, 2048)
    check(spec, P, D, 0, d, (True, (d % 2) * 2048, 0, 2048))
    check(spec, P, D, 1, d + 2, (True, (d % 2) * 2048, 0, 2048))
    check(spec, P, D, 1, d, (False, 0, 0, 0))  # not a paired rank


# --------------------------------------------------------------------------------------------
# GQA-aware rule rows (§4.L second table; mooncake_plan.md §4.1)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("r", range(8))
def test_gqa_p8_to_d1_k4_unique_heads(r):
    # 32768 / 131072, replicated P: r even (True, 0, (r/2)*32768, 32768); odd not sent.
    spec = gqa(4, 128)  # block 128 * 128 * 2 = 32768 B per head
    P, D = layout(8, 128), layout(1, 128)
    check_lengths(spec, P, D, 32768, 131072)
    check(spec, P, D, r, 0, (True, 0, (r // 2) * 32768, 32768) if r % 2 == 0 else (False, 0, 0, 0))


@pytest.mark.parametrize("r", range(8))
def test_gqa_p1_to_d8_k4(r):
    # 131072 / 32768, not replicated: (True, (r//2)*32768, 0, 32768)
    spec = gqa(4, 128)
    P, D = layout(1, 128), layout(8, 128)
    check_lengths(spec, P, D, 131072, 32768)
    check(spec, P, D, 0, r, (True, (r // 2) * 32768, 0, 32768))


def test_gqa_p8_to_d1_k4_no_unique_flag():
    # 65536 / 262144: dst offsets [0,-,65536,-,131072,-,196608,-], len 65536 (§4.1(a) Dt=1)
    spec = gqa(4, 128)
    P, D = layout(8, 256), layout(1, 256)
    check_lengths(spec, P, D, 65536, 262144)
    dst = [0, None, 65536, None, 131072, None, 196608, None]
    for r, off in enumerate(dst):
        check(spec, P, D, r, 0, (off is not None, 0, off, 65536))


def test_gqa_p8_to_d2_k4():
    # 65536 / 131072: P r -> D r//4, dst [0,-,65536,-,0,-,65536,-] (§4.1(a) Dt=2)
    spec = gqa(4, 128)
    P, D = layout(8, 256), layout(2, 256)
    check_lengths(spec, P, D, 65536, 131072)
    dst = [0, None, 65536, None, 0, None, 65536, None]
    for r, off in enumerate(dst):
        check(spec, P, D, r, r // 4, (off is not None, 0, off, 65536))
        check(spec, P, D, r, 1 - r // 4, (False, 0, 0, 0))


@pytest.mark.parametrize(("p_tp", "src_offs"), [
    (1, [0, 0, 65536, 65536, 131072, 131072, 196608, 196608]),
    (2, [0, 0, 65536, 65536, 0, 0, 65536, 65536]),
    (4, [0] * 8),
])
def test_gqa_to_replicated_d8_k4(p_tp, src_offs):
    # {1,2,4} -> 8, K=4: local (4/Ptp)*65536, remote 65536, P = r // (8/Ptp) (§4.1(b))
    spec = gqa(4, 128)
    P, D = layout(p_tp, 256), layout(8, 256)
    check_lengths(spec, P, D, (4 // p_tp) * 65536, 65536)
    for r, off in enumerate(src_offs):
        p = r // (8 // p_tp)
        check(spec, P, D, p, r, (True, off, 0, 65536))
        for other in range(p_tp):
            if other != p:
                check(spec, P, D, other, r, (False, 0, 0, 0))


def test_gqa_p4_to_d8_k64_draft_all_pairs():
    # 4->8, K=64: 16*B / 8*B, B = 128*128*2. p == c//2: (True, (c%2)*8B, 0, 8B); else not sent.
    B = 128 * 128 * 2
    spec = gqa(64, 128)
    P, D = layout(4, 128), layout(8, 128)
    check_lengths(spec, P, D, 16 * B, 8 * B)
    req = Request.single_group([SRC_BLOCK], [DST_BLOCK], 128)
    plan = plan_request(spec, P, D, req)
    pairs = set(zip(plan.src_rank.tolist(), plan.dst_rank.tolist()))
    assert pairs == {(c // 2, c) for c in range(8)}
    for p in range(4):
        for c in range(8):
            if p == c // 2:
                check(spec, P, D, p, c, (True, (c % 2) * 8 * B, 0, 8 * B))


@pytest.mark.parametrize("r", range(8))
def test_gqa_p8_to_d1_region_has_8_heads(r):
    # "K hint 4, region has 8 heads": vLLM uses the byte-implied head count (8). kvbridge has no
    # hint; the spec says 8 heads. 32768 / 262144: (True, 0, r*32768, 32768).
    spec = gqa(8, 128)
    P, D = layout(8, 128), layout(1, 128)
    check_lengths(spec, P, D, 32768, 262144)
    check(spec, P, D, r, 0, (True, 0, r * 32768, 32768))


def test_gqa_p8_to_d1_k4_virtual_kv_split():
    # Blocks-first with K/V halves: P4, 16384 / 65536 (K half), replicated: (True, 0, 32768, 16384).
    spec = gqa(4, 128)  # block 64 * 128 * 2 = 16384 B per head
    P, D = layout(8, 64, "blocks_first"), layout(1, 64, "blocks_first")
    check_lengths(spec, P, D, 16384, 65536)
    # the K half sits at the start of the block, V half after it
    assert int(D.addressing(spec, 0).base[0, 1]) == 65536 and int(D.addressing(spec, 0).block_stride[0, 0]) == 131072
    check(spec, P, D, 4, 0, (True, 0, 32768, 16384))
    for r in range(8):
        check(spec, P, D, r, 0, (True, 0, (r // 2) * 16384, 16384) if r % 2 == 0 else (False, 0, 0, 0))


@pytest.mark.parametrize(("p", "d", "send"), [(0, 0, True), (1, 0, False), (2, 1, True), (3, 1, False)])
def test_gqa_p4_to_d2_k1(p, d, send):
    spec = gqa(1, 128)  # 128 * 128 * 2 = 32768
    P, D = layout(4, 128), layout(2, 128)
    check_lengths(spec, P, D, 32768, 32768)
    check(spec, P, D, p, d, (send, 0, 0, 32768))


@pytest.mark.parametrize(("p", "d"), [(0, 0), (0, 1), (1, 2), (1, 3)])
def test_gqa_p2_to_d4_k1(p, d):
    spec = gqa(1, 128)
    P, D = layout(2, 128), layout(4, 128)
    check_lengths(spec, P, D, 32768, 32768)
    check(spec, P, D, p, d, (True, 0, 0, 32768))


@pytest.mark.parametrize("r", range(16))
def test_gqa_p16_to_d8_k8_mimo(r):
    # P r -> D r//2, 32768 / 32768, replicated P: r even (True, 0, 0, 32768), r odd not sent.
    spec = gqa(8, 128)
    P, D = layout(16, 128), layout(8, 128)
    check_lengths(spec, P, D, 32768, 32768)
    check(spec, P, D, r, r // 2, (True, 0, 0, 32768) if r % 2 == 0 else (False, 0, 0, 0))


# --------------------------------------------------------------------------------------------
# Worked examples (mooncake_plan.md §3.1, §3.2, §3.4, §3.5)
# --------------------------------------------------------------------------------------------

def test_worked_example_era_a_blocks_first_p1_d2():
    # 8 heads, head_dim 128, block 16, bf16. P blocks [5,6,7] -> D blocks [40,41,42]. Region offsets
    # are the addresses of mooncake_plan.md §3.1 minus the region bases 0x10000000 / 0x20000000.
    spec = gqa(8, 128)
    P = EngineLayout(tp_size=1, block_size=16, num_blocks=64, kv_placement="blocks_first")
    D = EngineLayout(tp_size=2, block_size=16, num_blocks=64, kv_placement="blocks_first")
    plan = plan_request(spec, P, D, Request.single_group([5, 6, 7], [40, 41, 42], 48))
    table = {
        (0, "K"): ([0x10050000, 0x10060000, 0x10070000], [0x20140000, 0x20148000, 0x20150000]),
        (0, "V"): ([0x10058000, 0x10068000, 0x10078000], [0x20144000, 0x2014C000, 0x20154000]),
        (1, "K"): ([0x10054000, 0x10064000, 0x10074000], [0x20140000, 0x20148000, 0x20150000]),
        (1, "V"): ([0x1005C000, 0x1006C000, 0x1007C000], [0x20144000, 0x2014C000, 0x20154000]),
    }
    for d in range(2):
        pair = plan.select(plan.dst_rank == d)
        want = sorted((s - 0x10000000, t - 0x20000000, 16384)
                      for (dd, _), (srcs, dsts) in table.items() if dd == d for s, t in zip(srcs, dsts))
        got = sorted(zip(pair.src_offset.tolist(), pair.dst_offset.tolist(), pair.length.tolist()))
        assert got == want
        assert set(pair.src_rank.tolist()) == {0}


def test_worked_example_era_a_blocks_first_p2_d1():
    # §3.2: P blocks [5,6,7] -> D [40,41,42]; P rank p region base 0x10000000 + p*0x01000000.
    spec = gqa(8, 128)
    P = EngineLayout(tp_size=2, block_size=16, num_blocks=64, kv_placement="blocks_first")
    D = EngineLayout(tp_size=1, block_size=16, num_blocks=64, kv_placement="blocks_first")
    plan = plan_request(spec, P, D, Request.single_group([5, 6, 7], [40, 41, 42], 48))
    table = {
        0: ([0x10028000, 0x10030000, 0x10038000, 0x1002C000, 0x10034000, 0x1003C000],
            [0x20280000, 0x20290000, 0x202A0000, 0x20288000, 0x20298000, 0x202A8000]),
        1: ([0x11028000, 0x11030000, 0x11038000, 0x1102C000, 0x11034000, 0x1103C000],
            [0x20284000, 0x20294000, 0x202A4000, 0x2028C000, 0x2029C000, 0x202AC000]),
    }
    for p, (srcs, dsts) in table.items():
        pair = plan.select(plan.src_rank == p)
        base = 0x10000000 + p * 0x01000000
        want = sorted((s - base, t - 0x20000000, 16384) for s, t in zip(srcs, dsts))
        got = sorted(zip(pair.src_offset.tolist(), pair.dst_offset.tolist(), pair.length.tolist()))
        assert got == want


def test_worked_example_kv_first_equal_tp_coalesces():
    # §3.2 note / §2.6: KV-first at equal TP coalesces a contiguous run into one copy per component.
    spec = gqa(8, 128)
    P = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    D = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    plan = plan_request(spec, P, D, Request.single_group([5, 6, 7], [40, 41, 42], 48))
    for d in range(2):
        pair = plan.select(plan.dst_rank == d)
        assert sorted(pair.length.tolist()) == [3 * 16384, 3 * 16384]
        assert set(pair.src_rank.tolist()) == {d}


def test_worked_example_replication_boundary_head_slabs():
    # §3.4 with kvbridge's per-component head bytes (4096 per head for K; era B packs K|V = 8192).
    spec = gqa(8, 128)
    per_head = 4096
    # P TP=2 -> D TP=16: src_off per D rank 0,0,1,1,2,2,3,3 head slabs, dst_off 0.
    P, D = layout(2, 16), layout(16, 16)
    for d in range(16):
        check(spec, P, D, d // 8, d, (True, ((d % 8) // 2) * per_head, 0, per_head))
    # P TP=16 -> D TP=2: send Y N Y N ..., dst_off h*per_head.
    P, D = layout(16, 16), layout(2, 16)
    for p in range(16):
        d = p // 8
        check(spec, P, D, p, d, (True, 0, ((p % 8) // 2) * per_head, per_head) if p % 2 == 0 else (False, 0, 0, 0))


@pytest.mark.parametrize(("p_tp", "d_tp", "sends"), [
    (1, 2, {(0, 0): True, (0, 1): True}),
    (2, 1, {(0, 0): True, (1, 0): False}),
    (4, 2, {(0, 0): True, (1, 0): False, (2, 1): True, (3, 1): False}),
])
def test_worked_example_mla(p_tp, d_tp, sends):
    # §3.5: latent 576 * bf16 * 16 tokens = 18432 B per block.
    spec = mla(576)
    P, D = layout(p_tp, 16), layout(d_tp, 16)
    check_lengths(spec, P, D, 18432, 18432)
    for (p, d), send in sends.items():
        check(spec, P, D, p, d, (send, 0, 0, 18432))


# --------------------------------------------------------------------------------------------
# test_kv_producer_heterogeneous_tp (mooncake_plan.md §4.3; topology.md §4.A): absolute offsets
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("d_tp", "d", "dst_ids", "srcs", "dsts", "length"), [
    (1, 0, [20, 21], [0xB000, 0xC000], [0x2A000, 0x2C000], 4096),
    (4, 0, [20, 21], [0xB000, 0xC000], [0xC000, 0xC800], 2048),
    (4, 1, [30, 31], [0xB800, 0xC800], [0x11000, 0x11800], 2048),
])
def test_kv_producer_heterogeneous_tp_whole_block(d_tp, d, dst_ids, srcs, dsts, length):
    # P TP=2 rank 0, P base 0x1000 stride 4096, blocks [10,11]; D base 0x2000 stride 4096*2/Dt.
    # K=4 heads, head_dim 64, block 16, bf16: P holds 2 heads = 4096 B per block (K region).
    spec = gqa(4, 64)
    P = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    D = EngineLayout(tp_size=d_tp, block_size=16, num_blocks=64)
    assert k_block_bytes(spec, P) == 4096 and k_block_bytes(spec, D) == 4096 * 2 // d_tp
    plan = plan_request(spec, P, D, Request.single_group([10, 11], dst_ids, 32), dst_ranks=[d])
    pair = plan.select(plan.src_rank == 0)
    k_end_src, k_end_dst = 64 * 4096, 64 * k_block_bytes(spec, D)
    k = [(s, t, n) for s, t, n in zip(pair.src_offset.tolist(), pair.dst_offset.tolist(), pair.length.tolist())
         if s < k_end_src]
    assert all(t < k_end_dst for _, t, _ in k)
    assert sorted(k) == sorted((s - 0x1000, t - 0x2000, length) for s, t in zip(srcs, dsts))


@pytest.mark.parametrize(("d_tp", "d", "dst_ids", "srcs", "dsts", "length"), [
    (1, 0, [20, 21], [0xB000, 0xC000, 0xB800, 0xC800], [0x2A000, 0x2C000, 0x2B000, 0x2D000], 2048),
    (4, 0, [20, 21], [0xB000, 0xC000, 0xB800, 0xC800], [0xC000, 0xC800, 0xC400, 0xCC00], 1024),
    (4, 1, [30, 31], [0xB400, 0xC400, 0xBC00, 0xCC00], [0x11000, 0x11800, 0x11400, 0x11C00], 1024),
])
def test_kv_producer_heterogeneous_tp_blocks_first_split(d_tp, d, dst_ids, srcs, dsts, length):
    # T2 variant: kv = block_len/2 (blocks-first K|V halves). K=4, head_dim 32: P stride 4096.
    spec = gqa(4, 32)
    P = EngineLayout(tp_size=2, block_size=16, num_blocks=64, kv_placement="blocks_first")
    D = EngineLayout(tp_size=d_tp, block_size=16, num_blocks=64, kv_placement="blocks_first")
    assert int(P.addressing(spec, 0).block_stride[0, 0]) == 4096
    assert int(D.addressing(spec, 0).block_stride[0, 0]) == 4096 * 2 // d_tp
    plan = plan_request(spec, P, D, Request.single_group([10, 11], dst_ids, 32), dst_ranks=[d])
    pair = plan.select(plan.src_rank == 0)
    got = sorted(zip(pair.src_offset.tolist(), pair.dst_offset.tolist(), pair.length.tolist()))
    assert got == sorted((s - 0x1000, t - 0x2000, length) for s, t in zip(srcs, dsts))

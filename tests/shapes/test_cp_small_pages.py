"""Context-parallel pages smaller than the CP interleave (vLLM's compact-local slot mapping).

vLLM's later context-parallel code (DeepSeek-V4's PCP metadata: a 256-token interleave with
64-, 8- and 4-token pages) places a token on CP rank `(p // I) % C` at the rank's *local*
position `(p // (I*C)) * I + p % I`, in block-table entry `local // B` at offset `local % B`.
When B is a multiple of I this is the old virtual-block mapping (one id per `B*C` tokens); when
B < I it is not, and a rank's pages hold `B` of its own consecutive tokens. The vectors below are
vLLM's own (`build_pcp_full_slot_mapping` in vLLM's DeepSeek-V4 PCP tests), read through
`EngineLayout.kernel_slots` / `token_owner`; then pairings and byte-exactness over such engines.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import EngineLayout, LayerSpec, ModelSpec
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.shard import cp_slots
from kvbridge.errors import InvalidRequest
from kvbridge.proofs.verify import check_case

PAD = -1


def vllm_slots(layout: EngineLayout, cp_rank: int, block_table: list[int], positions: list[int]) -> list[int]:
    """vLLM's slot mapping of one CP rank: `block * B + offset`, PAD for another rank's tokens."""
    pos = np.asarray(positions, dtype=np.int64)
    kb, off = layout.kernel_slots(np.asarray(block_table), pos)
    mine = layout.token_owner(pos) == cp_rank
    return np.where(mine, kb * layout.block_size + off, PAD).tolist()


def test_vllm_vector_pages_of_64_under_interleave_256():
    """vLLM: 'Production V4 uses a 256-token CP interleave while SWA stores 64-token pages. Rank 0
    owns [0, 256) and [512, 768), compacted into local space.'"""
    lay = EngineLayout(block_size=64, tp_size=2, dcp_size=2, cp_interleave=256, num_blocks=8)
    got = vllm_slots(lay, 0, [1, 2, 3, 4, 5], [0, 63, 64, 255, 256, 319, 511, 512])
    assert got == [64, 127, 128, 319, PAD, PAD, PAD, 320]


@pytest.mark.parametrize(("cp_rank", "table", "expected"), [
    (0, [10, 11, 12, 13], [20, 21, 22, 23, PAD, PAD, PAD, PAD, 24, 25, 26, 27, PAD, PAD, PAD, PAD]),
    (1, [20, 21, 22, 23], [PAD, PAD, PAD, PAD, 40, 41, 42, 43, PAD, PAD, PAD, PAD, 44, 45, 46, 47]),
])
def test_vllm_vector_pages_of_2_under_interleave_4(cp_rank, table, expected):
    """vLLM: block size 2, CP 2, interleave 4, positions 0..15 ('obeys interleaved owner')."""
    lay = EngineLayout(block_size=2, pcp_size=2, cp_interleave=4, num_blocks=32)
    assert vllm_slots(lay, cp_rank, table, list(range(16))) == expected


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 4, 8])
@pytest.mark.parametrize("multiple", [1, 2, 3])
def test_compact_local_is_the_virtual_block_mapping_when_blocks_hold_whole_chunks(cp, interleave, multiple):
    """With B a multiple of I nothing changes: one id per B x C tokens, chunks round robin in it."""
    block = interleave * multiple
    p = np.arange(5 * block * cp + 3)
    span = block * cp
    chunk = (p % span) // interleave
    old = (p // span, chunk % cp, (chunk // cp) * interleave + p % interleave)
    for got, want in zip(cp_slots(p, block, cp, interleave), old):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("block", "interleave", "cp"), [(64, 256, 2), (8, 256, 2), (4, 256, 4), (3, 8, 2),
                                                        (16, 24, 3), (5, 1, 2)])
def test_every_rank_fills_its_pages_densely(block, interleave, cp):
    """Each CP rank's tokens fill its pages in order, no slot twice, no gap (vLLM's property that
    the virtual-block form loses when pages are smaller than the interleave)."""
    p = np.arange(interleave * cp * 5 + 7)
    vb, rank, off = cp_slots(p, block, cp, interleave)
    assert off.min() >= 0 and off.max() < block
    for r in range(cp):
        local = vb[rank == r] * block + off[rank == r]
        assert local.tolist() == list(range(len(local)))


@pytest.mark.parametrize(("block", "interleave", "cp", "tokens", "ids"), [
    (64, 256, 2, 300, 4),   # rank 0 holds 256 tokens: 4 pages (not ceil(300 / 128) = 3)
    (64, 256, 2, 513, 5),   # vLLM's vector: rank 0 holds [0, 256) and 512
    (8, 256, 2, 1, 1),
    (4, 256, 4, 1024, 64),
    (64, 16, 2, 300, 3),    # B a multiple of I: ceil(300 / 128)
    (16, 16, 1, 33, 3),
])
def test_block_ids_a_request_needs(block, interleave, cp, tokens, ids):
    lay = EngineLayout(block_size=block, tp_size=cp, dcp_size=cp, cp_interleave=interleave, num_blocks=128)
    assert lay.block_ids_needed(0, tokens) == ids
    p = np.arange(tokens)
    assert int(cp_slots(p, block, cp, interleave)[0].max()) + 1 == ids


def test_short_id_list_is_refused_in_one_line():
    spec = ModelSpec.uniform(1, 1, 8)
    lay = EngineLayout(block_size=64, tp_size=2, dcp_size=2, cp_interleave=256, num_blocks=8)
    with pytest.raises(InvalidRequest, match=r"x CP 2 \(interleave 256\) need 4 block ids, got 3") as err:
        plan_request(spec, EngineLayout(block_size=64, num_blocks=8), lay,
                     Request([tuple(range(5))], [(0, 1, 2)], 300))
    assert "\n" not in str(err.value)


def test_pcp2_pages_pair_one_to_one_with_dcp2_pages():
    """P (PCP 2) and D (DCP 2), both 64-token pages under a 256 interleave: CP rank r's page j on D
    is exactly CP rank r's page j on P: every D rank reads only from the P rank of its own CP
    index, one run per page (MLA, one latent row per token: pages are contiguous)."""
    spec = ModelSpec((LayerSpec("mla", 1, 16),), "bfloat16", "mla")
    P = EngineLayout(block_size=64, pcp_size=2, cp_interleave=256, num_blocks=20, kv_order="NHD")
    D = EngineLayout(block_size=64, tp_size=2, dcp_size=2, cp_interleave=256, num_blocks=20, kv_order="NHD")
    src_ids, dst_ids = tuple(range(10, 17)), tuple(range(3, 10))
    plan = plan_request(spec, P, D, Request([src_ids], [dst_ids], 700))
    page = 64 * 16 * 2  # tokens x latent x bf16
    for d in range(2):
        sel = plan.dst_rank == d
        assert set(plan.src_rank[sel].tolist()) == {d}  # P's flat rank d is PCP rank d (TP 1)
        pairs = sorted(zip((plan.src_offset[sel] // page).tolist(), (plan.dst_offset[sel] // page).tolist(),
                           plan.length[sel].tolist()))
        # rank 0 holds 0-255 and 512-699 (444 tokens: 7 pages, the last 60 tokens), rank 1 256-511 (4 pages)
        count = {0: 444, 1: 256}[d]
        want = [(src_ids[j], dst_ids[j], min(64, count - 64 * j) * page // 64) for j in range(-(-count // 64))]
        merged: list[tuple[int, int, int]] = []
        for s, t, n in pairs:  # consecutive ids merge into one run; split them back per page
            while n > 0:
                merged.append((s, t, min(n, page)))
                s, t, n = s + 1, t + 1, n - min(n, page)
        assert merged == want


@pytest.mark.parametrize(("p_block", "d_block", "p_inter", "d_inter"), [
    (64, 8, 256, 256), (8, 4, 256, 256), (4, 64, 256, 256), (64, 64, 256, 16), (16, 8, 4, 32),
])
def test_small_pages_move_every_byte_exactly(p_block, d_block, p_inter, d_inter):
    """PCP 2 -> DCP 2 (and DCP 4) over pages smaller than the interleave on one or both sides,
    with a prefix hit: every destination byte is its source byte, nothing else changes."""
    spec = ModelSpec.uniform(2, 1, 8)  # one KV head: DCP 4 over TP 4 holds it on every DCP rank
    for dcp in (2, 4):
        n, cached = 600, 130
        src = EngineLayout(block_size=p_block, tp_size=2, pcp_size=2, cp_interleave=p_inter, num_blocks=n // p_block + 9)
        dst = EngineLayout(block_size=d_block, tp_size=4, dcp_size=dcp, cp_interleave=d_inter,
                           num_blocks=n // d_block + 9, kv_order="NHD")
        rng = np.random.default_rng(p_block + d_block + dcp)
        ids = [tuple(rng.permutation(lay.num_blocks)[:lay.block_ids_needed(0, n)].tolist()) for lay in (src, dst)]
        result = check_case(spec, src, dst, Request([ids[0]], [ids[1]], n, cached), seed=dcp)
        assert result.ok, result.mismatches


def _layout(tp: int, block: int, **kw) -> EngineLayout:
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=64, **kw)


PROOF = {  # 100 tokens: every interleave below wraps (a CP rank holds two chunks or more)
    "pcp2-to-dcp4-mla": ("tiny-deepseek-v3", _layout(1, 8, pcp_size=2, cp_interleave=32),
                         _layout(4, 4, dcp_size=4, cp_interleave=16, kv_order="NHD")),
    "pcp2-to-dcp2-mqa": ("tiny-llama-mqa", _layout(2, 8, pcp_size=2, cp_interleave=16),
                         _layout(4, 4, dcp_size=2, cp_interleave=32)),
    "sliding-groups-pp": ("tiny-gemma2", _layout(1, 16, pcp_size=2, cp_interleave=32, group_block_sizes=(16, 8)),
                          _layout(2, 8, pp_size=2, group_block_sizes=(8, 4), cp_interleave=16)),
}


@pytest.mark.oracle
@pytest.mark.parametrize("case", list(PROOF))
def test_transformers_proof_is_bit_exact_with_pages_smaller_than_the_interleave(case):
    """`kvbridge demo`'s local runner: greedy tokens equal transformers' and the rebuilt cache is
    bit-identical, with pages smaller than the CP interleave on both sides (MLA, replicated GQA,
    sliding + full groups with their own block sizes and clipped window lists, PP)."""
    from kvbridge.proofs.local_demo import run_demo
    model, prefill, decode = PROOF[case]
    r = run_demo(model, prompt_len=100, new_tokens=3, seed=3, prefill=prefill, decode=decode)
    assert r.match and r.cache_equal and r.replicas_equal, r.cache_differences
    assert r.ok and r.bytes_moved > 0


@pytest.mark.oracle
def test_kvbridge_demo_and_plan_take_pages_smaller_than_the_interleave():
    """The commands as a user types them (sized by the CLI, not by a test helper): the demo is
    bit-exact and `plan` counts each CP rank's tokens (1000 tokens, interleave 256: rank 0 holds
    0-255 and 512-767)."""
    import json

    from typer.testing import CliRunner

    from kvbridge.cli import app
    runner = CliRunner()
    r = runner.invoke(app, ["demo", "--model", "tiny-deepseek-v3", "--prefill-pcp", "2", "--prefill-block-size", "8",
                            "--prefill-cp-interleave", "32", "--decode-tp", "4", "--decode-dcp", "4",
                            "--decode-block-size", "4", "--decode-cp-interleave", "16", "--prompt-len", "100",
                            "--new-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["match"] is True and out["cache_equal"] is True and out["bytes_moved"] > 0
    r = runner.invoke(app, ["plan", "tiny-deepseek-v3", "--prefill-pcp", "2", "--prefill-block-size", "64",
                            "--prefill-cp-interleave", "256", "--decode-tp", "2", "--decode-dcp", "2",
                            "--decode-block-size", "8", "--decode-cp-interleave", "256", "--tokens", "1000"])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.stdout.splitlines() if "(0,0,0)" in line or "(1,0,1)" in line]
    assert "512" in rows[0] and "488" in rows[1], r.stdout


@pytest.mark.oracle
def test_every_rank_its_own_process_over_shm():
    """PCP 2 (pages of 8, interleave 32) pushes to DCP 2 (pages of 4, interleave 16), every rank its
    own process: tokens equal, cache bit-exact, the connector's block-count check and admission
    take the decode's id lists, each prefill rank releases the request once."""
    from kvbridge.proofs.connector_demo import run_multiprocess_demo
    prefill = EngineLayout(tp_size=1, block_size=8, num_blocks=40, pcp_size=2, cp_interleave=32)
    decode = EngineLayout(tp_size=2, block_size=4, num_blocks=64, dcp_size=2, cp_interleave=16)
    # 110 tokens: CP rank 0 holds 64 (prefill: 8 ids, not ceil(110 / 16) = 7) and 62 (decode: 16 ids, not 14)
    r = run_multiprocess_demo("shm", "tiny-deepseek-v3", prompt_len=110, new_tokens=3, seed=5, prefill=prefill,
                              decode=decode, mode="push", timeout=90)
    assert r.match and r.cache_equal and r.replicas_equal, r.cache_differences
    assert r.requests_ok == 1 and r.released_exactly_once and len(r.releases) == 2
    assert r.bytes_moved > 0 and r.bytes_measured == r.bytes_moved


def _row_spec(rate: int = 4) -> ModelSpec:
    """DeepSeek-V4-like: a window group, a group keeping one row per `rate` tokens, open-window state."""
    from kvbridge.core.spec import Component
    state = LayerSpec("recurrent", state=(Component("compressor_buffer_kv", 1, 16),), recurrent_type="compressed")
    return ModelSpec((LayerSpec("mla", 1, 16, window=24), LayerSpec("mla", 1, 16, tokens_per_row=rate), state),
                     "bfloat16", "dsv4-like")


@pytest.mark.parametrize(("cp_rank", "table", "expected"), [
    (0, [3, 4], [192, 255, PAD, PAD, 256]),
    (1, [7, 8], [PAD, PAD, 448, 511, PAD]),
])
def test_vllm_vector_compressed_rows_live_with_their_last_token(cp_rank, table, expected):
    """vLLM: compress ratio 4, pages of 64 rows, CP 2, interleave 256 ('uses original token owner'):
    the row of tokens p-3..p is written by token p, on p's CP rank, at its local row."""
    spec = _row_spec(4)
    lay = EngineLayout(block_size=256, tp_size=2, dcp_size=2, cp_interleave=256, num_blocks=16)
    rows = lay.row_layout(spec)
    g = spec.layer_group[1]
    tokens = np.array([3, 255, 259, 511, 515])
    q = tokens // 4
    kb, off = rows.kernel_slots(np.asarray(table), q, g)
    mine = rows.token_owner(q, g) == cp_rank
    assert np.where(mine, kb * 64 + off, PAD).tolist() == expected
    assert (rows.token_owner(q, g) == lay.token_owner(tokens)).all()  # the row's CP rank is its tokens'


@pytest.mark.parametrize(("p_block", "d_block", "p_inter", "d_inter"), [(16, 8, 32, 16), (8, 16, 8, 64),
                                                                        (32, 32, 32, 32)])
def test_compressed_rows_under_cp_move_every_byte_exactly(p_block, d_block, p_inter, d_inter):
    """PCP 2 -> DCP 2 with a window group, a row-per-4-tokens group and open-window state, pages
    smaller than the interleave or not, a prefix hit: every destination byte right."""
    spec = _row_spec(4)
    n, cached = 150, 37
    src = EngineLayout(block_size=p_block, tp_size=1, pcp_size=2, cp_interleave=p_inter, num_blocks=40)
    dst = EngineLayout(block_size=d_block, tp_size=2, dcp_size=2, cp_interleave=d_inter, num_blocks=60, kv_order="NHD")
    rng = np.random.default_rng(p_block + d_block)
    ids = []
    for lay in (src, dst):
        perm = rng.permutation(lay.num_blocks).tolist()
        ids.append(tuple(tuple(perm[:lay.block_ids_needed(g, n)]) for g in range(len(spec.groups))))
    result = check_case(spec, src, dst, Request(ids[0], ids[1], n, cached), seed=1, checksum=True)
    assert result.ok, result.mismatches


def test_cp_with_a_row_split_over_two_ranks_is_refused_in_one_line_naming_why():
    """An interleave that is no multiple of the tokens per row would put one row's tokens on two CP
    ranks (vLLM refuses it too: 'divisible by compress_ratio')."""
    from kvbridge.errors import IncompatibleEngines
    spec = _row_spec(4)
    cp = EngineLayout(block_size=64, tp_size=2, dcp_size=2, cp_interleave=6, num_blocks=8)
    with pytest.raises(IncompatibleEngines, match=r"context parallel \(CP 2\) interleave 6 is not a multiple of the 4 tokens per row") as err:
        plan_request(spec, EngineLayout(block_size=64, num_blocks=8), cp,
                     Request.single_group([0], [0], 64, num_groups=len(spec.groups)))
    assert "\n" not in str(err.value)


def test_a_peer_declaring_per_group_interleaves_is_refused_at_the_handshake():
    """Per-group interleaves exist only in a row layout kvbridge derives; a peer's engine has one."""
    from kvbridge.connector.handshake import make_hello
    from kvbridge.connector.messages import HandshakeRefused
    from kvbridge.connector.peer_bounds import check_hello_bounds
    spec = _row_spec(4)
    ok = EngineLayout(block_size=64, tp_size=2, dcp_size=2, cp_interleave=256, num_blocks=8)
    check_hello_bounds(make_hello("p", 0, "prefill", "pull", spec, ok, "shm", "a", b""))
    bad = EngineLayout(block_size=64, tp_size=2, dcp_size=2, cp_interleave=256, num_blocks=8,
                       group_cp_interleaves=(256, 64, 256))
    with pytest.raises(HandshakeRefused, match="per-group CP interleaves"):
        check_hello_bounds(make_hello("p", 0, "prefill", "pull", spec, bad, "shm", "a", b""))


@pytest.mark.oracle
def test_deepseek_v4_proof_is_bit_exact_under_cp_with_pages_smaller_than_the_interleave():
    """DeepSeek-V4 (transformers' tiny config: a window of 8, rows per 4 and per 8 tokens, open-window
    state): PCP 2 with 16-token pages under a 32 interleave -> DCP 2 with 8-token pages under 16
    (rows of 4 and 8 tokens: interleaves of 8 / 4 and 4 / 2 rows); 100 tokens wrap both."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from kvbridge.proofs.local_demo import run_demo
    from kvbridge.proofs.model_sweep import tiny_config
    config = tiny_config("deepseek_v4")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prefill = EngineLayout(tp_size=1, block_size=16, num_blocks=64, pcp_size=2, cp_interleave=32)
    decode = EngineLayout(tp_size=2, block_size=8, num_blocks=128, dcp_size=2, cp_interleave=16, kv_order="NHD")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        r = run_demo(d, prompt_len=100, new_tokens=3, prefill=prefill, decode=decode)
    assert r.ok and r.match and r.cache_equal, r.cache_differences[:3]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_compressed_rows_under_any_cp_shape_move_every_byte_exactly(data):
    """Rows per 4 tokens next to a window and open-window state, PCP x DCP on either side, pages
    of 4-64 tokens under interleaves of 4-64 (smaller, equal or larger), prefix hits: every
    destination byte right and the request checksum agrees."""
    spec = _row_spec(4)
    n = data.draw(st.integers(1, 160))
    cached = data.draw(st.one_of(st.just(0), st.integers(0, n)))

    def side(prefill: bool) -> EngineLayout:
        tp = data.draw(st.sampled_from([1, 2, 4]))
        dcp = data.draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
        pcp = data.draw(st.sampled_from([1, 2])) if prefill else 1
        lay = EngineLayout(tp_size=tp, dcp_size=dcp, pcp_size=pcp, block_size=data.draw(st.sampled_from([4, 8, 16, 64])),
                           cp_interleave=data.draw(st.sampled_from([4, 8, 16, 64])),
                           kv_order=data.draw(st.sampled_from(["NHD", "HND"])), num_blocks=1)
        need = sum(lay.block_ids_needed(g, n) for g in range(len(spec.groups)))
        return msgspec.structs.replace(lay, num_blocks=need + 2)

    src, dst = side(True), side(False)
    ids = []
    for lay in (src, dst):
        perm = data.draw(st.permutations(range(lay.num_blocks)))
        out, at = [], 0
        for g in range(len(spec.groups)):
            k = lay.block_ids_needed(g, n)
            out.append(tuple(perm[at:at + k]))
            at += k
        ids.append(tuple(out))
    result = check_case(spec, src, dst, Request(ids[0], ids[1], n, cached), seed=n, checksum=True)
    assert result.ok, (result.mismatches, src.describe(), dst.describe(), n, cached)

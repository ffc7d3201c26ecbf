"""Context-parallel pages that are no multiple of the interleave, and no divisor of it (issue 30 point 2):
a DCP 2 engine with 128-token pages under a CP interleave of 96.

vLLM's Mooncake connector refuses to pair such a consumer (`_pair_cp_block_ids`): it pairs CP
ranks' *blocks*, and a page of 128 tokens here holds one 96-token run and a third of the next one
of its rank (tokens 0-95 and 192-223 on rank 0), so no block of one side is a block of the other.
vLLM's older virtual-block slot mapping cannot hold it either (its offset
`(v // (C * I)) * I + v % I` inside a virtual block of B x C tokens reaches 159 in a page of 128,
which is why vLLM 0.32's `validate_block_size` asks DCP block sizes to be multiples of the
interleave). kvbridge addresses such an engine by vLLM's compact-local rule (`shard.cp_slots`, the
rule of vLLM's later context-parallel metadata, defined for any page and interleave: CP rank
`(p // I) % C`, local position `(p // (I * C)) * I + p % I`, page `local // B`), and plans per
token, not per block: the mapping is exact, so kvbridge keeps the pairing, and proves it below
against the rule written out by hand, with the byte-pattern verifier and with transformers.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge import EngineLayout, LayerSpec, ModelSpec
from kvbridge.core.plan import Request
from kvbridge.proofs.verify import check_case

B, I, C = 128, 96, 2
DCP2 = EngineLayout(tp_size=2, dcp_size=2, block_size=B, cp_interleave=I, num_blocks=16, kv_order="NHD")


def _by_hand(p: int) -> tuple[int, int, int]:
    """(CP rank, block-table index, offset in the page) of token `p`, the compact-local rule spelled out."""
    rank = (p // I) % C
    local = (p // (I * C)) * I + p % I
    return rank, local // B, local % B


def test_vector_pages_of_128_under_interleave_96():
    table = [7, 3, 11, 5]
    tokens = [0, 95, 96, 191, 192, 223, 224, 287, 288, 383, 384, 415, 416, 700]
    # rank 0 holds 0-95, 192-287, 384-479, ...: its page 0 is tokens 0-95 then 192-223, page 1 from 224;
    # rank 1 holds 96-191, 288-383, 480-575, ...: its page 0 is 96-191 then 288-319
    want = [(0, 0, 0), (0, 0, 95), (1, 0, 0), (1, 0, 95), (0, 0, 96), (0, 0, 127), (0, 1, 0), (0, 1, 63),
            (1, 0, 96), (1, 1, 63), (0, 1, 64), (0, 1, 95), (0, 1, 96), (1, 2, 60)]
    assert [_by_hand(p) for p in tokens] == want
    pos = np.asarray(tokens)
    kb, off = DCP2.kernel_slots(np.asarray(table), pos)
    assert DCP2.token_owner(pos).tolist() == [w[0] for w in want]
    assert kb.tolist() == [table[w[1]] for w in want] and off.tolist() == [w[2] for w in want]


def test_every_token_by_the_rule_and_every_rank_fills_its_pages_densely():
    p = np.arange(2000)
    table = np.arange(100, 100 + DCP2.block_ids_needed(0, len(p)))
    kb, off = DCP2.kernel_slots(table, p)
    rank = DCP2.token_owner(p)
    hand = np.array([_by_hand(int(t)) for t in p])
    np.testing.assert_array_equal(rank, hand[:, 0])
    np.testing.assert_array_equal(kb, table[hand[:, 1]])
    np.testing.assert_array_equal(off, hand[:, 2])
    for r in range(C):
        slots = ((kb[rank == r] - 100) * B + off[rank == r]).tolist()
        assert slots == list(range(len(slots)))  # in order, no slot twice, no gap
    # 2000 tokens, 21 runs: rank 0 holds 11 (1,040 tokens, the last run 80): 9 pages, not ceil(2000 / 256) = 8
    assert DCP2.block_ids_needed(0, 2000) == 9


@pytest.mark.parametrize(("src", "spec"), [
    (EngineLayout(tp_size=1, block_size=16, num_blocks=64), ModelSpec.uniform(2, 1, 8)),
    (EngineLayout(tp_size=2, pcp_size=2, block_size=32, cp_interleave=32, num_blocks=40), ModelSpec.uniform(2, 1, 8)),
    (EngineLayout(tp_size=1, pcp_size=2, block_size=64, cp_interleave=256, num_blocks=20),
     ModelSpec((LayerSpec("mla", 1, 24),), "bfloat16", "mla")),
    (EngineLayout(tp_size=4, dcp_size=2, block_size=128, cp_interleave=96, num_blocks=16), ModelSpec.uniform(2, 2, 8)),
])
@pytest.mark.parametrize(("n", "cached"), [(700, 0), (700, 250), (97, 0), (1000, 999)])
def test_every_byte_moves_exactly_into_pages_of_128_under_96(src, spec, n, cached):
    """The byte-pattern verifier: from no CP, PCP 2 (interleave 32), MLA from PCP 2 (pages of 64
    under 256) and DCP 2 of the same 128/96 shape, with prefix hits ending inside a run and a page:
    every destination byte is its source byte, nothing else changes, the request checksum agrees."""
    dst = DCP2 if spec.layers[0].num_kv_heads != 2 else EngineLayout(
        tp_size=4, dcp_size=2, block_size=B, cp_interleave=I, num_blocks=16, kv_order="NHD")
    rng = np.random.default_rng(n + cached)
    ids = [tuple(rng.permutation(lay.num_blocks)[:lay.block_ids_needed(0, n)].tolist()) for lay in (src, dst)]
    for a, b in ((src, dst), (dst, src)):  # and back: DCP 2 of 128/96 as the source
        req = Request([ids[0] if a is src else ids[1]], [ids[1] if b is dst else ids[0]], n, cached)
        result = check_case(spec, a, b, req, seed=n, checksum=True)
        assert result.ok, result.mismatches


PROOF = {  # 300 tokens: four 96-token runs, rank 0 fills a page and a half (0-95, 192-287), rank 1 one page
    "mla-from-tp1": ("tiny-deepseek-v3", EngineLayout(tp_size=1, block_size=16, num_blocks=32), DCP2),
    "mqa-from-pcp2": ("tiny-llama-mqa", EngineLayout(tp_size=2, block_size=16, pcp_size=2, cp_interleave=32,
                                                     num_blocks=32), DCP2),
    # 4 KV heads over TP 8: each held twice, by the two DCP ranks
    "gqa-tp8-dcp2": ("tiny-llama", EngineLayout(tp_size=2, block_size=16, num_blocks=32),
                     EngineLayout(tp_size=8, dcp_size=2, block_size=B, cp_interleave=I, num_blocks=8)),
}


@pytest.mark.oracle
@pytest.mark.parametrize("case", list(PROOF))
def test_transformers_proof_is_bit_exact_with_pages_of_128_under_interleave_96(case):
    """`kvbridge demo`'s local runner into DCP 2 with 128-token pages under a 96 interleave: the
    rebuilt cache is bit-identical to transformers' and greedy decoding from it equals `generate`."""
    from kvbridge.proofs.local_demo import run_demo
    model, prefill, decode = PROOF[case]
    r = run_demo(model, prompt_len=300, new_tokens=3, seed=7, prefill=prefill, decode=decode)
    assert r.ok and r.match and r.cache_equal and r.replicas_equal, r.cache_differences[:3]
    assert r.bytes_moved > 0


@pytest.mark.oracle
def test_kvbridge_demo_takes_the_pairing_as_a_user_types_it():
    import json

    from typer.testing import CliRunner

    from kvbridge.cli import app
    r = CliRunner().invoke(app, ["demo", "--model", "tiny-deepseek-v3", "--decode-tp", "2", "--decode-dcp", "2",
                                 "--decode-block-size", "128", "--decode-cp-interleave", "96", "--prompt-len", "300",
                                 "--new-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["match"] is True and out["cache_equal"] is True and out["bytes_moved"] > 0

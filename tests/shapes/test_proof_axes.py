"""The transformers proof (`kvbridge demo`'s local runner) over PP, CP, per-group block sizes, clipped
sliding-window lists and KV dtype conversion (issue 12, "Proof").

Bit-exact pairs must give the same greedy tokens and the bit-identical cache; a pair whose KV dtype
differs from the model's is proven element by element (every moved element is torch's conversion
of its source) and is not bit-exact with transformers by nature. Each checker is also shown to
catch the fault it exists for.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import plan_request
from kvbridge.proofs.hf_cache import export_cache, gather_kv, import_cache
from kvbridge.proofs.kv_dtype import conversion_mismatches
from kvbridge.proofs.local_demo import run_demo
from kvbridge.proofs.proof import prefill as run_prefill, make_prompt_ids
from kvbridge.proofs.tiny_models import load_model, spec_for
from kvbridge.proofs.verify import random_bytes, random_request
from kvbridge.transport.cache import RankCache
from kvbridge.transport.local import LocalExecutor

pytestmark = pytest.mark.oracle


def L(tp: int = 1, block: int = 16, **kw) -> EngineLayout:  # noqa: N802
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=64, **kw)


EXACT = {
    "pp-prefill-only": ("tiny-llama", L(1, pp_size=2), L(2, 8, kv_order="NHD")),
    "pp-decode-uneven": ("tiny-gemma2", L(2), L(2, pp_size=2, layer_split=(3, 1))),
    "pp-both-different-stages": ("tiny-qwen3-next", L(1, pp_size=3), L(2, 32, kernel_block_size=16, pp_size=2)),
    "pcp-to-dcp-mla": ("tiny-deepseek-v3", L(2, 8, pp_size=2, pcp_size=2), L(4, dcp_size=4, cp_interleave=4,
                                                                               kv_order="NHD")),
    "pcp-to-dcp-hybrid": ("tiny-qwen3-next", L(1, pcp_size=2), L(4, dcp_size=2)),
    "dcp-gqa-replicated": ("tiny-llama-mqa", L(1), L(4, dcp_size=2, pp_size=2)),
    "group-block-sizes": ("tiny-gemma2", L(1, group_block_sizes=(16, 8)), L(2, 8, pp_size=2,
                                                                          group_block_sizes=(8, 32))),
    "group-block-sizes-hybrid": ("tiny-gpt-oss", L(2, group_block_sizes=(32, 16)), L(1, 8)),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_bit_exact_over_pp_cp_and_groups(case: str) -> None:
    model, prefill, decode = EXACT[case]
    r = run_demo(model, prompt_len=45, new_tokens=3, seed=3, prefill=prefill, decode=decode)
    assert r.match and r.cache_equal and r.replicas_equal, r.cache_differences
    assert r.ok and not r.kv_conversion and r.bytes_moved > 0


@pytest.mark.parametrize("prefill, decode", [
    (L(1), L(2, kv_dtype="float8_e4m3fn")),
    (L(2, kv_dtype="bfloat16"), L(1, 8, kv_dtype="float8_e5m2", kv_order="NHD")),
    (L(1, kv_dtype="float8_e4m3fn", kv_scales=((( 0.5,), (0.25,)),) * 2), L(2, pp_size=2)),
    (L(1), L(2, kv_dtype="float8_e4m3fn", kv_scales=(((0.5, 1.0, 2.0, 4.0), (0.125,)),) * 2)),
])
def test_kv_dtype_conversion_is_proven_element_by_element(prefill: EngineLayout, decode: EngineLayout) -> None:
    r = run_demo("tiny-llama", prompt_len=40, new_tokens=3, seed=1, prefill=prefill, decode=decode)
    assert r.kv_conversion and r.elements_checked == 40 * 2 * 2 * 4 * 16  # tokens x layers x K,V x heads x dim
    assert not r.conversion_mismatches and r.ok
    assert len(r.tokens_disaggregated) == 3  # the decode continued from the dequantized cache


def _moved(model_name: str, prefill: EngineLayout, decode: EngineLayout, n: int = 24, seed: int = 0):
    model, config = load_model(model_name, seed)
    spec = spec_for(config)
    ids = make_prompt_ids(n, config.vocab_size, seed)
    cache, _ = run_prefill(model, ids)
    src = RankCache.allocate_engine(spec, prefill, fill=None)
    dst = RankCache.allocate_engine(spec, decode, fill=None)
    random_bytes(src, 1)
    random_bytes(dst, 2)
    request = random_request(spec, prefill, decode, n, 0, random.Random(seed), clip_windows=True)
    export_cache(cache, spec, src, request.src_block_ids, n)
    LocalExecutor(src, dst).execute(plan_request(spec, prefill, decode, request))
    return model, config, spec, cache, src, dst, request


def test_conversion_check_catches_one_wrong_element() -> None:
    _, _, spec, _, src, dst, request = _moved("tiny-llama", L(1), L(2, pp_size=2, kv_dtype="float8_e4m3fn"))
    assert conversion_mismatches(spec, src, dst, request) == ([], 24 * 2 * 2 * 4 * 16)
    rc = dst[3]  # TP rank 1 of the second stage: layer 1
    ids = np.asarray(request.dst_block_ids[0])
    row = rc.read_tokens(1, 0, ids, np.array([7]), as_int=True)
    rc.write_tokens(1, 0, ids, np.array([7]), row ^ 1)
    bad, _ = conversion_mismatches(spec, src, dst, request)
    assert len(bad) == 2 and all(x.startswith("rank 3 layer 1 k head") for x in bad), bad


def test_import_catches_a_wrong_position_on_one_cp_rank() -> None:
    model, config, spec, cache, src, dst, request = _moved("tiny-deepseek-v3", L(1), L(2, dcp_size=2))
    from kvbridge.proofs.cache_compare import cache_differences
    assert cache_differences(cache, import_cache(dst, request.dst_block_ids, 24, config)) == []
    # position 17 lives on CP rank 1 (blocks of 16 interleaved token by token: odd positions)
    rc = dst[1]
    assert rc.layout.token_owner(np.array([17]))[0] == 1
    ids = np.asarray(request.dst_block_ids[0])
    row = rc.read_tokens(2, 0, ids, np.array([17]))
    rc.write_tokens(2, 0, ids, np.array([17]), -row)
    assert cache_differences(cache, import_cache(dst, request.dst_block_ids, 24, config))


def test_gather_needs_every_position_somewhere() -> None:
    _, config, spec, _, src, dst, request = _moved("tiny-llama", L(1), L(2, pp_size=2))
    gathered = gather_kv(src, request.src_block_ids, 24)
    assert all(kv is not None and kv[0].shape == (4, 24, 16) for kv in gathered)
    with pytest.raises(Exception, match="rank caches in rank order"):
        gather_kv(dst[:2], request.dst_block_ids, 24)  # the second stage is missing


def test_the_demo_clips_sliding_window_lists_as_vllm_sends_them() -> None:
    """The local demo's request (seed 3, 45 tokens, window 8 in tiny-gemma2) drops leading blocks of
    the sliding group on at least one side, and the demo still proves bit-exact."""
    model, config = load_model("tiny-gemma2", 3)
    spec = spec_for(config)
    sliding = next(g for g in range(len(spec.groups)) if spec.group_layer(g).window)
    seen = False
    for seed in range(4):
        req = random_request(spec, L(1), L(2, 8), 45, 0, random.Random(seed), clip_windows=True)
        clipped = (len(req.src_block_ids[sliding]) < 3 or len(req.dst_block_ids[sliding]) < 6)
        if clipped:
            seen = True
            r = run_demo("tiny-gemma2", prompt_len=45, new_tokens=2, seed=seed, prefill=L(1), decode=L(2, 8))
            assert r.match and r.cache_equal, r.cache_differences
            break
    assert seen

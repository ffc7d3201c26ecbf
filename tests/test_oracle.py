"""End-to-end oracle: a real transformers model decodes from a KV cache that kvbridge moved.

Each case prefills on one engine layout, moves the paged cache with the planner and the local
executor to another layout, rebuilds a `DynamicCache` and continues greedy decoding. The tokens
must equal plain `generate` and the rebuilt cache must be bit-identical to the prefill cache.
The last tests prove the oracle can fail: a flipped byte on the decode side is caught.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.proofs.cache_compare import cache_differences
from kvbridge.proofs.hf_cache import export_cache, import_cache, replica_mismatches
from kvbridge.proofs.local_demo import run_demo
from kvbridge.proofs.proof import make_prompt_ids
from kvbridge.proofs.tiny_models import BUILTIN_MODELS, load_model, spec_for
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import plan_request
from kvbridge.transport.local import LocalExecutor
from kvbridge.proofs.verify import random_bytes, random_request

pytestmark = pytest.mark.oracle

MAX_PROMPT = 48


def L(tp: int = 1, block: int = 16, **kw) -> EngineLayout:  # noqa: N802 - reads like a table
    """A layout with room for twice the longest prompt, so block ids scatter."""
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=2 * math.ceil(MAX_PROMPT / block) + 1, **kw)


CASES = {
    # TP shapes
    "llama-P4>D2": ("tiny-llama", 28, L(4), L(2)),
    "llama-P1<D2": ("tiny-llama", 24, L(1), L(2)),
    "llama-P2<D4": ("tiny-llama", 33, L(2), L(4)),
    "6kv-P3-D2-nondivisible": ("tiny-llama-6kv", 30, L(3), L(2)),
    "6kv-P2-D3-nondivisible": ("tiny-llama-6kv", 30, L(2), L(3)),
    "llama-D8-replicates": ("tiny-llama", 21, L(1), L(8)),
    "mqa-P1-D2-replicates": ("tiny-llama-mqa", 26, L(1), L(2)),
    "mqa-P4-D1-replicated-source": ("tiny-llama-mqa", 26, L(4), L(1)),
    "mqa-P2-D4": ("tiny-llama-mqa", 35, L(2), L(4)),
    # block sizes and kernel blocks
    "block-P64>D16": ("tiny-llama", 40, L(2, 64), L(1, 16)),
    "block-P16<D48": ("tiny-llama", 40, L(1, 16), L(2, 48)),
    "kernel-P32k16-D16": ("tiny-llama", 37, L(2, 32, kernel_block_size=16), L(4, 16)),
    "kernel-D48k16-P8": ("tiny-llama", 37, L(1, 8), L(2, 48, kernel_block_size=16)),
    # memory layouts
    "NHD>HND": ("tiny-llama", 29, L(2, kv_order="NHD"), L(1, kv_order="HND")),
    "HND>NHD": ("tiny-llama", 29, L(1, kv_order="HND"), L(2, kv_order="NHD")),
    "blocks_first-P": ("tiny-llama", 27, L(2, kv_placement="blocks_first"), L(4)),
    "cross_layer-D": ("tiny-llama", 27, L(4), L(2, 32, kv_placement="blocks_first", layer_placement="cross_layer")),
    # model families and sliding windows
    "mistral-sliding-beyond-window": ("tiny-mistral", 30, L(2, 4), L(1, 8, kv_order="NHD")),
    "mistral-prompt-within-window": ("tiny-mistral", 6, L(1, 4), L(4, 16)),
    "gemma2-alternating": ("tiny-gemma2", 31, L(2, 8, kv_order="NHD"), L(4, 16, kernel_block_size=8)),
    "qwen2-full-then-sliding": ("tiny-qwen2", 25, L(1, 16), L(2, 8, kv_placement="blocks_first")),
    "qwen3": ("tiny-qwen3", 24, L(4, 16), L(1, 32, kv_order="NHD")),
    "gpt-oss-alternating": ("tiny-gpt-oss", 22, L(2, 16, kv_placement="blocks_first", layer_placement="cross_layer"),
                            L(1, 4)),
    # MLA: the latent and rope rows are whole on every rank; one reader per destination rank
    "mla-P4>D2": ("tiny-deepseek-v3", 26, L(4), L(2, 8, kv_order="NHD")),
    "mla-P2-D3-nondivisible": ("tiny-deepseek-v3", 26, L(2, 32, kernel_block_size=16), L(3, 16)),
    "mla-P1<D4": ("tiny-deepseek-v3", 19, L(1, 4, kv_placement="blocks_first"), L(4, 16)),
    "everything-at-once": ("tiny-llama-6kv", 38, L(3, 48, kernel_block_size=16, kv_placement="blocks_first",
                                                   layer_placement="cross_layer"),
                           L(2, 8, kv_order="NHD", kernel_block_size=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_disaggregated_decode_matches_generate(case: str) -> None:
    model, prompt_len, prefill, decode = CASES[case]
    r = run_demo(model, prompt_len, new_tokens=5, seed=len(case), prefill=prefill, decode=decode)
    assert r.cache_equal, r.cache_differences
    assert r.replicas_equal, r.cache_differences
    assert r.match, (r.tokens_reference, r.tokens_disaggregated)
    assert r.num_runs > 0 and r.bytes_moved > 0
    assert len(r.tokens_disaggregated) == 5


@pytest.mark.parametrize("model, n, cached, prefill, decode", [
    ("tiny-llama", 40, 32, L(2, 32, kernel_block_size=16), L(1, 16, kv_order="NHD")),
    ("tiny-gemma2", 45, 24, L(1, 16), L(4, 8, kernel_block_size=4)),  # the hit covers tokens beyond the window
    ("tiny-mistral", 30, 16, L(2, 4), L(1, 16)),
])
def test_prefix_hit_on_decode(model: str, n: int, cached: int, prefill: EngineLayout, decode: EngineLayout) -> None:
    """The decode engine holds the first `cached` tokens (a prefix-cache hit); only the rest moves."""
    full = run_demo(model, n, 3, 2, prefill, decode)
    hit = run_demo(model, n, 3, 2, prefill, decode, num_cached_tokens=cached)
    assert hit.ok and full.ok, hit.cache_differences
    assert hit.tokens_disaggregated == full.tokens_disaggregated
    spec = spec_for(BUILTIN_MODELS[model]())
    moved = sum(n - max(cached, layer.tokens_kept(n)) for layer in spec.layers)
    total = sum(n - layer.tokens_kept(n) for layer in spec.layers)
    assert hit.bytes_moved * total == full.bytes_moved * moved


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_builtin_layer_kinds_agree_with_transformers_cache(name: str) -> None:
    """kvbridge's reading of the config and transformers' own cache layout must agree per layer."""
    config = BUILTIN_MODELS[name]()
    spec = spec_for(config)
    cache = DynamicCache(config=config)
    assert len(cache.layers) == spec.num_layers
    for i, layer in enumerate(cache.layers):
        assert isinstance(layer, LinearAttentionCacheLayerMixin) == spec.layers[i].is_recurrent, i
        if spec.layers[i].is_recurrent:
            continue
        assert layer.is_sliding == (spec.layers[i].kind == "sliding"), i
        if layer.is_sliding:
            assert layer.sliding_window == spec.layers[i].window
    assert spec.dtype == "float32"


def test_builtin_models_cover_the_geometries() -> None:
    kinds = {name: {layer.kind for layer in spec_for(BUILTIN_MODELS[name]()).layers} for name in BUILTIN_MODELS}
    assert kinds["tiny-mistral"] == {"sliding"}
    assert kinds["tiny-gemma2"] == kinds["tiny-gpt-oss"] == kinds["tiny-qwen2"] == {"sliding", "full"}
    assert kinds["tiny-llama"] == kinds["tiny-qwen3"] == {"full"}
    for name in ("tiny-bamba", "tiny-granite-hybrid", "tiny-qwen3-next", "tiny-lfm2"):
        assert kinds[name] == {"recurrent", "full"}
    assert spec_for(BUILTIN_MODELS["tiny-llama-mqa"]()).total_kv_heads == 1
    assert spec_for(BUILTIN_MODELS["tiny-llama-6kv"]()).total_kv_heads == 6


def test_load_model_is_eval_float32_and_seeded() -> None:
    a, _ = load_model("tiny-llama", 3)
    b, _ = load_model("tiny-llama", 3)
    c, _ = load_model("tiny-llama", 4)
    assert not a.training and next(a.parameters()).dtype == torch.float32
    wa, wb, wc = (m.model.layers[0].self_attn.k_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_dump_has_transformers_layout_and_equals_reference(tmp_path) -> None:
    path = tmp_path / "decode_cache.safetensors"
    n, seed = 27, 5
    r = run_demo("tiny-gemma2", n, 3, seed, L(2, 8), L(4, 16, kv_order="NHD"), dump_decode_cache=path)
    assert r.cache_equal and r.match
    dumped = load_file(str(path))
    model, config = load_model("tiny-gemma2", seed)
    spec = spec_for(config)
    with torch.inference_mode():
        ref = model(torch.tensor([make_prompt_ids(n, config.vocab_size, seed)]), use_cache=True).past_key_values
    assert set(dumped) == {f"layers.{i}.{kv}" for i in range(spec.num_layers) for kv in ("keys", "values")}
    for i, layer in enumerate(spec.layers):
        held = n - layer.tokens_kept(n)
        assert held == (7 if layer.kind == "sliding" else n)
        for kv, dim in (("keys", layer.key_dim), ("values", layer.value_dim)):
            t = dumped[f"layers.{i}.{kv}"]
            assert t.shape == (1, layer.num_kv_heads, held, dim) and t.dtype == torch.float32
            assert torch.equal(t.view(torch.int32), getattr(ref.layers[i], kv).contiguous().view(torch.int32))


def test_local_model_directory(tmp_path) -> None:
    model, _ = load_model("tiny-qwen3", 1)
    model.save_pretrained(tmp_path)
    r = run_demo(str(tmp_path), 20, 3, 1, L(2), L(1))
    ref = run_demo("tiny-qwen3", 20, 3, 1, L(2), L(1))
    assert r.ok and r.tokens_reference == ref.tokens_reference


def test_bad_model_name_is_config_error() -> None:
    with pytest.raises(ConfigError, match="tiny-llama") as e:
        load_model("no-such-model", 0)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        run_demo("meta-llama/Llama-3-8B", 8, 2)


def test_bad_requests_are_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        run_demo("tiny-llama", [1, 2, 999], 2)
    with pytest.raises(InvalidRequest, match="num_blocks >= 3"):
        run_demo("tiny-llama", 40, 2, prefill=EngineLayout(block_size=16, num_blocks=2))
    with pytest.raises(InvalidRequest):
        run_demo("tiny-llama", 0, 2)
    with pytest.raises(InvalidRequest):
        run_demo("tiny-llama", 8, 0)


# --- the oracle can fail -------------------------------------------------------------------


def _pipeline(name: str, n: int, prefill: EngineLayout, decode: EngineLayout, seed: int = 0):
    """The run_demo steps up to the move, returning what a test needs to tamper with."""
    model, config = load_model(name, seed)
    spec = spec_for(config)
    ids = torch.tensor([make_prompt_ids(n, config.vocab_size, seed)])
    with torch.inference_mode():
        ref = model(ids, use_cache=True).past_key_values
    src = RankCache.allocate_engine(spec, prefill, fill=None)
    dst = RankCache.allocate_engine(spec, decode, fill=None)
    random_bytes(src, seed + 1)
    random_bytes(dst, seed + 2)
    request = random_request(spec, prefill, decode, n, 0, random.Random(seed))
    export_cache(ref, spec, src, request.src_block_ids, n)
    LocalExecutor(src, dst).execute(plan_request(spec, prefill, decode, request))
    return config, spec, ref, dst, request


def _flip_byte(cache: RankCache, layer: int, comp: int, block_ids, position: int, head: int) -> None:
    """Flip the top bit of one row's first element, located through the rank's byte addressing."""
    a = cache.addr
    kb, off = cache.layout.kernel_slots(np.asarray(block_ids), np.array([position]))
    byte = int(a.base[layer, comp] + kb[0] * a.block_stride[layer, comp] + off[0] * a.token_stride[layer, comp]
               + (head - a.first_head[layer, comp]) * a.head_stride[layer, comp])
    region = cache.byte_regions()[int(a.region[layer, comp])]
    region[byte + cache.spec.itemsize - 1] ^= 0x80  # sign bit of a little-endian float


def test_clean_pipeline_reimports_bit_exact() -> None:
    n = 26
    config, spec, ref, dst, request = _pipeline("tiny-llama", n, L(2, 16), L(4, 8, kv_order="NHD"))
    assert cache_differences(ref, import_cache(dst, request.dst_block_ids, n, config)) == []


def test_corrupted_decode_cache_is_detected() -> None:
    n = 26
    config, spec, ref, dst, request = _pipeline("tiny-llama", n, L(2, 16), L(4, 8, kv_order="NHD"))
    # Layer 1 values, head 3 lives on decode rank 3 (4 heads over TP 4); token 11.
    _flip_byte(dst[3], 1, 1, request.dst_block_ids[0], 11, 3)
    imported = import_cache(dst, request.dst_block_ids, n, config)
    diffs = cache_differences(ref, imported)
    assert diffs == ["layer 1 values: 1 of 1664 elements differ"]
    bad = imported.layers[1].values[0, 3, 11, 0]
    assert torch.equal(bad, -ref.layers[1].values[0, 3, 11, 0])


def test_corrupted_sliding_window_row_is_detected() -> None:
    n = 30
    config, spec, ref, dst, request = _pipeline("tiny-mistral", n, L(1, 4), L(2, 8))
    first = spec.layers[0].tokens_kept(n)
    _flip_byte(dst[1], 0, 0, request.dst_block_ids[0], first, 2)  # the oldest token the window keeps
    diffs = cache_differences(ref, import_cache(dst, request.dst_block_ids, n, config))
    assert diffs == ["layer 0 keys: 1 of 448 elements differ"]


def test_corrupted_replica_is_detected() -> None:
    """import reads each head from its first holder; a bad second replica is caught separately."""
    n = 20
    config, spec, ref, dst, request = _pipeline("tiny-llama-mqa", n, L(1), L(2))
    _flip_byte(dst[1], 0, 0, request.dst_block_ids[0], 5, 0)
    assert cache_differences(ref, import_cache(dst, request.dst_block_ids, n, config)) == []
    assert replica_mismatches(dst, request.dst_block_ids, n) == ["layer 0 comp 0 head 0: rank 1 differs from rank 0"]


def test_export_rejects_a_window_mismatch() -> None:
    import msgspec

    n = 20
    model, config = load_model("tiny-mistral", 0)
    spec = spec_for(config)
    with torch.inference_mode():
        cache = model(torch.tensor([make_prompt_ids(n, config.vocab_size, 0)]), use_cache=True).past_key_values
    wrong = msgspec.structs.replace(spec, layers=tuple(msgspec.structs.replace(x, window=12) for x in spec.layers))
    layout = L(1)
    ids = random_request(spec, layout, layout, n, 0, random.Random(0)).src_block_ids
    with pytest.raises(ConfigError, match="holds 7 of 20 tokens, kvbridge keeps 11"):
        export_cache(cache, wrong, RankCache.allocate_engine(wrong, layout), ids, n)
    with pytest.raises(InvalidRequest, match="has seen 20 tokens, the request says 21"):
        export_cache(cache, spec, RankCache.allocate_engine(spec, layout), ids, 21)


def test_prompt_keywords_used_by_the_cli() -> None:
    by_len = run_demo("tiny-llama", prompt_len=12, new_tokens=2, seed=2)
    by_pos = run_demo("tiny-llama", 12, 2, 2)
    ids = make_prompt_ids(12, 256, 2)
    by_ids = run_demo("tiny-llama", prompt_ids=ids, prompt_len=99, new_tokens=2, seed=2)
    assert by_len.ok and by_len.tokens_reference == by_pos.tokens_reference == by_ids.tokens_reference
    assert by_ids.prompt_len == 12 and by_ids.to_dict()["match"] is True
    with pytest.raises(InvalidRequest, match="not both"):
        run_demo("tiny-llama", ids, 2, prompt_ids=ids)

"""MLA layers with a sliding window (dots3's sliding layers, vLLM's `SlidingWindowMLASpec`): the
rows of MLA (one latent head every TP rank holds whole), the tokens of a sliding layer (its last
`window - 1`), a KV-cache group of their own. The expected token counts here are written out from
the window, not taken from `LayerSpec.tokens_kept`."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import EngineLayout, LayerSpec, ModelSpec
from kvbridge.core.plan import Request, plan_request
from kvbridge.errors import ConfigError, IncompatibleEngines, InvalidRequest
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.verify import check_case


def _spec(window: int, dim: int, dtype: str = "bfloat16") -> ModelSpec:
    """Sliding MLA beside plain MLA (and the sliding MLA again, so that its group has two layers)."""
    return ModelSpec((LayerSpec("mla", 1, dim, window=window), LayerSpec("mla", 1, dim),
                      LayerSpec("mla", 1, dim, window=window)), dtype)


def _in_window(num_tokens: int, cached: int, window: int | None) -> int:
    """Tokens of one layer a request moves: past the cached prefix and, with a window, the last window - 1."""
    first = cached if window is None else max(cached, num_tokens - (window - 1))
    return max(0, num_tokens - first)


@st.composite
def _cases(draw):
    window, dim = draw(st.integers(2, 24)), draw(st.sampled_from([1, 3, 8]))
    spec = _spec(window, dim, draw(st.sampled_from(["bfloat16", "float32"])))
    n = draw(st.integers(0, 48))
    cached = draw(st.one_of(st.just(0), st.integers(0, n)))

    def layout():
        block = draw(st.sampled_from([1, 2, 4, 8, 16]))
        return EngineLayout(tp_size=draw(st.integers(1, 4)), block_size=block, num_blocks=-(-n // block) + 2,
                            kv_order=draw(st.sampled_from(["NHD", "HND"])))

    def ids(lay: EngineLayout):
        out = []
        for g in range(len(spec.groups)):
            full = draw(st.permutations(range(lay.num_blocks)))[:-(-n // lay.block_size)]
            w = spec.group_layer(g).window
            if w is not None and draw(st.booleans()):  # vLLM clips a sliding-window list to the window
                full = full[max(0, n - (w - 1)) // lay.block_size:]
            out.append(tuple(full))
        return tuple(out)

    src, dst = layout(), layout()
    return spec, src, dst, Request(ids(src), ids(dst), n, cached)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases(), st.integers(0, 2**16))
def test_windowed_mla_moves_exactly_its_in_window_rows(case, seed):
    """Every destination rank gets the whole latent row (replicated, any TP pair) of exactly the
    tokens in the window past the cached prefix; no other destination byte changes."""
    spec, src, dst, req = case
    plan = plan_request(spec, src, dst, req)
    row = spec.layers[0].key_dim * spec.itemsize
    want = sum(_in_window(req.num_tokens, req.num_cached_tokens, layer.window) for layer in spec.layers)
    assert plan.nbytes == want * row * dst.tp_size
    result = check_case(spec, src, dst, req, seed=seed)
    assert result.ok, (result.mismatches, spec.describe(), src.describe(), dst.describe(), req)


def test_windowed_mla_is_its_own_group():
    spec = ModelSpec((LayerSpec("mla", 1, 8, window=6), LayerSpec("mla", 1, 8), LayerSpec("sliding", 2, 8, 8, 6),
                      LayerSpec("mla", 1, 8, window=6)))
    assert spec.groups == ((0, 3), (1,), (2,))  # vLLM: SlidingWindowMLASpec, MLAAttentionSpec, SlidingWindowSpec
    assert spec.layers[0].replicated and spec.layers[0].components == LayerSpec("mla", 1, 8).components
    assert "2xmla(w=6)" in spec.describe()


def test_a_clipped_list_must_reach_back_to_the_window():
    spec, lay = _spec(6, 8), EngineLayout(tp_size=1, block_size=2, num_blocks=16)
    n = 20  # the window keeps tokens 15..19: blocks 7..9 of 10
    full = tuple(range(10))
    plan = plan_request(spec, lay, lay, Request((full[7:], full), (full[7:], full), n))  # groups: windowed, plain
    assert plan.nbytes == (5 + 20 + 5) * 8 * spec.itemsize
    with pytest.raises(InvalidRequest, match="at least the last 3"):
        plan_request(spec, lay, lay, Request((full[8:], full), (full, full), n))


def test_window_is_checked_and_names_the_layer_kind():
    with pytest.raises(ConfigError, match="window >= 2, got 1"):
        LayerSpec("mla", 1, 8, window=1)
    with pytest.raises(ConfigError, match="only sliding and MLA layers have a window"):
        LayerSpec("full", 2, 8, 8, 4)
    with pytest.raises(IncompatibleEngines, match="layer 0 window differs"):
        _spec(6, 8).check_compatible(_spec(7, 8))
    assert _spec(6, 8).fingerprint() != ModelSpec((LayerSpec("mla", 1, 8),) * 3).fingerprint()


def test_window_free_layers_keep_their_wire_format_and_fingerprint():
    """Existing layers do not change for a peer: the bytes an older kvbridge sent for a window-free
    MLA layer decode to the same layer, and its spec's fingerprint is the digest of those bytes
    (fields added since, such as conv_states, enter the digest only where set)."""
    import hashlib

    import msgspec
    old = (b'{"kind":"mla","num_kv_heads":1,"key_dim":576,"value_dim":0,"window":null,"state":[],'
           b'"recurrent_type":"","conv_rows":0}')
    assert msgspec.json.decode(old, type=LayerSpec) == LayerSpec("mla", 1, 576)
    spec = ModelSpec((LayerSpec("mla", 1, 576),), "bfloat16")
    assert spec.fingerprint() == hashlib.sha256(b"[[" + old + b'],"bfloat16"]').hexdigest()[:16]


DOTS3 = {"model_type": "dots3_note_text", "num_hidden_layers": 4, "sliding_window": 8, "kv_lora_rank": 32,
         "qk_rope_head_dim": 8, "layer_types": ["indexed_attention", "sliding_attention"] * 2,
         "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("view", ["engine", "transformers"])
def test_dots3_sliding_layers_are_windowed_mla(view):
    spec = spec_from_hf_config(DOTS3, view=view, warn=False)
    sliding = [layer for layer in spec.layers if layer.window is not None]
    assert len(sliding) == 2 and {layer.kind for layer in sliding} == {"mla"}
    assert {layer.window for layer in sliding} == {8}
    # its sliding layers keep their own MLA sizes (per-layer config: kv_lora_rank, qk_rope_head_dim)
    from transformers import CONFIG_MAPPING
    per = CONFIG_MAPPING["dots3_note_text"](**{k: v for k, v in DOTS3.items() if k != "model_type"}).per_layer_config[1]
    lora, rope = per.kv_lora_rank, per.qk_rope_head_dim
    dims = (lora + rope, 0) if view == "engine" else (lora, rope)
    assert {(layer.key_dim, layer.value_dim) for layer in sliding} == {dims}

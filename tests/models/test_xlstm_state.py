"""xLSTM: a recurrent model whose state transformers keeps in no `Cache` but in an `xLSTMCache` of
its own, whose `rnn_state` holds per layer the mLSTM matrix memory C, normalizer n and stabilizer
m. kvbridge describes each layer as three components split by head (the mLSTM's projections and
gates are per head), views the object as a `DynamicCache` of recurrent layers and rebuilds the
object for the model."""

from __future__ import annotations

import pytest
import torch
from transformers.models.xlstm.modeling_xlstm import xLSTMCache

from kvbridge.core.layout import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.hf_states import per_component_states, state_components
from kvbridge.proofs.model_sweep import PAIRS, sweep_one, tiny_config, tiny_model
from kvbridge.proofs.own_cache import empty_cache, model_cache, standard_cache
from kvbridge.proofs.proof import continue_greedy, prefill, reference_tokens


def _spec(cfg, dtype="float32"):
    return spec_from_hf_config(cfg, view="transformers", dtype=dtype, warn=False)


def test_layers_are_c_n_m_split_by_head_sized_as_transformers_allocates_them():
    config = tiny_config("xlstm")
    spec = _spec(config.to_dict())
    assert [x.recurrent_type for x in spec.layers] == ["mlstm"] * config.num_hidden_layers
    layer = spec.layers[0]
    assert layer.conv_rows == 0 and per_component_states(layer)
    # what xLSTMCache allocates per layer, batch 1, heads first
    held = xLSTMCache(config, max_batch_size=1, device="meta").rnn_state[0]
    assert [(c.name, c.heads, c.dim) for c in layer.state] == [
        (name, t.shape[1], t[0, 0].numel()) for name, t in zip(("C", "n", "m"), held)]


def test_head_dims_are_the_config_classes_rounded_ones_not_the_raw_factor():
    """`qk_head_dim` is a property (not in `to_dict()`) that rounds hidden * factor up to 64: 96 * 0.5
    = 48 -> 64 over 4 heads = 16, where the raw factor would give 12."""
    cfg = {"model_type": "xlstm", "hidden_size": 96, "num_heads": 4, "num_hidden_layers": 2, "vocab_size": 64}
    spec = _spec(cfg)
    assert [(c.name, c.heads, c.dim) for c in spec.layers[0].state] == [("C", 4, 16 * 32), ("n", 4, 16), ("m", 4, 1)]


def test_state_dtype_is_the_model_dtype():
    """xLSTMCache allocates the state in the embeddings' dtype, whatever `inference_state_dtype` says."""
    spec = _spec(tiny_config("xlstm").to_dict(), dtype="bfloat16")
    assert {spec.component_dtype(c) for c in spec.layers[0].state} == {"bfloat16"}


def test_heads_split_over_tp_and_replicate_beyond_them():
    spec = _spec(tiny_config("xlstm").to_dict())
    heads = spec.layers[0].state[0].heads
    for tp in (1, 2, 3, 6, 12):
        layout = EngineLayout(tp_size=tp, block_size=16, num_blocks=4)
        for rank in range(tp):
            a = layout.addressing(spec, rank)
            per_rank = max(1, heads // tp)
            assert [int(a.heads[0, ci]) for ci in range(3)] == [per_rank] * 3
            assert [int(a.first_head[0, ci]) for ci in range(3)] == [(rank * heads // tp)] * 3
    with pytest.raises(Exception, match="units"):  # 4 ranks and 6 heads: neither divides the other
        EngineLayout(tp_size=4, block_size=16, num_blocks=4).check_model(spec)


@pytest.fixture(scope="module")
def xlstm():
    model = tiny_model("xlstm")
    config = model.config
    return model, _spec(config.to_dict())


def test_state_object_is_viewed_as_recurrent_layers_and_rebuilt(xlstm):
    model, spec = xlstm
    with torch.inference_mode():
        state = model(torch.arange(3, 20)[None], use_cache=True).cache
    std = standard_cache(state, model.config)
    assert len(std.layers) == spec.num_layers
    for li in range(spec.num_layers):
        comps = state_components(std.layers[li], spec, li)
        for c, t, held in zip(spec.layers[li].state, comps, state.rnn_state[li]):
            assert torch.equal(t, held[0].reshape(c.heads, c.dim)), c.name
    back = model_cache(std, model, 17)
    assert type(back) is xLSTMCache and int(back.seqlen_offset) == 17
    for li in range(spec.num_layers):
        assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(back.rnn_state[li], state.rnn_state[li]))
    empty = empty_cache(model.config, spec)
    assert [x.number_of_states for x in empty.layers] == [3] * spec.num_layers


@pytest.mark.parametrize("cached", [30, 18])
def test_decoding_from_the_rebuilt_state_continues_as_generate(xlstm, cached):
    """The whole prompt (continue from the sampled token) or a prefix of it (the rest computed first)."""
    model, _ = xlstm
    ids = list(range(7, 37))
    cache, first = prefill(model, ids[:cached])
    want = reference_tokens(model, ids, 4)
    got = continue_greedy(model, ids, cache, cached, 4, first if cached == len(ids) else None)
    assert got == want


def test_the_rebuilt_state_carries_the_prefix(xlstm):
    """The object handed back is the state the model continues from: its logits are those of the
    whole prompt, and without it they are not (the prefix matters)."""
    model, _ = xlstm
    ids = torch.arange(7, 37)[None]
    cache, _ = prefill(model, ids[0, :18].tolist())
    with torch.inference_mode():
        full = model(ids).logits[0, 18:]
        cont = model(ids[:, 18:], cache=model_cache(cache, model, 18)).logits[0]
        alone = model(ids[:, 18:]).logits[0]
    assert torch.allclose(cont, full, atol=1e-4, rtol=0)
    assert not torch.allclose(alone, full, atol=1e-2, rtol=0)


def test_sweep_row_moves_on_both_pairs():
    """Both standard pairs, TP3 -> TP2 included (6 heads: 2 per rank, then 3), not the fallback."""
    row = sweep_one("xlstm")
    assert row.status == "moved", row.detail
    assert row.pairs == [name for name, _, _ in PAIRS]
    assert row.kinds == f"{tiny_config('xlstm').num_hidden_layers}xmlstm"

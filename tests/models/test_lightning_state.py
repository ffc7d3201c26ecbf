"""MiniMax-Text-01's lightning-attention layers (issue 11): no conv state, one `K^T V` state per head,
sharded by head as vLLM's `linear_attention_state_shape`, kept by transformers in a cache class of
the model's own (`MiniMaxCache.linear_cache`) that the proof views as a standard `DynamicCache` and
hands back to the model in its own class."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbridge.core.layout import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.hf_states import hf_state_shapes, hf_state_tensors, state_components
from kvbridge.proofs.model_sweep import tiny_model
from kvbridge.proofs.own_cache import model_cache, own_cache_class, standard_cache
from kvbridge.proofs.proof import prefill

MINIMAX = {"model_type": "minimax", "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 12,
           "num_key_value_heads": 6, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
           "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("view", ["transformers", "engine"])
def test_lightning_state_is_one_square_state_per_head_and_no_conv(view):
    spec = spec_from_hf_config(MINIMAX, view=view, dtype="float32", warn=False)
    rec = spec.layers[0]
    assert rec.recurrent_type == "lightning" and rec.conv_rows == 0
    assert [(c.name, c.heads, c.dim) for c in rec.state] == [("recurrent", 12, 16 * 16)]
    assert spec.layers[1].kind == "full" and spec.layers[1].num_kv_heads == 6
    assert hf_state_shapes(rec) == ((), (1, 12, 16, 16))


def test_lightning_head_dim_defaults_to_hidden_over_heads():
    cfg = {k: v for k, v in MINIMAX.items() if k != "head_dim"}
    rec = spec_from_hf_config(cfg, view="engine", dtype="float32", warn=False).layers[0]
    assert [(c.heads, c.dim) for c in rec.state] == [(12, 8 * 8)]


def test_lightning_heads_split_over_tp_as_vllm_requires():
    # one KV head (replicated on any TP), so that only the 12 lightning heads decide the TP sizes
    spec = spec_from_hf_config(MINIMAX | {"num_key_value_heads": 1}, view="engine", dtype="float32", warn=False)
    for tp in (2, 3, 4, 6, 12):
        EngineLayout(tp_size=tp, block_size=16, num_blocks=4).check_model(spec)
    with pytest.raises(Exception, match="units"):
        EngineLayout(tp_size=5, block_size=16, num_blocks=4).check_model(spec)


@pytest.fixture(scope="module")
def minimax():
    model = tiny_model("minimax")
    config = model.config
    spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype="float32", warn=False)
    return model, spec


def test_prefill_cache_is_viewed_as_the_standard_cache_with_the_same_tensors(minimax):
    model, spec = minimax
    ids = torch.arange(5, 30)[None]
    with torch.inference_mode():
        own = model(ids, use_cache=True).past_key_values
    assert own_cache_class(model) is type(own) is not DynamicCache  # MiniMaxCache
    std = standard_cache(own, model.config)
    assert type(std) is DynamicCache and len(std.layers) == spec.num_layers
    for li, lspec in enumerate(spec.layers):
        if lspec.is_recurrent:
            comps = state_components(std.layers[li], spec, li)
            assert torch.equal(comps[0], own.linear_cache[li][0].reshape(12, 64))
            assert hf_state_tensors(lspec, comps)[0] == []
        else:
            assert torch.equal(std.layers[li].keys, own.layers[li].keys)
    back = model_cache(std, model)
    assert type(back) is type(own)
    for li, lspec in enumerate(spec.layers):
        if lspec.is_recurrent:
            assert torch.equal(back.linear_cache[li], own.linear_cache[li])
        else:
            assert torch.equal(back.layers[li].values, own.layers[li].values)


def test_decoding_from_the_rebuilt_own_cache_continues_as_generate(minimax):
    model, _ = minimax
    ids = list(range(7, 47))
    cache, first = prefill(model, ids)  # standard view
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids):].tolist()
        got = model.generate(torch.tensor([ids + [first]]), max_new_tokens=2, do_sample=False,
                             past_key_values=model_cache(cache, model))[0, len(ids) + 1:].tolist()
    assert [first, *got] == want

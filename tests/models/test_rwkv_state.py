"""RWKV (issue 11): a recurrent model whose state transformers keeps in no `Cache`, as a `state` list
of five tensors `[batch, hidden, layers]`. kvbridge describes each layer's slice as five components
(two token shifts held whole by every TP rank, the WKV numerator / denominator / maximum split by
channel), views the list as a `DynamicCache` of recurrent layers and hands the model a list back."""

from __future__ import annotations

import pytest
import torch

from kvbridge import ConfigError
from kvbridge.core.layout import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.hf_states import per_component_states, state_components
from kvbridge.proofs.model_sweep import sweep_one, tiny_config, tiny_model
from kvbridge.proofs.own_cache import empty_cache, model_cache, standard_cache
from kvbridge.proofs.proof import continue_greedy, prefill, reference_tokens

RWKV = {"model_type": "rwkv", "num_hidden_layers": 3, "hidden_size": 40, "attention_hidden_size": 40,
        "intermediate_size": 80, "vocab_size": 128}


def _spec(cfg):
    return spec_from_hf_config(cfg, view="transformers", dtype="float32", warn=False)


def test_rwkv_layers_are_five_state_components_read_from_the_config():
    spec = _spec(RWKV)
    assert [x.recurrent_type for x in spec.layers] == ["rwkv"] * 3
    layer = spec.layers[0]
    assert layer.conv_rows == 0 and per_component_states(layer)
    assert [(c.name, c.heads, c.dim) for c in layer.state] == [
        ("ffn_x", 1, 40), ("att_x", 1, 40), ("att_num", 40, 1), ("att_den", 40, 1), ("att_max", 40, 1)]
    # the WKV state is float32 whatever the model dtype, as transformers allocates it
    bf16 = spec_from_hf_config(RWKV, view="transformers", dtype="bfloat16", warn=False)
    assert [bf16.component_dtype(c) for c in bf16.layers[0].state] == ["bfloat16"] * 2 + ["float32"] * 3


def test_rwkv_attention_width_other_than_hidden_is_refused():
    with pytest.raises(ConfigError, match="attention_hidden_size 48 != hidden_size 40"):
        _spec(RWKV | {"attention_hidden_size": 48})


def test_rwkv_channels_split_over_tp_and_token_shifts_are_whole_on_every_rank():
    spec = _spec(RWKV)
    for tp in (2, 4, 5, 8):
        layout = EngineLayout(tp_size=tp, block_size=16, num_blocks=4)
        for rank in range(tp):
            a = layout.addressing(spec, rank)
            assert [int(a.heads[0, ci]) for ci in range(5)] == [1, 1] + [40 // tp] * 3
            assert [int(a.first_head[0, ci]) for ci in range(5)] == [0, 0] + [rank * 40 // tp] * 3
    with pytest.raises(Exception, match="units"):
        EngineLayout(tp_size=3, block_size=16, num_blocks=4).check_model(spec)


@pytest.fixture(scope="module")
def rwkv():
    model = tiny_model("rwkv")
    config = model.config
    return model, _spec(config.to_dict())


def test_state_list_is_viewed_as_recurrent_layers_and_stacked_back(rwkv):
    model, spec = rwkv
    with torch.inference_mode():
        state = model(torch.arange(3, 20)[None], use_cache=True).state
    std = standard_cache(state, model.config)
    assert len(std.layers) == spec.num_layers
    for li in range(spec.num_layers):
        comps = state_components(std.layers[li], spec, li)
        for si, (c, t) in enumerate(zip(spec.layers[li].state, comps)):
            assert torch.equal(t.reshape(-1), state[si][0, :, li]), c.name
    back = model_cache(std, model)
    assert len(back) == 5 and all(torch.equal(a, b) for a, b in zip(back, state))
    empty = empty_cache(model.config, spec)
    assert [x.number_of_states for x in empty.layers] == [5] * spec.num_layers


@pytest.mark.parametrize("cached", [30, 18])
def test_decoding_from_the_state_list_continues_as_generate(rwkv, cached):
    """The whole prompt (continue from the sampled token) or a prefix of it (the rest computed first)."""
    model, _ = rwkv
    ids = list(range(7, 37))
    cache, first = prefill(model, ids[:cached])
    want = reference_tokens(model, ids, 4)
    got = continue_greedy(model, ids, cache, cached, 4, first if cached == len(ids) else None)
    assert got == want


def test_sweep_row_moves_on_both_pairs():
    row = sweep_one("rwkv")
    assert row.status == "moved", row.detail
    assert len(row.pairs) == 2 and row.kinds == f"{tiny_config('rwkv').num_hidden_layers}xrwkv"


def test_the_rebuilt_state_list_carries_the_prefix(rwkv):
    """The list handed back is the state the model continues from: its logits are those of the whole
    prompt, and without it they are not (the prefix matters)."""
    model, _ = rwkv
    ids = torch.arange(7, 37)[None]
    cache, _ = prefill(model, ids[0, :18].tolist())
    with torch.inference_mode():
        full = model(ids).logits[0, 18:]
        cont = model(ids[:, 18:], state=model_cache(cache, model)).logits[0]
        alone = model(ids[:, 18:]).logits[0]
    assert torch.allclose(cont, full, atol=1e-5, rtol=0)
    assert not torch.allclose(alone, full, atol=1e-3, rtol=0)

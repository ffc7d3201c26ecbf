"""RecurrentGemma's RG-LRU layers (issue 11): conv over `lru_width` channels and one float32 value per
channel, sharded by the RG-LRU's gate blocks (no vLLM model: derived from its block-diagonal gate
weights). Its forward keeps that state on its modules and returns no cache: the proof reads it into
the layer's cache layer after a prefill and writes it back onto a model's modules to decode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvbridge.core.layout import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.model_sweep import sweep_one, tiny_config
from kvbridge.proofs.proof import continue_greedy, greedy_config, prefill, reference_tokens

RG = {"model_type": "recurrent_gemma", "num_hidden_layers": 3, "hidden_size": 96, "lru_width": 96,
      "num_attention_heads": 12, "num_key_value_heads": 1, "head_dim": 8, "conv1d_width": 4,
      "attention_window_size": 16, "block_types": ["recurrent", "recurrent", "attention"]}


@pytest.mark.parametrize("view", ["transformers", "engine"])
def test_rglru_state_is_sharded_by_gate_block_with_kernel_minus_one_columns(view):
    spec = spec_from_hf_config(RG, view=view, dtype="bfloat16", warn=False)
    rec = spec.layers[0]
    # transformers' module keeps conv1d_width - 1 columns, like the engines: both views say 3
    assert rec.recurrent_type == "rglru" and rec.conv_rows == 3
    assert [(c.name, c.heads, c.dim, c.dtype) for c in rec.state] == [("conv_x", 12, 8 * 3, None),
                                                                     ("recurrent", 12, 8, "float32")]
    assert spec.layers[2].kind == "sliding" and spec.layers[2].window == 16


def test_rglru_units_are_the_blocks_the_module_builds():
    config = tiny_config("recurrent_gemma")
    with torch.device("meta"):
        block = AutoModelForCausalLM.from_config(config).model.layers[0].temporal_block
    rec = spec_from_hf_config(config.to_dict(), view="engine", dtype="float32", warn=False).layers[0]
    heads, width, _ = block.rg_lru.input_gate_weight.shape  # block-diagonal: [blocks, block, block]
    assert (rec.state[1].heads, rec.state[1].dim) == (heads, width)
    assert rec.state[0].heads * rec.state[0].dim // rec.conv_rows == block.conv_1d.weight.shape[0]
    assert rec.conv_rows == block.conv1d_width - 1


def test_rglru_tp_must_split_whole_blocks():
    spec = spec_from_hf_config(RG, view="engine", dtype="float32", warn=False)
    for tp in (2, 3, 4, 6, 12):
        EngineLayout(tp_size=tp, block_size=16, num_blocks=4).check_model(spec)
    with pytest.raises(Exception, match="units"):
        EngineLayout(tp_size=5, block_size=16, num_blocks=4).check_model(spec)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("recurrent_gemma"), dtype=torch.float32)
    model.generation_config = greedy_config()
    return model


PROMPT = [(7 * i + 3) % 256 for i in range(40)]  # longer than the tiny window (8)


def test_prefill_reads_the_module_state_into_the_cache():
    model = _model()
    cache, _ = prefill(model, PROMPT)
    config = model.config
    for i, kind in enumerate(config.layers_block_type):
        layer = cache.layers[i]
        if kind == "linear_attention":
            block = model.model.layers[i].temporal_block
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
            assert conv.shape == (1, config.lru_width, config.conv1d_width - 1)
            assert rec.shape == (1, config.lru_width) and rec.dtype == torch.float32
            assert torch.equal(conv, block.conv1d_state) and torch.equal(rec, block.rg_lru.recurrent_states)
            assert conv.abs().sum() > 0 and rec.abs().sum() > 0
        else:  # the sliding layer's K/V: the window's last tokens
            assert layer.keys.shape[-2] == config.attention_window_size - 1


def test_a_fresh_model_decodes_from_the_written_back_state_as_generate_does():
    prefill_model, decode_model = _model(), _model(seed=1)
    decode_model.load_state_dict(prefill_model.state_dict())
    reference = reference_tokens(prefill_model, PROMPT, 5)
    after_generate = _module_state(prefill_model)  # after the prompt and 4 of the 5 tokens
    cache, first = prefill(prefill_model, PROMPT)
    # the decode model never ran the prompt: all it has is the cache and the first token
    assert continue_greedy(decode_model, PROMPT, cache, len(PROMPT), 5, first) == reference
    # bit for bit where generate left it (tiny random weights can keep greedy tokens without the state)
    held = _module_state(decode_model)
    assert len(held) == 6 and all(torch.equal(a, b) for a, b in zip(held, after_generate))


def _module_state(model) -> list[torch.Tensor]:
    blocks = [layer.temporal_block for layer in model.model.layers if hasattr(layer.temporal_block, "rg_lru")]
    return [t.clone() for b in blocks for t in (b.conv1d_state, b.rg_lru.recurrent_states)]


def test_a_cached_prefix_continues_one_token_at_a_time_as_generate_does():
    """Its multi-token forward is a prefill from position 0's conv inputs, so the rest of the prompt
    after a cached prefix goes in one token at a time (it was refused before)."""
    model = _model()
    cache, _ = prefill(model, PROMPT[:16])
    assert continue_greedy(model, PROMPT, cache, 16, 3) == reference_tokens(model, PROMPT, 3)


def test_sweep_moves_it_on_both_pairs():
    row = sweep_one("recurrent_gemma")
    assert row.status == "moved" and len(row.pairs) == 2 and "sliding(w=8)" in row.kinds

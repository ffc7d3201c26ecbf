"""RWKV and xLSTM (issue 11): recurrent models whose state is in no transformers `Cache` (RWKV's
`state` list, xLSTM's `xLSTMCache`). They are refused with one line naming layer 0, the state and
its per-layer shapes as the model really returns them, not as attention layers missing a head count."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvbridge import ConfigError
from kvbridge.models import spec_from_hf_config
from kvbridge.models.own_state import causal_lm_class, keeps_state_outside_cache
from kvbridge.proofs.model_sweep import sweep_one, tiny_config


def _refusal(arch: str) -> str:
    with pytest.raises(ConfigError) as e:
        spec_from_hf_config(tiny_config(arch).to_dict(), view="transformers", dtype="float32", warn=False)
    return str(e.value)


def test_rwkv_refusal_names_its_state_list_per_layer():
    config = tiny_config("rwkv")
    line = _refusal("rwkv")
    assert line.startswith("layer 0 (rwkv recurrent state") and "\n" not in line
    assert "full_attention" not in line and "num_attention_heads" not in line
    # what the model really returns: five tensors [batch, channels, layers]
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config)(torch.tensor([[1, 2, 3]]), use_cache=True).state
    assert [tuple(t.shape) for t in state] == [(1, config.hidden_size, config.num_hidden_layers)] * 5
    assert "`state`" in line and f"per layer 5 x [{config.hidden_size}] float32" in line


def test_xlstm_refusal_names_its_cache_class_per_layer():
    config = tiny_config("xlstm")
    line = _refusal("xlstm")
    assert line.startswith("layer 0 (xlstm recurrent state") and "full_attention" not in line
    heads, qk, v = config.num_heads, config.qk_head_dim, config.v_head_dim
    assert f"xLSTMCache.rnn_state; per layer [{heads}, {qk}, {v}] float32, [{heads}, {qk}] float32, " \
           f"[{heads}, 1] float32" in line


@pytest.mark.parametrize("arch", ["llama", "minimax", "mamba", "recurrent_gemma"])
def test_models_with_a_cache_are_not_taken_for_stateful_ones(arch):
    assert not keeps_state_outside_cache(causal_lm_class(tiny_config(arch)))


def test_sweep_row_is_refused_with_that_line():
    row = sweep_one("rwkv")
    assert row.status == "refused" and row.detail.startswith("layer 0 (rwkv recurrent state")

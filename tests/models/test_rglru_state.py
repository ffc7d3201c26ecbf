"""RecurrentGemma's RG-LRU layers (issue 11): conv over `lru_width` channels and one float32 value per
channel, sharded by the RG-LRU's gate blocks (no vLLM model: derived from its block-diagonal gate
weights). Its forward keeps that state on its modules and returns no cache, which the proof names."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvbridge import ConfigError
from kvbridge.core.layout import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.model_sweep import tiny_config
from kvbridge.proofs.proof import prefill

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


def test_proof_names_why_a_module_held_state_cannot_be_moved():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("recurrent_gemma"), dtype=torch.float32)
    with pytest.raises(ConfigError, match="recurrent state on its modules"):
        prefill(model, list(range(1, 20)))

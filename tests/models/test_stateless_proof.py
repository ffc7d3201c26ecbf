"""The transformers proof on a tiny random Nemotron-H (Mamba2 + MLP + MoE + attention layers, the MLP
and MoE ones stateless): bit-exact cache and greedy tokens after a move between engines of other
shapes than the sweep's pairs, with a prefix-cache hit on the decode side."""

from __future__ import annotations

import pytest
import torch

from kvbridge import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.local_demo import run_demo
from kvbridge.proofs.model_sweep import tiny_config


@pytest.fixture(scope="module")
def nemotron_h_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = tiny_config("nemotron_h")
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("nemotron_h")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    return d, config


def test_tiny_nemotron_h_has_stateless_layers(nemotron_h_dir):
    _, config = nemotron_h_dir
    spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype="float32", warn=False)
    kinds = {layer.kind for layer in spec.layers}
    assert {"stateless", "recurrent", "full"} <= kinds


@pytest.mark.parametrize("prefill, decode, cached", [
    (EngineLayout(tp_size=2, block_size=16, num_blocks=8, kv_order="HND"),
     EngineLayout(tp_size=3, block_size=8, num_blocks=16, kv_order="NHD", kv_placement="blocks_first"), 16),
    (EngineLayout(tp_size=1, block_size=8, num_blocks=16),
     EngineLayout(tp_size=6, block_size=16, num_blocks=8, kv_order="HND"), 0),
])
def test_nemotron_h_moves_bit_exactly(nemotron_h_dir, prefill, decode, cached):
    d, _ = nemotron_h_dir
    result = run_demo(str(d), prompt_len=37, new_tokens=4, seed=1, prefill=prefill, decode=decode,
                      num_cached_tokens=cached)
    assert result.ok and result.cache_equal and result.match, result.cache_differences[:3]

"""Models whose every layer is recurrent (Mamba, Mamba2): moved and proven like any other.

transformers' Mamba models name their cache `cache_params`; the proof finds it under that name,
imports the decode ranks' state into a cache of linear-attention layers only, and continues
`generate` from it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Mamba2Config, MambaConfig

from kvbridge.core.layout import EngineLayout
from kvbridge.proofs.local_demo import run_demo

pytestmark = pytest.mark.oracle


def _saved(tmp_path, config) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    return str(tmp_path)


CONFIGS = {
    "mamba": MambaConfig(hidden_size=48, num_hidden_layers=3, vocab_size=256, state_size=8, expand=2,
                         bos_token_id=None, eos_token_id=None),
    "mamba2": Mamba2Config(hidden_size=48, num_hidden_layers=3, vocab_size=256, state_size=8, num_heads=12,
                           head_dim=8, n_groups=6, expand=2, bos_token_id=None, eos_token_id=None),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("prefill, decode", [
    (EngineLayout(tp_size=1, num_blocks=16), EngineLayout(tp_size=2, num_blocks=16)),
    (EngineLayout(tp_size=3, num_blocks=16), EngineLayout(tp_size=2, block_size=8, num_blocks=16, kv_order="NHD")),
    (EngineLayout(tp_size=2, pp_size=3, num_blocks=16), EngineLayout(tp_size=1, num_blocks=16)),
])
def test_all_recurrent_models_move_bit_exactly(tmp_path, name, prefill, decode):
    r = run_demo(_saved(tmp_path, CONFIGS[name]), prompt_len=30, new_tokens=4, prefill=prefill, decode=decode)
    assert r.match and r.cache_equal and r.replicas_equal, r.cache_differences
    assert r.bytes_moved > 0

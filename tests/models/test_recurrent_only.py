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


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "falcon_mamba"])
def test_continuation_from_the_cache_is_the_single_token_step_not_a_second_pass_over_the_prompt(arch):
    """transformers' generate does not slice the input by a cache of recurrent layers only (no layer
    knows its length): the proof must give it the tokens after the cached ones. Given the whole
    prompt again, the state ran over the prompt twice; with a state that forgets quickly, tokens
    often still matched (seed 0, 24 tokens of the sweep's tiny Mamba did not). Each step must equal
    a single-token forward from the prefill cache, logit for logit."""
    from kvbridge.proofs.model_sweep import tiny_model
    from kvbridge.proofs.proof import continue_greedy, greedy_config, make_prompt_ids, prefill

    model = tiny_model(arch, 0)
    model.generation_config = greedy_config()
    ids = make_prompt_ids(24, model.config.vocab_size, 0)
    with torch.inference_mode():
        want, (cache, token) = [], prefill(model, ids)
        for _ in range(3):
            want.append(token)
            token = int(model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1].argmax())
        cache, first = prefill(model, ids)
    assert continue_greedy(model, ids, cache, len(ids), 3, first) == want

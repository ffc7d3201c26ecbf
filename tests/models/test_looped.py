"""Looped (recurrent-depth) models (issue 11): Dory runs its middle layers several times and, with
`recurrent_kv_cache_mode="per_loop"`, its forward appends one copy of those layers' cache layers per
extra loop. The spec holds the same copies, so nothing a loop keeps is lost; `"last_loop"` keeps
one cache layer per config layer."""

from __future__ import annotations

import pytest
import torch

from kvbridge import ConfigError, EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.local_demo import run_demo
from kvbridge.proofs.model_sweep import tiny_config


def _dory(**kw):
    config = tiny_config("dory")
    for k, v in kw.items():
        setattr(config, k, v)
    return config


def test_per_loop_spec_appends_the_looped_layers_once_per_extra_loop():
    config = _dory(n_recurrent_loops=3)
    assert (config.n_input_layers, config.n_recurrent_layers, config.num_hidden_layers) == (1, 2, 4)
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    assert spec.num_layers == 4 + 2 * 2
    assert spec.layers[4:] == spec.layers[1:3] * 2


def test_last_loop_spec_is_one_layer_per_config_layer():
    spec = spec_from_hf_config(_dory(recurrent_kv_cache_mode="last_loop").to_dict(), view="transformers", warn=False)
    assert spec.num_layers == 4


@pytest.mark.parametrize("kw", [dict(n_recurrent_loops=3), dict(recurrent_kv_cache_mode="last_loop")],
                         ids=["per_loop-3", "last_loop"])
def test_looped_model_moves_bit_exactly(tmp_path, kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_dory(**kw), dtype=torch.float32).save_pretrained(tmp_path)
    result = run_demo(str(tmp_path), prompt_len=30, new_tokens=4, seed=1,
                      prefill=EngineLayout(tp_size=2, block_size=16, num_blocks=8, kv_order="HND"),
                      decode=EngineLayout(tp_size=3, block_size=8, num_blocks=16, kv_order="NHD"),
                      num_cached_tokens=8)
    assert result.ok and result.cache_equal and result.match, result.cache_differences[:3]


@pytest.mark.parametrize("raw, needle", [({"n_recurrent_loops": 10 ** 6}, "above kvbridge's bound"),
                                         ({"n_recurrent_loops": 1000, "n_recurrent_layers": 12, "num_hidden_layers": 16, "layer_types": None},
                                          "make a cache of")])
def test_absurd_loops_exit_with_one_line(raw, needle):
    config = {**_dory().to_dict(), **raw}
    with pytest.raises(ConfigError, match=needle) as e:
        spec_from_hf_config(config, warn=False)
    assert "\n" not in str(e.value)

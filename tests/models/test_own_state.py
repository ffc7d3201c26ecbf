"""Recurrent models whose state is in no transformers `Cache` (issue 11). RWKV's `state` list and
xLSTM's `xLSTMCache` are moved (tests/models/test_rwkv_state.py, test_xlstm_state.py); a layout
kvbridge does not know (here xLSTM's, with its kind taken off `STATE_DICT_KINDS`) is refused with
one line naming layer 0, the state and its per-layer shapes as the model really returns them, not
as attention layers missing a head count."""

from __future__ import annotations

import pytest

from kvbridge import ConfigError
from kvbridge.models import own_state, spec_from_hf_config
from kvbridge.models.own_state import causal_lm_class, keeps_state_outside_cache, moved_outside_cache
from kvbridge.proofs.model_sweep import tiny_config


def _refusal(arch: str) -> str:
    with pytest.raises(ConfigError) as e:
        spec_from_hf_config(tiny_config(arch).to_dict(), view="transformers", dtype="float32", warn=False)
    return str(e.value)


def test_unknown_state_layout_refusal_names_its_cache_class_per_layer(monkeypatch):
    monkeypatch.setattr(own_state, "STATE_DICT_KINDS", ())
    config = tiny_config("xlstm")
    line = _refusal("xlstm")
    assert line.startswith("layer 0 (xlstm recurrent state") and "full_attention" not in line
    heads, qk, v = config.num_heads, config.qk_head_dim, config.v_head_dim
    assert f"xLSTMCache.rnn_state; per layer [{heads}, {qk}, {v}] float32, [{heads}, {qk}] float32, " \
           f"[{heads}, 1] float32" in line


@pytest.mark.parametrize("arch", ["llama", "minimax", "mamba", "recurrent_gemma"])
def test_models_with_a_cache_are_not_taken_for_stateful_ones(arch):
    assert not keeps_state_outside_cache(causal_lm_class(tiny_config(arch)))


def test_rwkv_list_and_xlstm_object_are_moved():
    for arch in ("rwkv", "xlstm"):
        assert moved_outside_cache(tiny_config(arch)) and keeps_state_outside_cache(causal_lm_class(tiny_config(arch)))
    assert not moved_outside_cache(tiny_config("mamba"))

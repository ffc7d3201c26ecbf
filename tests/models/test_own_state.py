"""xLSTM (issue 11): a recurrent model whose state is in no transformers `Cache` (`xLSTMCache`) in a
layout kvbridge does not move. It is refused with one line naming layer 0, the state and its
per-layer shapes as the model really returns them, not as attention layers missing a head count.
RWKV's `state` list is moved (tests/models/test_rwkv_state.py)."""

from __future__ import annotations

import pytest

from kvbridge import ConfigError
from kvbridge.models import spec_from_hf_config
from kvbridge.models.own_state import causal_lm_class, keeps_state_outside_cache, moved_outside_cache
from kvbridge.proofs.model_sweep import sweep_one, tiny_config


def _refusal(arch: str) -> str:
    with pytest.raises(ConfigError) as e:
        spec_from_hf_config(tiny_config(arch).to_dict(), view="transformers", dtype="float32", warn=False)
    return str(e.value)


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


def test_only_rwkv_state_list_is_moved():
    assert moved_outside_cache(tiny_config("rwkv")) and keeps_state_outside_cache(causal_lm_class(tiny_config("rwkv")))
    assert not moved_outside_cache(tiny_config("xlstm"))


def test_sweep_row_is_refused_with_that_line():
    row = sweep_one("xlstm")
    assert row.status == "refused" and row.detail.startswith("layer 0 (xlstm recurrent state")

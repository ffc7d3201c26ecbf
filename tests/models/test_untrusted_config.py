"""config.json is untrusted: every malformed size is one `ConfigError` line (the CLI's exit 2),
before transformers or kvbridge do work proportional to it; fields left to transformers'
defaults are named on stderr; names from configs cannot carry control characters or markup."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.errors import ConfigError
from kvbridge.models import spec_from_hf_config

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 256, "head_dim": 32, "torch_dtype": "bfloat16"}


def refused(cfg, match: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        spec_from_hf_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    if match:
        assert match in msg, msg
    return msg


@pytest.mark.parametrize("value", [True, False, 8.0, 8.5, "8", [8], {"n": 8}, math.nan, math.inf, -math.inf,
                                   0, -1, 10 ** 6, pytest.param(10 ** 5000, id="5000-digits")])
@pytest.mark.parametrize("field", ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"])
def test_bad_sizes_are_one_line(field, value):
    msg = refused({**LLAMA, field: value})
    assert field in msg or "digits" in msg


def test_more_kv_heads_than_query_heads():
    refused({**LLAMA, "num_key_value_heads": 16}, "16 KV heads but only 8 query heads")


def test_attribute_map_names_are_checked_too():
    # GPT-2 spells the layer count n_layer; a million of them is refused before anything is built.
    t0 = time.perf_counter()
    refused({"model_type": "gpt2", "n_layer": 1_000_000, "n_head": 12, "n_embd": 768}, "n_layer")
    refused({"model_type": "gpt2", "n_layer": 2, "n_head": 10 ** 6, "n_embd": 768}, "n_head")
    assert time.perf_counter() - t0 < 5


def test_nested_text_config_is_checked():
    refused({"model_type": "llava", "text_config": {**LLAMA, "num_attention_heads": 1.5}}, "text_config.num_attention_heads")


@pytest.mark.parametrize("text", ["[1, 2]", "3", "null", '"llama"', "{", "\xff\xfe"])
def test_non_object_or_broken_json_files(tmp_path, text):
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    refused(tmp_path)


def test_deep_nesting_and_huge_ints_in_files(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 20 + "]" * 20 + "}")
    refused(tmp_path, "deeper")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100000 + "]" * 100000 + "}")
    refused(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": ' + "9" * 5000 + "}")
    refused(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rope_theta": 10 ** 30}))
    refused(tmp_path, "rope_theta")
    (tmp_path / "config.json").write_bytes(b" " * (9 << 20))
    refused(tmp_path, "MiB")


def test_unknown_model_type_and_missing_model_type():
    refused({**LLAMA, "model_type": "\x1b[31mevil"}, "no config class")
    refused({k: v for k, v in LLAMA.items() if k != "model_type"}, "no model_type")


def test_missing_fields_named_on_stderr(capsys):
    spec = spec_from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 2})
    err = capsys.readouterr().err
    assert spec.num_layers == 2
    assert err.count("\n") == 1 and "num_attention_heads" in err and "head_dim" in err
    spec_from_hf_config(LLAMA)
    assert capsys.readouterr().err == ""


def test_names_from_configs_are_escaped():
    spec = spec_from_hf_config({**LLAMA, "_name_or_path": "a\x1b[2J[bold]b\nc\x00" + "x" * 500})
    assert all(ch.isprintable() for ch in spec.name) and "[" not in spec.name and len(spec.name) <= 200


def test_cli_exits_2_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": math.nan}))
    r = CliRunner().invoke(app, ["plan", str(tmp_path)])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "num_hidden_layers" in lines[0], r.output


def test_transformers_tagged_floats_are_read_as_floats(tmp_path):
    """transformers >= 5.24 writes a float JSON cannot spell as {"__float__": "Infinity"} (Mamba2's
    time_step_limit): a config it saved plans; the same tag in a size is a non-finite size, refused."""
    import transformers

    config = transformers.NemotronHConfig(num_hidden_layers=4, hybrid_override_pattern="M-*M", hidden_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8)
    config.save_pretrained(tmp_path)
    assert '"__float__"' in (tmp_path / "config.json").read_text()  # what this test is about
    r = CliRunner().invoke(app, ["plan", str(tmp_path), "--decode-tp", "2"])
    assert r.exit_code == 0 and "2xrecurrent" in r.output, r.output
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": {"__float__": "Infinity"}}))
    r = CliRunner().invoke(app, ["plan", str(tmp_path)])
    assert r.exit_code == 2 and "num_hidden_layers" in r.output and len(r.output.strip().splitlines()) == 1, r.output


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                    max_leaves=6)
FIELDS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
          "sliding_window", "layer_types", "model_type", "text_config", "torch_dtype", "max_window_layers",
          "mamba_n_heads", "mamba_d_head", "linear_num_key_heads", "layers_block_type", "attn_layer_indices",
          "multi_query", "n_layer", "kv_lora_rank", "v_head_dim"]
EXAMPLES = int(os.environ.get("KVBRIDGE_HYPOTHESIS_EXAMPLES", "60"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from([LLAMA, {**LLAMA, "model_type": "mistral", "sliding_window": 16},
                             {**LLAMA, "model_type": "gemma2", "sliding_window": 16},
                             {**LLAMA, "model_type": "qwen3_next"}, {**LLAMA, "model_type": "bamba"},
                             {**LLAMA, "model_type": "deepseek_v3"}]),
       edits=st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3))
def test_any_edit_gives_a_spec_or_one_line(base, edits):
    try:
        spec = spec_from_hf_config({**base, **edits}, warn=False)
    except ConfigError as e:
        assert "\n" not in str(e)
        return
    for layer in spec.layers:  # accepted: geometry is sane, never silently absurd
        if layer.is_recurrent:
            assert all(1 <= c.heads <= 1 << 18 and 1 <= c.dim <= 1 << 36 for c in layer.state)
        else:
            assert 1 <= layer.num_kv_heads <= 16384 and 1 <= layer.key_dim <= 1 << 18
    assert 1 <= spec.num_layers <= 4096

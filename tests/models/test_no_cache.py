"""Causal LMs whose transformers class keeps no per-layer K/V are refused from the config (issue 11
item 3): `kvbridge plan` says so in one line instead of planning K/V that no engine holds."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbridge import ConfigError
from kvbridge.cli import app
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.model_sweep import tiny_config


@pytest.mark.parametrize("arch, kept", [("openai-gpt", "takes and returns no cache"),
                                        ("xlnet", "keeps its cache as mems"),
                                        ("reformer", "keeps its cache as past_buckets_states")])
def test_a_class_without_a_kv_cache_is_refused_naming_layer_0_and_what_it_keeps(arch, kept):
    with pytest.raises(ConfigError, match=rf"^layer 0: \w+ {kept}") as e:
        spec_from_hf_config(tiny_config(arch).to_dict(), warn=False)
    assert "\n" not in str(e.value) and "nothing to move" in str(e.value)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mamba", "rwkv"])
def test_classes_that_take_a_cache_are_read_as_before(arch):
    assert spec_from_hf_config(tiny_config(arch).to_dict(), warn=False).num_layers >= 1


def test_plan_of_a_saved_gpt1_config_exits_2_with_one_line(tmp_path):
    tiny_config("openai-gpt").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "openai-gpt"
    r = CliRunner().invoke(app, ["plan", str(tmp_path)])
    lines = [line for line in r.output.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert r.exit_code == 2 and len(lines) == 1 and "OpenAIGPTLMHeadModel" in lines[0], r.output


def test_blt_is_refused_naming_its_sub_models():
    """BLT's layers sit in encoder / decoder / global sub-models; transformers' DynamicCache(config)
    cannot lay out a cache for its config (no num_hidden_layers), so there is none to move."""
    with pytest.raises(ConfigError, match=r"layer 0: its layers are split over sub-models \(.*encoder_config.*\)") as e:
        spec_from_hf_config(tiny_config("blt").to_dict(), warn=False)
    assert "\n" not in str(e.value) and "no cache to move" in str(e.value)

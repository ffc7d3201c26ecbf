"""Geometry from what transformers builds, not from fields the architecture ignores (issue 24).

A config.json may carry fields its architecture never reads (copied from a sibling's config): a
`num_key_value_heads` beside GPT-NeoX's fused QKV (one KV head per query head), a `kv_lora_rank`
beside plain K/V, Qwen3-Next's `linear_*` sizes beside a Mamba2 mixer. kvbridge plans what the
modules transformers builds cache (on the meta device) and names the difference in one warning
line; sizes config.json leaves to the class's defaults are named too. The bounded sample of the
stray-field sweep (`make models` runs every architecture) checks each against a real prefill."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.stray_sweep import STRAYS, check_stray, stray_groups

NEOX = {"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 12,
        "intermediate_size": 128, "vocab_size": 256}


def test_gpt_neox_ignores_num_key_value_heads_and_plan_says_so(capsys):
    spec = spec_from_hf_config({**NEOX, "num_key_value_heads": 6})
    assert [(x.num_kv_heads, x.key_dim) for x in spec.layers] == [(12, 8), (12, 8)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "num_key_value_heads" in err[0] and "GPTNeoXAttention" in err[0] and "12 KV heads" in err[0]
    assert "layers 0-1" in err[0] and "planning with the module's" in err[0]


def test_no_warning_when_the_fields_and_the_modules_agree(capsys):
    spec_from_hf_config(NEOX)
    assert capsys.readouterr().err == ""


def test_a_stray_mla_latent_does_not_make_plain_attention_mla(capsys):
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
             "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128}
    spec = spec_from_hf_config({**llama, "kv_lora_rank": 32, "qk_rope_head_dim": 8})
    assert [(x.kind, x.num_kv_heads, x.key_dim) for x in spec.layers] == [("full", 2, 8)] * 2
    assert "kv_lora_rank" in capsys.readouterr().err


def test_a_siblings_mixer_fields_do_not_change_the_mixer(capsys):
    bamba = {"model_type": "bamba", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128, "attn_layer_indices": [1],
             "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4}
    clean = spec_from_hf_config(bamba)
    capsys.readouterr()
    spec = spec_from_hf_config({**bamba, **STRAYS["gdn"]})
    assert spec.layers == clean.layers and spec.layers[0].recurrent_type == "mamba2"


def test_plan_json_prints_the_modules_geometry_and_one_warning_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**NEOX, "num_key_value_heads": 6}))
    r = CliRunner().invoke(app, ["plan", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    assert len([line for line in r.stderr.splitlines() if line.startswith("warning:")]) == 1, r.stderr
    assert "num_key_value_heads" in r.stderr and "GPTNeoXAttention" in r.stderr
    assert "12 KV heads" in json.loads(r.stdout)["model"]


GDN_NO_SIZES = {"model_type": "qwen3_next", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
                "layer_types": ["linear_attention", "full_attention"], "num_experts": 2, "num_experts_per_tok": 1,
                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim")


@pytest.mark.parametrize("form", [[], ["--json"]])
def test_plan_names_the_mixer_sizes_left_to_the_class_defaults(tmp_path, form):
    (tmp_path / "config.json").write_text(json.dumps(GDN_NO_SIZES))
    r = CliRunner().invoke(app, ["plan", str(tmp_path), *form])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if "omits" in line]
    assert len(lines) == 1 and all(f in lines[0] for f in LINEAR), r.stderr
    # sizes the file gives are not named
    (tmp_path / "config.json").write_text(json.dumps({**GDN_NO_SIZES, **STRAYS["gdn"]}))
    r = CliRunner().invoke(app, ["plan", str(tmp_path), *form])
    assert r.exit_code == 0 and "omits" not in r.stderr, r.stderr


def test_demo_names_the_mixer_sizes_left_to_the_class_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**GDN_NO_SIZES, "linear_num_value_heads": 2,
                                                      "linear_num_key_heads": 2}))
    r = CliRunner().invoke(app, ["demo", "--model", str(tmp_path), "--prompt-len", "8", "--new-tokens", "2", "--json"])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if "omits" in line]
    assert len(lines) == 1, r.stderr
    assert "linear_key_head_dim" in lines[0] and "linear_num_key_heads" not in lines[0]


# --- the bounded sample of the stray-field sweep -----------------------------------------------

# architectures whose plan was wrong before geometry came from the modules: fused QKV (GPT-NeoX,
# Bloom, GPT-2), BERT-style key/value, wrapped projections (Moshi, Inkling-2), a derived text
# config (Blenderbot), mixers named by a sibling's fields (Bamba, RG-LRU), CCA projections (ZAYA);
# and since (issue 30) MiMo-V2-Flash's sliding layers at its own sizes (`own_head_dim`: query heads
# read from the output projection) and Falcon's `num_kv_heads` under `new_decoder_architecture`
# (`flip_new_decoder_architecture`: its K/V heads broadcast before caching). HRM's two module stacks
# are left to `make models` (its forward takes seconds per case)
KNOWN = ["gpt_neox", "bloom", "gpt2", "bert", "moshi", "inkling2_text", "blenderbot", "bamba", "recurrent_gemma",
         "falcon", "codegen", "zaya", "mimo_v2_flash"]
FLIPPED = {"falcon"}  # known architectures whose boolean fields are toggled here too (the rest: `make models`)
ROTATION = 3


def _sample() -> list[tuple[str, str]]:
    doc = Path(__file__).resolve().parents[2] / "docs" / "models.md"
    moved = sorted(re.findall(r"^\| (\S+) \| [^|]* \| moved \|", doc.read_text(), re.MULTILINE)) if doc.is_file() else []
    seed = int(os.environ.get("KVBRIDGE_SWEEP_SEED", int(time.time() // 86400)))
    rest = [a for a in moved if a not in KNOWN]
    rotation = random.Random(seed).sample(rest, min(ROTATION, len(rest)))
    return [(a, g) for a in KNOWN + rotation for g in stray_groups(a, flips=a in FLIPPED or a in rotation)]


def test_the_sample_holds_the_cases_of_issue_30():
    sample = _sample()
    assert ("falcon", "flip_new_decoder_architecture") in sample and ("mimo_v2_flash", "own_head_dim") in sample


@pytest.mark.parametrize(("arch", "group"), _sample())
def test_stray_fields_plan_what_transformers_builds(arch, group):
    row = check_stray(arch, group)
    assert row.status in ("ok", "unbuildable"), f"{arch} + {group}: {row.status}: {row.detail}"


def test_the_sweep_check_can_fail():
    """The check itself sees a wrong geometry: the spec of the config without the modules' or the
    forward's say."""
    from kvbridge.models import modules

    real = modules.built_layers
    modules.built_layers = lambda text, n: modules.BuiltLayers()  # nothing built: the stray field is planned
    try:
        row = check_stray("gpt_neox", "gqa")
    finally:
        modules.built_layers = real
    assert row.status == "mismatch" and re.search(r"do not match the spec's 6 heads", row.detail), row


def test_a_flip_catches_heads_the_forward_caches_other_than_the_projections_compute():
    """Without the forward measured (the module reading alone), Falcon under its new decoder
    architecture plans the 6 KV heads its fused projection computes, while transformers caches 12:
    the toggled switch shows it."""
    from kvbridge.models import probe

    real = probe.cached_kv
    probe.cached_kv = lambda model, n: None
    try:
        row = check_stray("falcon", "flip_new_decoder_architecture")
    finally:
        probe.cached_kv = real
    assert row.status == "mismatch" and "do not match the spec's 6 heads" in row.detail, row
    assert check_stray("falcon", "flip_new_decoder_architecture").status == "ok"


def test_own_fields_and_their_per_kind_copies_take_other_values():
    from kvbridge.proofs.model_sweep import tiny_config
    from kvbridge.proofs.stray_sweep import group_fields

    base = tiny_config("inkling_text").to_dict()
    assert group_fields("inkling_text", "own_kv_heads", base) == {"num_key_value_heads": 4, "swa_num_key_value_heads": 3}
    assert group_fields("mimo_v2_flash", "own_head_dim", tiny_config("mimo_v2_flash").to_dict()) == {"head_dim": 24}
    assert group_fields("falcon", "flip_new_decoder_architecture", tiny_config("falcon").to_dict()) == {
        "new_decoder_architecture": True}
    assert "own_head_dim" not in stray_groups("deepseek_v3")  # an MLA class's head_dim is its rope part
    assert not any(g.startswith("flip_use_cache") or g == "flip_tie_word_embeddings" for g in stray_groups("llama"))


def test_a_size_the_config_keeps_per_layer_kind_is_no_conflict(capsys):
    """Inkling's sliding layers read `swa_num_key_value_heads`: the config says what the module
    builds, so nothing is named; MiMo-V2's sliding layers double `num_key_value_heads` in the
    modeling code alone, which is named (and planned as built)."""
    from kvbridge.proofs.model_sweep import tiny_config

    inkling = {**tiny_config("inkling_text").to_dict(), "num_key_value_heads": 3, "swa_num_key_value_heads": 6}
    spec = spec_from_hf_config(inkling)
    assert "planning with" not in capsys.readouterr().err
    assert {x.num_kv_heads for x in spec.layers if x.kind in ("full", "sliding")} == {3, 6}
    mimo = {"model_type": "mimo_v2_flash", "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 24, "v_head_dim": 16, "hidden_size": 64, "sliding_window": 9,
            "layer_types": ["full_attention", "sliding_attention"]}
    spec = spec_from_hf_config(mimo)
    err = [line for line in capsys.readouterr().err.splitlines() if "planning with" in line]
    assert len(err) == 1 and "MiMoV2FlashAttention caches 4 KV heads" in err[0] and "layer 1 " in err[0], err
    assert [x.num_kv_heads for x in spec.layers] == [2, 4]

"""Models at the edges of what transformers caches: every layer recurrent (Mamba takes its cache as
`cache_params`, and generate runs without an attention layer), and models that return no cache at
all (GPT-1, XLNet's memories), which the CLI refuses in one line naming the layer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.proofs.local_demo import run_demo
from kvbridge.proofs.model_sweep import FALLBACK_PAIR, PAIRS, tiny_config


def _save(arch: str, path) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_all_recurrent_models_move_bit_exactly(tmp_path, arch):
    d = _save(arch, tmp_path)
    prompt = list(range(3, 43))
    # TP1 -> TP2, then TP3 -> TP2 with new blocks and layout, or TP4 where Mamba1's channels do not split over 3
    for _, prefill, decode in [PAIRS[0], PAIRS[1] if arch == "mamba2" else FALLBACK_PAIR]:
        result = run_demo(d, prompt_ids=prompt, new_tokens=4, seed=0, prefill=prefill, decode=decode)
        assert result.ok and result.cache_equal and result.match, result.cache_differences[:2]


def test_cli_demo_moves_mamba(tmp_path):
    r = CliRunner().invoke(app, ["demo", "--model", _save("falcon_mamba", tmp_path), "--prompt-len", "20",
                                 "--new-tokens", "3"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(("arch", "what"), [("openai-gpt", "no past_key_values"), ("xlnet", "as mems")])
def test_a_model_without_a_cache_is_one_line_exit_2(tmp_path, arch, what):
    r = CliRunner().invoke(app, ["demo", "--model", _save(arch, tmp_path), "--prompt-len", "8", "--new-tokens", "2"])
    lines = [line for line in r.output.splitlines() if line.startswith("error:")]  # besides transformers' progress bars
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and "layer 0" in lines[0] and what in lines[0], r.output
    assert "Traceback" not in r.output

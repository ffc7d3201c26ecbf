"""An instance that dies during start (issue 28 point 7): `kvbridge serve` says the cause from the
instance's own log (vLLM ends it with "Engine core initialization failed. See root cause above"),
exits 1 and leaves nothing running. The model's checkpoint lacks a tensor, which no check before
start can see (its final norm has one element too few): real `vllm serve` processes find it when
they load the weights, in their engine process, and die.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]  # a fleet start that fails: `make fleet-tests`


def test_an_instance_that_dies_at_start_is_reported_with_its_logs_cause(vllm_env, tmp_path):
    from safetensors.torch import load_file, save_file
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    cli = str(Path(sys.executable).parent / "kvbridge")
    r = subprocess.run([cli, "serve", str(model), "--prefill", "tp=1", "--decode", "tp=1", "--port",
                        str(free_ports(1)), "--log-dir", str(tmp_path / "logs"), "--vllm-python",
                        str(vllm_env.python), "--startup-timeout", "600", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("error: ") and "during start: " in first, r.stderr[-3000:]
    assert "See root cause above" not in first and "Attempted to load weight" in first, first

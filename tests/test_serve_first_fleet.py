"""A newcomer's first fleet (issue 28 point 7): `kvbridge serve` takes the built-in tiny model names,
and what would fail late fails early: one line, exit 2, no traceback, no empty temporary log
directory. The command runs in-process as a user types it (typer's runner); nothing is started
(refusals come before anything starts; the tiny model's line is checked with --dry-run).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app

runner = CliRunner()
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
needs_vllm_tools = pytest.mark.skipif(not (VLLM_PYTHON.parent / "vllm-router").is_file(),
                                      reason="kvbridge serve --dry-run needs .venv-vllm's vllm and vllm-router")


def _one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "Traceback" not in r.output
    return lines[0]


@pytest.fixture()
def model(tmp_path):
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    return add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))


@pytest.fixture()
def own_tmp(tmp_path, monkeypatch):
    """A temporary directory of the test's own, where serve makes its default log directory."""
    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def serve(*args: str):
    return runner.invoke(app, ["serve", *args, "--prefill", "tp=1", "--decode", "tp=2", "--vllm-python",
                               str(VLLM_PYTHON)])


def test_a_model_directory_without_weights_is_one_line_and_leaves_no_temporary_directory(model, own_tmp):
    (model / "model.safetensors").unlink()
    line = _one_error_line(serve(str(model)))
    assert "has no weights" in line and "tiny-llama" in line
    assert not list(own_tmp.iterdir())  # the default log directory it made is gone again


def test_max_model_len_above_the_models_positions_is_one_line(model, own_tmp):
    line = _one_error_line(serve(str(model), "--max-model-len", "1000000"))
    assert "--max-model-len 1000000 is more than the model's 1024 positions" in line
    assert not list(own_tmp.iterdir())


def test_a_log_directory_that_cannot_be_made_is_one_line(model):
    line = _one_error_line(serve(str(model), "--log-dir", "/proc/forbidden"))
    assert "--log-dir /proc/forbidden: cannot create it" in line


def test_an_unknown_model_name_is_one_line(own_tmp):
    line = _one_error_line(serve("tiny-nothing"))
    assert "tiny-nothing: no such model directory, nor a built-in tiny model (tiny-llama, " in line
    assert not list(own_tmp.iterdir())


@needs_vllm_tools
def test_serve_makes_a_servable_tiny_model_by_name_and_says_it_answers_garbage(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    r = serve("tiny-llama", "--dry-run")
    assert r.exit_code == 0, r.output
    made = tmp_path / "cache" / "kvbridge" / "serve-models" / "tiny-llama"
    assert (made / "model.safetensors").is_file() and (made / "tokenizer.json").is_file()
    assert f"tiny-llama: a tiny Llama with random weights and a byte tokenizer ({made})" in r.output
    assert "answers garbage" in r.output
    assert f"vllm serve {made} " in r.output
    config = json.loads((made / "config.json").read_text())
    assert config["head_dim"] == 32  # vLLM CPU's attention takes 32, not the demo configs' 16
    again = serve("tiny-llama", "--dry-run")  # made once: the second run reuses it
    assert again.exit_code == 0 and (made / "model.safetensors").stat().st_mtime_ns == \
        (made / "model.safetensors").stat().st_mtime_ns


def test_version_and_the_help_of_serve():
    from kvbridge import __version__
    from kvbridge.cli.app import BOUNDS
    from kvbridge.integrations.vllm.fleet_config import MAX_TP
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"kvbridge {__version__}"
    help_text = " ".join(runner.invoke(app, ["serve", "--help"]).output.split())
    assert "--max-model-len" in help_text and "max_position_embeddings" in help_text
    assert f"tp (1..{BOUNDS['tp']})" in help_text and MAX_TP == BOUNDS["tp"]


def test_the_cause_of_an_instance_that_died_is_its_logs_last_error_line():
    from kvbridge.integrations.vllm.fleet_processes import log_cause
    log = ("INFO 11-26 [api_server.py:1] vLLM API server version 0.32.0\n"
           "(EngineCore pid=412) Traceback (most recent call last):\n"
           "(EngineCore pid=412)   File \"/x/vllm/model_executor/model_loader/default_loader.py\", line 9, in load\n"
           "(EngineCore pid=412) ValueError: Following weights were not initialized from checkpoint: {'lm_head.weight'}\n"
           "ERROR 11-26 [core.py:3] EngineCore failed to start.\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert log_cause(log) == "ValueError: Following weights were not initialized from checkpoint: {'lm_head.weight'}"
    assert log_cause("INFO all fine\n") == ""
    worker = ("(Worker pid=7432) ERROR 11-26 23:48:03 [multiproc_executor.py:953] AssertionError: Attempted to load "
              "weight (torch.Size([127])) into parameter (torch.Size([128]))\n" + log.splitlines()[-1])
    assert log_cause(worker).startswith("AssertionError: Attempted to load weight (torch.Size([127]))")

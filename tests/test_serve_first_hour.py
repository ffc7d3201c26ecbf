"""A new user's first hour with `kvbridge serve` (issue 43, "A new user's first hour", 2026-11-29):
what the launcher says when it cannot find vLLM, when its output is a log file rather than a
terminal, when `--pool` names a master that is down, and when it is given a name `kvbridge plan`
takes but vLLM cannot serve.

The start runs as a user's `nohup kvbridge serve ... >log 2>&1` would: a real process, stdin from
/dev/null, stdout and stderr to a file; its members are stand-ins for `vllm serve` and
`vllm-router` (`kvbridge.testing.stand_ins`) whose health comes a few seconds late, as vLLM's does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.testing.stand_ins import make_tools
from kvbridge.transport.ports import free_ports

KVBRIDGE = str(Path(sys.executable).parent / "kvbridge")
runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    return add_byte_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("model") / "m", seed=1))


def _one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_no_vllm_environment_says_where_it_looked_and_how_to_name_one(model, tmp_path, monkeypatch):
    # Run from another directory, with no .venv-vllm where kvbridge looks (an installed kvbridge,
    # or a checkout without one): it said only "run make vllm-env", a 3.4 GB rebuild.
    from kvbridge.integrations.vllm import fleet_processes
    monkeypatch.setattr(fleet_processes, "REPO", tmp_path / "checkout")
    monkeypatch.delenv("KVBRIDGE_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(runner.invoke(app, ["serve", str(model), "--prefill", "tp=1", "--decode", "tp=1",
                                               "--log-dir", str(tmp_path / "logs")]))
    assert str(tmp_path / "checkout" / ".venv-vllm" / "bin" / "python") in line, line
    assert "KVBRIDGE_VLLM_PYTHON unset" in line and f"{sys.executable} (no vllm module)" in line, line
    assert "--vllm-python PATH" in line, line
    # a --vllm-python that names no file is said as such, not passed over for another interpreter
    line = _one_error_line(runner.invoke(app, ["serve", str(model), "--prefill", "tp=1", "--decode", "tp=1",
                                               "--log-dir", str(tmp_path / "logs"), "--vllm-python",
                                               str(tmp_path / "no-python")]))
    assert f"--vllm-python '{tmp_path / 'no-python'}': no such file" in line, line


def test_a_preset_name_says_why_serve_does_not_take_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(runner.invoke(app, ["serve", "llama-3-8b", "--prefill", "tp=1", "--decode", "tp=1"]))
    assert "llama-3-8b: a preset geometry that `kvbridge plan` and `bench` take (no weights" in line, line
    assert "tiny-llama" in line, line


def _wait_for(path: Path, cond, timeout: float, what: str) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = path.read_text(errors="replace") if path.exists() else ""
        if cond(text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f} s: {what}; output so far:\n{text}")


def test_without_a_terminal_the_start_says_its_logs_at_once_and_a_down_master_is_not_called_running(model,
                                                                                                    tmp_path):
    tools = make_tools(tmp_path / "tools")
    logs, out = tmp_path / "logs", tmp_path / "serve.out"
    env = {**os.environ, "KVBRIDGE_STAND_IN_HEALTHY_AFTER_S": "6"}
    with open(out, "wb") as f, open(os.devnull, "rb") as null:
        launcher = subprocess.Popen([KVBRIDGE, "serve", str(model), "--prefill", "tp=1", "--decode", "tp=1",
                                     "--vllm-python", str(tools), "--log-dir", str(logs), "--port",
                                     str(free_ports(1)), "--pool", "127.0.0.1:1"],
                                    stdin=null, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        # the log directory is in the output while the members still start (it was said only with
        # "fleet ready", so a start that hung under nohup, systemd or CI left nothing to look at)
        early = _wait_for(out, lambda t: str(logs) in t or "fleet ready" in t or launcher.poll() is not None, 120,
                          "the log directory named")
        assert "fleet ready" not in early and launcher.poll() is None, early
        assert f"starting 2 instances and the router (logs in {logs}" in early, early
        assert "waiting for health" in _wait_for(out, lambda t: "waiting for health" in t, 30, "a progress line")
        text = _wait_for(out, lambda t: "Ctrl-C stops the fleet" in t or launcher.poll() is not None, 120,
                         "the ready banner")
        assert "fleet ready at" in text, text
        # --pool 127.0.0.1:1: said down before the start, and not called "a running master" after it
        assert "warning: the pool's master 127.0.0.1:1 does not accept connections" in text, text
        pool_line = next(line for line in text.splitlines() if line.strip().startswith("pool "))
        assert "a running master" not in pool_line and "does not accept connections" in pool_line, pool_line
        # "ready" is health: the first answer's compile wait is said, not left to look like a hang
        assert "first request may wait while vLLM compiles" in text, text
        assert "warning: the pool's master 127.0.0.1:1 does not accept connections: the instances serve" in text
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
    assert "fleet stopped" in out.read_text(errors="replace")

"""`make gpu-check` (scripts/gpu_check.py) runs here on the CPU with small sizes, so the script that a GPU
machine runs cannot rot; the CUDA run itself needs a GPU, which CI does not have."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_gpu_check_runs_every_check_on_cpu(capsys, monkeypatch):
    module = runpy.run_path(str(SCRIPT))
    assert module["main"](["--device", "cpu", "--tokens", "64", "--repeats", "1", "--cases", "6"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    checks = [r["check"] for r in rows]
    assert checks.count("proof") == 4 and all(r["ok"] for r in rows if r["check"] == "proof")
    verify = next(r for r in rows if r["check"] == "verify")
    assert verify["equal"] and verify["cases"] == 6 and verify["runs"] > 0 and verify["backends"] == ["numba"]
    executor = next(r for r in rows if r["check"] == "executor")
    assert executor["bytes"] == 64 * 32 * 2 * 8 * 128 * 2 and executor["ratio"] > 0
    nixl = next(r for r in rows if r["check"] == "nixl_vram")
    assert nixl.get("equal") is True or "skipped" in nixl


def test_gpu_check_refuses_cuda_without_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the refusal is for hosts without one")
    module = runpy.run_path(str(SCRIPT))
    assert module["main"](["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err

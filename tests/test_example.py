"""The root example (and so the README's library snippet) runs as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_example_runs_and_every_rank_checks_out() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "example.py")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "checksums differ on: no rank" in out.stdout

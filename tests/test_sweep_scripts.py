"""The zoo sweeps' scripts (`make models`, `make pool-zoo`) refuse an `--only` that names no
architecture in one line, before any work and before writing a table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script,extra", [("models_sweep.py", ["--no-strays"]), ("pool_zoo.py", [])])
def test_an_unknown_architecture_is_one_line_and_exit_2(tmp_path, script, extra):
    out = tmp_path / "table.md"
    args = [sys.executable, str(SCRIPTS / script), "--only", "llama,no_such_model", "--json", str(out), *extra]
    if script == "models_sweep.py":
        args += ["--out", str(out)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "no_such_model" in lines[0], done.stderr[-2000:]
    assert not out.exists() and not done.stdout.strip()

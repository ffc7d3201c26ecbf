"""Every `kvbridge ...` recipe of README.md and docs/*.md runs as written (issue 24 point 6).

The recipes are read from the fenced code blocks (a `\\` continues a line, `#` starts a comment).
A recipe of one `kvbridge` command runs in this process through the same typer app (the shell
would only split its words); one that needs the shell (a setup line such as `(umask 077; ...)`,
a command sent to the background with `&`) runs with bash, the `kvbridge` of this environment on
PATH, in a fresh directory. A recipe that needs what this machine has not (vLLM, NIXL, the user's
own model directory) is skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = re.compile(r"^\(?umask |^\(umask|^head -c |^export ")


def recipes(path: Path) -> list[list[str]]:
    """Each recipe: the shell lines it runs, the last a `kvbridge` command."""
    out: list[list[str]] = []
    in_block, pending, line_acc = False, [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("```"):
            in_block, pending, line_acc = not in_block, [], ""
            continue
        if not in_block:
            continue
        text = line_acc + raw.strip()
        if text.endswith("\\"):
            line_acc = text[:-1] + " "
            continue
        line_acc = ""
        text = re.sub(r"^\$ ", "", text)
        if SETUP.match(text):
            pending.append(text)
        elif text.startswith("kvbridge "):
            pending.append(text)
            if not text.split("#")[0].rstrip().endswith("&"):
                out.append(pending)
                pending = []
    return out


def _id(path: Path, lines: list[str]) -> str:
    return f"{path.name}:{' '.join(shlex.split(lines[-1], comments=True)[1:5])}"


CASES = [pytest.param(lines, id=_id(p, lines)) for p in DOCS for lines in recipes(p)]


def _missing(lines: list[str]) -> str | None:
    """Why this machine cannot run the recipe, or None."""
    words = [w for line in lines for w in shlex.split(line, comments=True)]
    if ("--engine" in words and words[words.index("--engine") + 1] == "vllm") or words[1:2] == ["serve"]:
        return "needs vLLM (`make vllm-env`)"
    if any(re.fullmatch(r"[A-Z][A-Z_:]+", w) or "my-save-pretrained-dir" in w or w.endswith("...") for w in words):
        return "needs the user's own model directory or prompt"
    from kvbridge.connector.transports import unavailable_reason
    for transport in ("nixl", "mooncake"):
        why = unavailable_reason(transport) if transport in words else None
        if why:
            return f"needs the {transport} engine, which does not load here: {why}"
    return None


def _without_engine_logs(text: str) -> str:
    """`text` less the engines' glog lines (I/W/E1127 ...), which bury the line that says why."""
    return "\n".join(x for x in text.splitlines() if not re.match(r"[IWE]\d{4} ", x))


def test_the_recipes_are_found():
    found = [lines for p in DOCS for lines in recipes(p)]
    assert len(found) >= 15
    two_host = [lines for lines in found if any("prefill-server" in x for x in lines)]
    assert two_host and any("umask 077" in x for x in two_host[0]), two_host


@pytest.mark.parametrize("lines", CASES)
def test_recipe_runs_as_written(lines: list[str], tmp_path, monkeypatch):
    why = _missing(lines)
    if why:
        pytest.skip(why)
    monkeypatch.chdir(tmp_path)
    if len(lines) == 1:
        from kvbridge.cli import app
        r = CliRunner().invoke(app, shlex.split(lines[0], comments=True)[1:])
        assert r.exit_code == 0, r.output
        return
    # A user's shell, not this process's environment: an in-process Mooncake transport of an
    # earlier test set Mooncake's process-wide TCP deadlines (MC_TCP_*_TIMEOUT_SEC) to its own
    # few seconds, and the recipe's engines inherited them (CI: the two-process recipe's transfer
    # failed under load, the recipe alone passed).
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_TCP_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    script = "set -e\n" + "\n".join(lines) + "\nwait\n"
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-6000:]}\n{_without_engine_logs(r.stderr)[-6000:]}"
    assert "Traceback" not in r.stdout + r.stderr

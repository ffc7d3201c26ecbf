"""Sentences of the docs that state what the code does, checked against the code (issue 43, "Tests
and docs" and "A new user's first hour"): each of these was wrong in the docs of 2026-11-29.
Figures of runs are checked elsewhere (tests/test_doc_tables.py, tests/test_serve_tables.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = (ROOT / "docs" / "serving.md").read_text()
POOL = (ROOT / "docs" / "pool.md").read_text()
ROUTER = ROOT / ".venv-vllm" / "bin" / "vllm-router"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_segments_are_noted_at_every_supervisor_step_not_every_5_s() -> None:
    from kvbridge.cli import serve
    assert serve.SUPERVISE_S == 1.0
    flat = _flat(SERVING)
    assert "every 5 s after" not in flat and "within 5 s of making it" not in flat
    assert "at every step of the supervisor after it, about once a second" in flat


def test_the_routers_old_health_defaults_are_its_own() -> None:
    from kvbridge.integrations.vllm.fleet import HEALTH_FAILURES, HEALTH_INTERVAL_S
    flat = _flat(SERVING)
    assert "(vllm-router's defaults: interval 60 s, threshold 3)" in flat
    assert f"before its {HEALTH_FAILURES}th failed check" in flat and HEALTH_INTERVAL_S == 1
    if ROUTER.is_file():  # the router's own word, where it is installed
        text = _flat(subprocess.run([str(ROUTER), "--help"], capture_output=True, text=True, timeout=60).stdout)
        assert re.search(r"--health-failure-threshold HEALTH_FAILURE_THRESHOLD .*?\(default: 3\)", text)
        assert re.search(r"--health-check-interval-secs HEALTH_CHECK_INTERVAL_SECS .*?\(default: 60\)", text)


def test_no_mean_ttft_is_quoted_that_the_committed_run_does_not_hold() -> None:
    report = json.loads((ROOT / "docs" / "serve-check.json").read_text())
    held = [side.get("mean_ttft_ms") for run in report["bench"] for row in run["table"]
            for side in (row.get("kvbridge") or {}, row.get("nixl") or {}) if isinstance(side, dict)]
    if not any(v is not None for v in held):
        assert "in this run mean TTFT" not in _flat(SERVING)
        assert "28.6" not in SERVING and "29.7" not in SERVING


def test_the_pools_lookup_counter_is_one_per_request_and_per_answer_kept() -> None:
    source = (ROOT / "src" / "kvbridge" / "integrations" / "vllm" / "pool_scheduler.py").read_text()
    kept = float(re.search(r"^ANSWER_KEPT_S = ([\d.]+)", source, re.M).group(1))
    flat = _flat(POOL)
    assert "one lookup per request (" not in flat
    assert f"`lookups` counts one per request and per {kept:g} s while vLLM keeps asking about it" in flat
    assert f"for {kept:g} s it gets its first answer again" in flat


def test_the_pool_docs_say_a_restart_of_the_only_lending_instance_empties_it() -> None:
    flat = _flat(POOL)
    assert "so a restarted fleet finds what it stored" not in flat
    assert "restarting the only instance that lends memory empties the pool" in flat
    assert "`--pool start` stops its master with the fleet" in flat
    readme = _flat((ROOT / "README.md").read_text())
    assert "`--pool-secret-file` keeps it across restarts" not in readme


def test_the_standalone_example_serves_the_name_requests_give() -> None:
    block = POOL.split("<!-- the standalone example:", 1)[1].split("```", 2)[1]
    served = (ROOT / "src" / "kvbridge" / "integrations" / "vllm" / "fleet_processes.py").read_text()
    assert '"--served-model-name", "model"' in served  # a kvbridge serve fleet's name, in its curl line
    assert "vllm serve MODEL_DIR --served-model-name model " in _flat(block)


@pytest.mark.parametrize("claim", [
    "on a decode instance of a P/D fleet it also counts the tokens KVBridgeConnector promised",
    "on a decode instance of a P/D fleet it also counts KVBridgeConnector's P/D tokens, so read `hit_tokens` there",
])
def test_vllms_external_hit_counter_is_not_called_the_pools_alone(claim) -> None:
    assert claim in _flat(POOL)

"""The serving tables in the docs are those of the committed `make serve-check` JSON (issue 28
point 6): every generated block equals its rendering from docs/serve-check.json, a changed figure
makes the check fail, the totals are the rows' sums, and the JSON holds no machine path."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("serve_tables", ROOT / "scripts" / "serve_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _strings(data):
    if isinstance(data, dict):
        for k, v in data.items():
            yield k
            yield from _strings(v)
    elif isinstance(data, list):
        for v in data:
            yield from _strings(v)
    elif isinstance(data, str):
        yield data


def test_the_docs_generated_blocks_are_the_committed_json() -> None:
    mod = _tables()
    assert mod.main(["--check"]) == 0, "run: python scripts/serve_tables.py"
    names = {m.group("name") for doc in mod.DOCS for m in mod.BLOCK.finditer(doc.read_text())}
    assert {"faults_table", "faults_summary", "bench", "supervision", "pool", "scale", "scale_pool",
            "pool_transfer"} <= names


def test_a_changed_figure_is_a_stale_block(tmp_path) -> None:
    mod = _tables()
    report = mod.load_report()
    changed = copy.deepcopy(report)
    changed["faults"]["rows"][0]["requests"] += 1
    text = "\n".join(doc.read_text() for doc in mod.DOCS)
    assert mod.render(text, report) == text
    assert mod.render(text, changed) != text
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(changed))
    assert mod.main(["--check", "--json", str(path)]) == 1
    scaled = copy.deepcopy(report)
    scaled["fleet_scale"]["pool"]["rows"][0]["keys_per_s"] += 1
    assert mod.render(text, scaled) != text
    moved = copy.deepcopy(report)
    moved["pool_transfer"]["host_tier"]["rows"][0]["load_vs_copy"] += 0.01
    assert mod.render(text, moved) != text


def test_the_totals_are_the_rows_sums_and_no_path_is_committed() -> None:
    mod = _tables()
    report = json.loads(mod.JSON.read_text())
    rows = report["faults"]["rows"]
    total = mod.fault_totals(report["faults"])
    assert total["requests"] == sum(r["requests"] for r in rows)
    assert total["completed"] == total["equal"] + total["wrong"]
    assert f"{total['wrong']} wrong answers in {total['requests']} requests" in " ".join(mod.faults_summary(report))
    assert not [s for s in _strings(report) if s.startswith("/") or "/tmp/" in s or "/work/" in s]
    assert mod.strip_paths({"work": "/x", "a": [{"log_path": "/y", "b": 1}]}) == {"a": [{"b": 1}]}
    assert mod.strip_paths({"model": "/tmp/x-1/small-llama", "e": "died: /root/.pyenv/lib/tracker.py:254: Warn",
                            "m": "tp=1/b32 -> 2/1"}) == {"model": "small-llama", "e": "died: tracker.py:254: Warn",
                                                        "m": "tp=1/b32 -> 2/1"}


def test_rotation_renders_errors_by_second_and_the_starved_member() -> None:
    mod = _tables()
    report = {"faults": {"date": "2026-01-01", "rotation": [
        {"member": "prefill-1", "clients": 4, "requests": 30, "errors": 3, "last_error_sent_s": 4.5,
         "by_second": [{"second": -1, "sent": 4, "errors": 0}, {"second": 0, "sent": 5, "errors": 3}]},
        {"member": "decode-1", "stopped_s": 60.0, "health_samples": 65, "unhealthy_samples": 0, "requests": 90,
         "errors": 0, "slowest_request_s": 61.2}]}}
    text = "\n".join(mod.rotation(report))
    assert "| second sent (from the kill) | -1 | 0 |" in text and "| failed / sent | 0 / 4 | 3 / 5 |" in text
    assert "3 of 30 requests failed, the last one sent 4.50 s after the kill" in text
    assert "unhealthy by the router in 0 of 65 samples, 0 of 90 requests failed" in text
    assert mod.rotation({"faults": {"date": "x"}}) == ["(this run of `make serve-check` measured no rotation)"]


def test_supervision_renders_each_killed_member() -> None:
    mod = _tables()
    row = {"member": "decode-1", "requests": 40, "errors": 2, "first_error_sent_s": -0.5, "last_error_sent_s": 3.25,
           "failed_10s_after_kill": 0, "sent_10s_after_kill": 30, "back_after_s": 61.5,
           "full_strength_after_s": 64.0, "served_by_new_incarnation_after_s": 65.5, "old_session_left": []}
    report = {"supervision": {"date": "2026-01-01", "cores": 2, "load_avg_at_start": [1.0, 2.0, 3.0],
                              "start_s": 70.2, "rows": [row, dict(row, member="master", errors=0,
                                                                  first_error_sent_s=None, last_error_sent_s=None,
                                                                  served_by_new_incarnation_after_s=None)]}}
    text = "\n".join(mod.supervision(report))
    assert "| decode-1 | 40 | 2 | -0.5 .. 3.25 | 0 / 30 | 61.5 | 64.0 | 65.5 | 0 processes |" in text
    assert "| master | 40 | 0 | - | 0 / 30 | 61.5 | 64.0 | - | 0 processes |" in text
    assert "started in 70 s" in text
    assert mod.supervision({}) == ["(this run of `make serve-check` measured no supervision)"]


def test_the_step_path_table_renders_each_call_and_the_sidecars_cpu() -> None:
    mod = _tables()
    prof = {"seconds": 71.2, "calls": {
        "get_finished": {"calls": 300, "p50_ms": 0.027, "p99_ms": 0.48, "max_ms": 8.7, "total_ms": 19.8},
        "sidecar": {"calls": 79, "p50_ms": 1.0, "p99_ms": 9.0, "max_ms": 9.9, "total_ms": 120.0, "cpu_ms": 107.4,
                    "max_cpu_ms": 9.9}}}
    text = "\n".join(mod._step_path({"table": [{"dataset": "prefix_repetition", "kvbridge": {"step_path": prof}}]}))
    assert "| prefix repetition | 71.2 | workers: `get_finished` | 300 | 0.027 | 0.480 | 8.7 | 19.8 ms |" in text
    assert "|  |  | sidecar rounds that used CPU (CPU ms) | 79 | - | - | 9.9 | 107 ms |" in text
    assert mod._step_path({"table": [{"dataset": "random", "kvbridge": {}}]}) == []


def test_json_naming_the_machine_is_refused_and_strip_paths_clears_it(tmp_path) -> None:
    mod = _tables()
    report = json.loads(mod.JSON.read_text())
    for leak in ({"host": "build-box-3"}, {"work": "/tmp/kvbridge-serve-x"}, {"model": "/root/models/small-llama"}):
        bad = copy.deepcopy(report)
        bad["bench"][0].update(leak)
        path = tmp_path / "leaky.json"
        path.write_text(json.dumps(bad))
        assert mod.main(["--check", "--json", str(path)]) == 1, leak
        path.write_text(json.dumps(mod.strip_paths(bad)))
        assert mod.main(["--check", "--json", str(path)]) == 0, leak


def test_a_run_with_rounds_renders_each_round_and_the_rounds_ahead() -> None:
    """Issue 46.2: the bench's per-round figures and `rounds_ahead` reach the docs' table."""
    from kvbridge.bench.serving import rounds_ahead, summarize
    mod = _tables()

    def rnd(p99: float) -> dict:
        return {"mean_ttft_ms": p99 / 2, "median_ttft_ms": p99, "p99_ttft_ms": p99, "output_throughput": 10.0,
                "completed": 64, "failed": 0, "itls_ms": [10.0] * 100, "steps_ms": [], "host": {}}

    k, n = summarize([rnd(100), rnd(300)]), summarize([rnd(200), rnd(250)])
    lines = mod._rounds({"table": [{"dataset": "random", "kvbridge": k, "nixl": n, "rounds_ahead": rounds_ahead(k, n)}]})
    row = next(line for line in lines if "TTFT p99" in line)
    assert "100 / 200 300 / 250" in row and row.endswith("| 1 of 2 |")
    assert mod._rounds({"table": [{"dataset": "random", "kvbridge": k, "nixl": n}]}) == []  # older runs: medians only

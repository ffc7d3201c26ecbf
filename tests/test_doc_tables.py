"""The docs' figure tables outside the serving runs are renderings of committed JSON (issue 43
point 6): every `figures` block equals its rendering, a changed figure makes it stale, and the
check refuses JSON holding a machine path or name (scripts/doc_tables.py, scripts/doc_blocks.py);
and no table of measured figures in README.md or docs/*.md sits outside a generated block, but for
a short allow-list of tables that hold no measurement, each with its reason."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tables():
    return _script("doc_tables")


def _docs_text(mod) -> str:
    return "\n".join(doc.read_text() for doc in mod.DOCS)


def test_every_generated_block_is_the_committed_json(tables) -> None:
    assert tables.main(["--check"]) == 0, "run: python scripts/doc_tables.py"
    names = [m.group("name") for doc in tables.DOCS for m in tables.BLOCK.finditer(doc.read_text())]
    assert sorted(names) == sorted(tables.RENDER), "every renderer has one block, every block a renderer"


def _first_figure(record: dict) -> tuple[list, int]:
    """The row and index of a transcribed table's first numeric cell (else its first cell after the label)."""
    for row in record["rows"]:
        for i, v in enumerate(row):
            if isinstance(v, (int, float)):
                return row, i
    return record["rows"][0], 1


def test_a_changed_figure_is_a_stale_block(tables, tmp_path) -> None:
    data = tables.load()
    text = _docs_text(tables)
    assert tables.render(text, data) == text
    changes = []
    for name, (source, key) in tables.TRANSCRIBED.items():
        changed = copy.deepcopy(data)
        row, i = _first_figure(changed[source][key])
        row[i] = row[i] + 1 if isinstance(row[i], (int, float)) else row[i] + " (edited)"
        changes.append((name, changed))
    for name, path, bump in (("reliability_soak", ("soak", 0, "seconds"), 0.5),
                             ("reliability_multiprocess_soak", ("multiprocess_soak", 1, "per_process", 0, "fds", 0), 1),
                             ("reliability_cli", ("cli_bounds", 0, "exit"), 1),
                             ("reliability_bad_inputs", ("garbage_frames", "refused"), -1),
                             ("security_checksum", None, 0.001)):
        changed = copy.deepcopy(data)
        if path is None:
            changed["security"]["checksum"]["rows"][0]["transfer_seconds"] += bump
        else:
            *parents, last = path
            node = changed["reliability"]
            for p in parents:
                node = node[p]
            node[last] += bump
        changes.append((name, changed))
    for name, changed in changes:
        assert tables.render(text, changed) != text, name
    lost = copy.deepcopy(data)
    lost["reliability"]["soak"][0]["failed"] = 3
    lost["reliability"]["soak"][0]["failures"] = ["req-7: side channel lost"]
    rendered = tables.render(text, lost)
    assert "- FAILED in-process shm: req-7: side channel lost" in rendered
    assert "3 soak requests failed or did not complete: see above." in rendered
    # the same through the command line: a JSON directory with one changed figure
    for name in tables.SOURCES:
        shutil.copy(ROOT / "docs" / f"{name}.json", tmp_path / f"{name}.json")
    assert tables.main(["--check", "--json-dir", str(tmp_path)]) == 0
    gpu = json.loads((tmp_path / "gpu.json").read_text())
    gpu["h100"]["rows"][3][1] = gpu["h100"]["rows"][3][1].replace("0.92", "0.93")
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    assert tables.main(["--check", "--json-dir", str(tmp_path)]) == 1


@pytest.mark.parametrize("leak", [
    {"work": "/tmp/kvbridge-abc"}, {"model": "/root/models/small-llama"}, {"hostname": "gpu-node-7"},
    {"host": "gpu-node-7"}, {"note": "ran on gpu-node-7 overnight"}, {"url": "http://10.1.2.3:8000/v1"}])
def test_json_with_a_machine_path_or_name_is_refused(tables, tmp_path, monkeypatch, leak) -> None:
    blocks = sys.modules.get("doc_blocks") or _script("doc_blocks")
    monkeypatch.setattr(blocks.socket, "gethostname", lambda: "gpu-node-7")
    for name in tables.SOURCES:
        shutil.copy(ROOT / "docs" / f"{name}.json", tmp_path / f"{name}.json")
    pool = json.loads((tmp_path / "pool-bench.json").read_text())
    pool["phases"].update(leak)
    (tmp_path / "pool-bench.json").write_text(json.dumps(pool))
    before = _docs_text(tables)
    assert tables.main(["--json-dir", str(tmp_path)]) == 1  # refused, and nothing written
    assert tables.main(["--check", "--json-dir", str(tmp_path)]) == 1
    assert _docs_text(tables) == before
    stripped = blocks.strip_paths(pool)
    if "note" not in leak and "url" not in leak:  # free text naming the host or an address: refused, not rewritten
        assert blocks.leaks(stripped) == []


def test_leaks_keeps_what_a_figure_is_about(tables) -> None:
    blocks = sys.modules.get("doc_blocks") or _script("doc_blocks")
    fine = {"attempt": "authenticated Hello naming /etc/passwd",
            "outcome": "shm segment '/dev/shm/../kvbridge-2918-other-351ddc257a3a' refused "
                       "(/dev/shm/kvbridge-PID-TAG-HEX)",
            "error": "HTTP 500: Decode request failed to http://127.0.0.1:26012/v1/completions",
            "shape": "tp=1/b32 -> 2/1", "gpu": "driver 580.159.04, PyTorch 2.11.0+cu130"}
    assert blocks.leaks(fine, hostname="vm") == []
    assert blocks.strip_paths(fine) == fine
    assert blocks.leaks({"a": ["/home/me/x/y"]}, hostname="vm") == ["a[0]: path '/home/me/x/y'"]
    for name in tables.SOURCES:  # the committed JSON, also against this machine's name
        assert blocks.leaks(json.loads((ROOT / "docs" / f"{name}.json").read_text())) == [], name


def test_the_reliability_report_writes_the_record_the_blocks_render(tables) -> None:
    report = _script("reliability_report")
    mib = 1 << 20
    raw = {"transport": "shm", "requests": 10, "in_flight": 4, "completed": 10, "ok": 9, "failed": 1,
           "failures": ["r3: checksum mismatch"], "bytes": 3 * mib, "checksums_verified": 9, "releases": 20,
           "released_twice": 0, "samples": [{"rss": 300 * mib, "fds": 40}, {"rss": 301.26 * mib, "fds": 41}],
           "before": {"fds": 10}, "after": {"fds": 11}, "seconds": 1.234}
    mp = {**raw, "processes": 3, "never_released": 0, "shm_samples": [3, 2, 3], "shm_after": 0,
          "samples": {"prefill 0": [{"rss": 250 * mib, "fds": 29}, {"rss": 250.5 * mib, "fds": 30}]}}
    rel = {"date": "2026-01-01", "cores": 2, "command": "scripts/reliability_report.py --requests 10",
           "soak": [report.soak_record(raw)], "multiprocess_soak": [report.multiprocess_record(mp)],
           "fuzz": report.fuzz_record(None, 10, 1, "atheris is not installed"),
           "garbage_frames": {"sent": 4, "kinds": {"random": 4}, "refused": 4, "aborts_counted": 0, "after_ok": True,
                              "after_reason": ""},
           "forged_peer": {"rows": [["wrong key", "refused: bad HMAC"]], "failed": None},
           "cli_bounds": [{"command": "kvbridge plan x.json", "exit": 2, "seconds": 0.41, "output": "error: x"}]}
    data = {"reliability": json.loads(json.dumps(rel))}
    soak = "\n".join(tables.reliability_soak(data))
    assert ("| shm | 10 | 4 | 9 | 1 | 3.0 MiB | 9 | 20 (0) | 300.0 MiB → 301.3 MiB | 40 → 41 | 10 → 11 | 1.2 |"
            in soak)
    assert "- FAILED in-process shm: r3: checksum mismatch" in soak
    mps = "\n".join(tables.reliability_multiprocess_soak(data))
    assert "| 3 + parent | 10 | 4 | 9 | 1 | 3.0 MiB | 9 | 20 (0, 0) | 2/3 → 0 | 1.2 |" in mps
    assert "| shm | prefill 0 | 250.0 / 250.5 | 29 / 30 |" in mps
    assert "| `kvbridge plan x.json` | 2 | 0.4 | error: x |" in tables.reliability_cli(data)
    assert tables.reliability_bad_inputs(data)[1].startswith("- atheris fuzzing of the side-channel decoder: not run")
    assert tables.reliability_lost(data) == ["2 soak requests failed or did not complete: see above."]
    assert not tables.report_ok(rel)


HAND_WRITTEN_ALLOWED = {
    ("README.md", "| command | what it does |"):
        "what each command does: the bounds and defaults it applies (5 s out of the router's rotation, a few "
        "seconds for 1M tokens) are the code's, not a run's",
    ("pool.md", "| case | what happens | test |"):
        "test outcomes: each row is what the named test asserts (the deadlines are the ones the test sets)",
    ("pool.md", "| what | where | result |"):
        "test outcomes: each row's result is asserted by the test it names",
    ("pool.md", "| counters | what to read from them |"):
        "what each metric counts: its periods are the code's constants (ANSWER_KEPT_S)",
}
"""Tables outside generated blocks that read as figures but are not a run's measurements, each
with the reason. Everything else that holds measured figures is rendered from committed JSON."""


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _figure_tables(blocks, text: str) -> list[tuple[int, str]]:
    return [(line, head) for line, head, rows in blocks.tables_outside_blocks(text) if blocks.holds_figures(rows)]


def test_no_figure_table_is_written_by_hand() -> None:
    """Issue 43 point 6: every table of measured figures in README.md and docs/*.md sits in a
    generated block (`figures`, `serve-check`) rendered from committed JSON, so a stale figure fails
    `test_every_generated_block_is_the_committed_json`; a table of figures written into the markdown
    outside one fails here. (Before scripts/doc_tables.py, at 30f1a4d, this named 19 tables of
    docs/gpu.md, pool.md, reliability.md, security.md, transports.md and vllm.md.)"""
    blocks = sys.modules.get("doc_blocks") or _script("doc_blocks")
    found, seen = [], set()
    for doc in _docs():
        for line, head in _figure_tables(blocks, doc.read_text()):
            if (doc.name, head) in HAND_WRITTEN_ALLOWED:
                seen.add((doc.name, head))
            else:
                found.append(f"{doc.relative_to(ROOT)}:{line}: {head[:100]}")
    assert not found, ("tables of figures outside generated blocks (render them from committed JSON: "
                       "scripts/doc_tables.py; or allow-list one that holds no measurement, with the reason):\n  "
                       + "\n  ".join(found))
    assert seen == set(HAND_WRITTEN_ALLOWED), f"allow-listed tables no longer there: {set(HAND_WRITTEN_ALLOWED) - seen}"


def test_the_figure_table_check_sees_a_hand_written_table_and_spares_generated_ones() -> None:
    blocks = sys.modules.get("doc_blocks") or _script("doc_blocks")
    table = ("| path | store vs copy | load vs copy |\n|---|---|---|\n| host tier | 0.097 | 0.124 |\n"
             "| Mooncake | 0.048 | 0.050 |\n")
    timed = "| step | time |\n|---|---|\n| plan | 17 ms |\n| copy | 25 ms |\n"
    config = "| key | default | meaning |\n|---|---|---|\n| `block_tokens` | 64 | the pool's block |\n"
    assert [h for _, h in _figure_tables(blocks, f"# Doc\n\n{table}\ntext\n\n{timed}\n{config}")] == [
        "| path | store vs copy | load vs copy |", "| step | time |"]
    generated = f"<!-- figures: pool_phases -->\n{table}<!-- /figures -->\n<!-- serve-check: bench -->\n{timed}" \
                "<!-- /serve-check -->\n"
    fenced = f"```\n{table}```\n"
    versions = "| package | version |\n|---|---|\n| mooncake | 0.3.13 |\n| vllm | 0.32.0 |\n| nixl | 1.5.1 |\n"
    assert _figure_tables(blocks, generated + fenced + versions) == []

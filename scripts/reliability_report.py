"""Measure docs/reliability.md's figures with the same bounded scenarios CI runs.

    .venv/bin/python scripts/reliability_report.py [--requests N] [--fuzz-runs N --fuzz-seconds S] [--json PATH]

It writes the record, without machine paths or names, to docs/reliability.json, from which
scripts/doc_tables.py renders the generated blocks of docs/reliability.md (it runs it); the
prose around them is the doc's own.

The scenarios are the functions in `kvbridge.testing.reliability` that
tests/connector/test_connector_soak.py, test_connector_soak_multiprocess.py and
test_connector_reliability_report.py call, and the atheris runner of tests/fuzz/fuzz_messages.py
that tests/fuzz/test_fuzz_messages.py calls.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time

from kvbridge.testing.reliability import garbage_frames, multiprocess_soak, soak
from kvbridge.connector.transports import unavailable_reason

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import doc_blocks  # noqa: E402  (scripts/ is not a package)
import doc_tables  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
JSON = os.path.join(ROOT, "docs", "reliability.json")


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_messages", os.path.join(ROOT, "tests", "fuzz",
                                                                                "fuzz_messages.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FUZZ = _fuzz_module()
SCENARIOS = {"soak": soak, "multiprocess_soak": multiprocess_soak, "garbage_frames": garbage_frames,
             "atheris": FUZZ.run_atheris}
"""What this sheet runs; a test checks these are the functions the CI tests import."""


def _mib(n: int) -> float:
    return round(n / (1 << 20), 1)


def _security_rows() -> tuple[list[tuple[str, str]] | None, str]:
    """The forged-peer test's rows (it writes them when KVBRIDGE_SECURITY_REPORT names a file)."""
    import json
    import subprocess
    with tempfile.TemporaryDirectory(prefix="kvbridge-security-") as tmp:
        out = os.path.join(tmp, "rows.json")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            os.path.join(ROOT, "tests", "security", "test_forged_peer.py")],
                           env={**os.environ, "KVBRIDGE_SECURITY_REPORT": out}, capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0 or not os.path.exists(out):
            return None, (r.stdout + r.stderr).strip().splitlines()[-1:][0] if (r.stdout + r.stderr).strip() else "?"
        return [tuple(x) for x in json.load(open(out))], ""


def _cli_bound_rows() -> list[dict]:
    """Absurd command-line values and configs, as a user types them: exit code, seconds, the line."""
    import json
    import subprocess
    kvbridge = os.path.join(os.path.dirname(sys.executable), "kvbridge")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-bounds-") as tmp:
        configs = {"nan.json": '{"model_type": "llama", "num_hidden_layers": NaN}', "list.json": "[1, 2]",
                   "deep.json": '{"a":' * 5000 + "1" + "}" * 5000,
                   "huge.json": json.dumps({"model_type": "llama", "num_hidden_layers": 10 ** 6, "hidden_size": 64,
                                            "num_attention_heads": 4})}
        for name, text in configs.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        cases = [["plan", "llama-3-8b", "--decode-tp", "1000000"], ["plan", "llama-3-8b", "--tokens", "100000000"],
                 ["demo", "--prompt-len", "100000"], ["verify", "--cases", "100000000"],
                 *[["plan", os.path.join(tmp, name)] for name in configs]]
        for args in cases:
            t0 = time.monotonic()
            r = subprocess.run([kvbridge, *args], capture_output=True, text=True, timeout=120)
            lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
            shown = " ".join(a if not a.startswith(tmp) else os.path.basename(a) for a in args)
            line = lines[0].replace(tmp + "/", "") if len(lines) == 1 else f"{len(lines)} lines"
            rows.append({"command": f"kvbridge {shown}", "exit": r.returncode,
                         "seconds": round(time.monotonic() - t0, 2), "output": line})
    return rows


def soak_record(r: dict) -> dict:
    """One in-process soak as docs/reliability.json keeps it (MiB to one decimal, as the table shows)."""
    s0, s1 = r["samples"][0], r["samples"][-1]
    return {"transport": r["transport"], "requests": r["requests"], "in_flight": r["in_flight"],
            "completed": r["completed"], "ok": r["ok"], "failed": r["failed"], "bytes_mib": _mib(r["bytes"]),
            "checksums_verified": r["checksums_verified"], "releases": r["releases"],
            "released_twice": r["released_twice"], "rss_mib_first_quarter": _mib(s0["rss"]),
            "rss_mib_last_quarter": _mib(s1["rss"]), "fds_first_quarter": s0["fds"], "fds_last_quarter": s1["fds"],
            "fds_before": r["before"]["fds"], "fds_after": r["after"]["fds"], "seconds": round(r["seconds"], 2),
            "failures": r["failures"][:3]}


def multiprocess_record(r: dict) -> dict:
    """One multi-process soak as docs/reliability.json keeps it, with each process's quarters."""
    return {"transport": r["transport"], "processes": r["processes"], "requests": r["requests"],
            "in_flight": r["in_flight"], "completed": r["completed"], "ok": r["ok"], "failed": r["failed"],
            "bytes_mib": _mib(r["bytes"]), "checksums_verified": r["checksums_verified"], "releases": r["releases"],
            "released_twice": r["released_twice"], "never_released": r["never_released"],
            "shm_in_run": sorted(set(r["shm_samples"])), "shm_after": r["shm_after"], "seconds": round(r["seconds"], 2),
            "failures": r["failures"][:3],
            "per_process": [{"process": name, "rss_mib": [_mib(x["rss"]) for x in samples],
                             "fds": [x["fds"] for x in samples]} for name, samples in r["samples"].items()]}


def fuzz_record(fz: dict | None, runs: int, seconds: int, not_run: str | None = None) -> dict:
    """The atheris run as docs/reliability.json keeps it; `fz` None: not run, for the reason `not_run`."""
    bounds = {"runs_bound": runs, "seconds_bound": seconds}
    if fz is None:
        return {**bounds, "not_run": not_run or "not run"}
    return {**bounds, "not_run": None, "runs": fz["runs"], "seconds": fz["seconds"],
            "wall_seconds": round(fz["wall_seconds"], 1), "rc": fz["rc"], "hung": fz["hung"], "crashes": fz["crashes"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000, help="requests of each soak (CI: 2000)")
    ap.add_argument("--fuzz-runs", type=int, default=50000, help="atheris inputs (CI: 50000)")
    ap.add_argument("--fuzz-seconds", type=int, default=20, help="atheris time bound (CI: 20)")
    ap.add_argument("--json", default=JSON, help="where the record goes (default docs/reliability.json, whose "
                    "docs' blocks are then rendered again; elsewhere, the blocks are printed)")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    record = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
              "load_avg_at_start": round(os.getloadavg()[0], 1),
              "command": f"scripts/reliability_report.py --requests {args.requests} --fuzz-runs {args.fuzz_runs} "
                         f"--fuzz-seconds {args.fuzz_seconds}"}
    kinds = ("shm", "mooncake" if unavailable_reason("mooncake") is None else "nixl")
    record["soak"] = [soak_record(soak(kind, args.requests, 64)) for kind in kinds]
    record["multiprocess_soak"] = [multiprocess_record(multiprocess_soak(kind, args.requests, 64)) for kind in kinds]
    with tempfile.TemporaryDirectory(prefix="kvbridge-fuzz-") as tmp:
        fz = FUZZ.run_atheris(args.fuzz_runs, args.fuzz_seconds, tmp) if FUZZ.atheris_unavailable() is None else None
    record["fuzz"] = fuzz_record(fz, args.fuzz_runs, args.fuzz_seconds, FUZZ.atheris_unavailable())
    g = garbage_frames(500)
    record["garbage_frames"] = {k: g[k] for k in ("sent", "kinds", "refused", "aborts_counted", "after_ok",
                                                  "after_reason")}
    sec_rows, sec_why = _security_rows()
    record["forged_peer"] = {"rows": [list(x) for x in sec_rows] if sec_rows else [], "failed": sec_why or None}
    record["cli_bounds"] = _cli_bound_rows()
    record = doc_blocks.strip_paths(record)
    leaks = doc_blocks.leaks(record)
    if leaks:  # strip_paths leaves a host name in free text: say where, write nothing
        print("not written, machine names in the record:\n  " + "\n  ".join(leaks), file=sys.stderr)
        return 1
    with open(args.json, "w") as f:
        f.write(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    if os.path.abspath(args.json) == os.path.abspath(JSON):
        doc_tables.main([])
    else:
        data = {**doc_tables.load(), "reliability": record}
        for name in doc_tables.RENDER:
            if name.startswith("reliability_"):
                print(f"<!-- figures: {name} -->", *doc_tables.RENDER[name](data), "<!-- /figures -->", sep="\n")
    return 0 if doc_tables.report_ok(record) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`make serve-check`: kvbridge serve's fleet through edge cases, churn, faults and starvation
(kvbridge.testing.serve_check), then a supervised fleet losing each kind of member under load
(kvbridge.testing.supervision), then the serving benchmark beside vLLM's NixlConnector
(`kvbridge bench --serve`), then the shared pool's (`kvbridge.bench.pool`); prints the tables and
writes them as one JSON without machine paths, from which scripts/serve_tables.py renders the
docs' tables (copy it to docs/serve-check.json, then run that script)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="serve-check.json")
    parser.add_argument("--quick", action="store_true", help="edge cases and one load only")
    parser.add_argument("--work", default=None, help="keep the fleet's logs here")
    parser.add_argument("--skip-faults", action="store_true", help="only the benchmark")
    parser.add_argument("--skip-supervision", action="store_true", help="no supervised fleet")
    parser.add_argument("--skip-bench", action="store_true", help="no serving benchmark")
    parser.add_argument("--skip-pool", action="store_true", help="no pool benchmark")
    args = parser.parse_args(argv)
    from kvbridge.bench import exit_on_sigterm

    exit_on_sigterm()  # a killed run still stops what it started
    console = Console(width=160)
    report: dict = {}
    bad = False
    if not args.skip_faults:
        from kvbridge.testing.serve_check import run
        result = run(Path(args.work) / "faults" if args.work else None, quick=args.quick)
        report["faults"] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cores": os.cpu_count(), **result}
        table = Table(title="kvbridge serve: 2 prefill x 2 decode instances of four shapes behind vllm-router")
        cols = ("phase", "requests", "completed", "equal", "wrong", "errors", "kv_loads", "recomputed", "seconds")
        for col in cols:
            table.add_column(col)
        for r in result["rows"]:
            table.add_row(*(str(r[c]) if r[c] is not None else "-" for c in cols))
        console.print(table)
        for r in result.get("rotation", []):
            if "by_second" in r:
                console.print(f"{r['member']} SIGKILLed under a load of {r['clients']} clients; errors by the second "
                              f"each request was sent (relative to the kill): "
                              + ", ".join(f"{b['second']}: {b['errors']}/{b['sent']}" for b in r["by_second"]))
            else:
                console.print(f"{r['member']} stopped (SIGSTOP) for {r['stopped_s']:.0f} s under load: unhealthy in "
                              f"{r['unhealthy_samples']} of {r['health_samples']} router samples, {r['errors']} "
                              f"errors in {r['requests']} requests, slowest {r['slowest_request_s']} s")
        console.print(f"after stop: {result['leaks']}  (logs: {result['work']})")
        bad |= any(r.get("unhealthy_samples") or (r.get("last_error_sent_s") or 0) > 10
                   for r in result.get("rotation", []))
        bad |= any(r["wrong"] for r in result["rows"]) or any(result["leaks"].get(k) for k in
                                                             ("processes_left", "segments_left", "ports_left"))
    if not args.skip_supervision:
        import tempfile
        from kvbridge.testing.supervision import run_supervision
        sup = Path(args.work) / "supervision" if args.work else Path(tempfile.mkdtemp(prefix="kvbridge-supervision-"))
        report["supervision"] = run_supervision(sup)
        for r in report["supervision"]["rows"]:
            console.print(json.dumps({k: v for k, v in r.items() if k != "error_samples"}))
        bad |= any(r["failed_10s_after_kill"] or not r["full_strength"] or r["old_session_left"]
                   for r in report["supervision"]["rows"])
    if not args.skip_bench:
        from kvbridge.bench.serving import bench_serve
        from kvbridge.cli.bench import serve_table
        report["bench"] = []
        for p, d in (("tp=1,block=32", "tp=2,block=32"), ("tp=1,block=64", "tp=2,block=32")):
            b = bench_serve(prefill=p, decode=d, work=Path(args.work) / f"bench-{p}-{d}" if args.work else None)
            report["bench"].append(b)
            serve_table(b)
    if not args.skip_pool:
        from kvbridge.bench.pool import bench_pool_serve, bench_pool_transfer
        report["pool"] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cores": os.cpu_count(),
                          "transfer": bench_pool_transfer(), "serve": bench_pool_serve(prompts=16)}
        console.print(json.dumps(report["pool"]["transfer"]))
    from serve_tables import strip_paths
    Path(args.out).write_text(json.dumps(strip_paths(report), indent=2) + "\n")
    console.print(f"JSON: {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

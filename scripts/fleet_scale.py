"""`make fleet-scale`: a fleet's per-rank cost as it grows (kvbridge.bench.fleet_scale) and the
pool's lookup rate against one mooncake_master (kvbridge.bench.pool_lookups), into one JSON.

Why a script: the scans spawn crowd processes and take minutes on a small host, so they are not
part of `kvbridge bench`; docs/serving.md ("Scale") quotes the JSON this writes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fleet-scale.json")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--max-engines", type=int, default=64)
    ap.add_argument("--crowds", type=int, default=4)
    ap.add_argument("--skip", action="append", default=[], choices=["decode", "prefill", "pool"])
    ap.add_argument("--pool-seconds", type=float, default=3.0)
    args = ap.parse_args()
    from kvbridge.bench import exit_on_sigterm

    exit_on_sigterm()  # a killed run still stops what it started
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the crowd processes inherit it
    from kvbridge.bench.fleet_scale import STEPS, decode_scan, prefill_scan, zmq_caps
    steps = tuple(s for s in STEPS if s <= args.max_engines)
    out = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
           "load_average_at_start": os.getloadavg(), "python": platform.python_version(),
           "nofile_soft_limit": [soft, hard], "tp": args.tp, "steps": steps}
    out["zmq_caps"] = zmq_caps()
    for side, scan in (("decode", decode_scan), ("prefill", prefill_scan)):
        if side in args.skip:
            continue
        t0 = time.monotonic()
        out[side] = scan(steps, tp=args.tp, crowds=args.crowds).as_dict()
        out[side]["wall_s"] = round(time.monotonic() - t0, 1)
        print(f"{side} scan: {out[side]['wall_s']} s", file=sys.stderr, flush=True)
        _write(args.out, out)
    if "pool" not in args.skip:
        from kvbridge.bench.pool_lookups import lookup_rates
        out["pool"] = lookup_rates(seconds=args.pool_seconds)
        _write(args.out, out)
    print(json.dumps(out, indent=1))
    return 0


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())

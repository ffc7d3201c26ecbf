"""`make pool-bench`: the shared pool's benchmarks (kvbridge.bench.pool), written as JSON.

Store/load GB/s beside a contiguous copy, then the shared-prefix serving comparison (plain prefix
caching, the kvbridge pool, vLLM's CPU offload) on two `vllm serve` instances of different shapes,
then every prompt a new prefix, random prompts, and 256-token replies (A stores while it decodes). About 35-45 minutes on a 2-core
machine; docs/pool.md holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("pool-bench.json"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--skip-serve", action="store_true", help="only the transfer benchmark")
    args = ap.parse_args()
    from kvbridge.bench import exit_on_sigterm

    exit_on_sigterm()  # a killed run still stops what it started
    from kvbridge.bench.pool import bench_pool_serve, bench_pool_transfer

    out = {"transfer": bench_pool_transfer()}
    print(json.dumps(out["transfer"]), flush=True)
    if not args.skip_serve:
        # Repeated prefixes on a 6-layer model (B's own prefix cache takes most hits), with vLLM's
        # CPU offload beside; then every prompt the first of its prefix, on a 12-layer model.
        out["serve"] = bench_pool_serve(prompts=args.prompts)
        print(json.dumps(out["serve"]["rows"]), flush=True)
        out["serve_distinct"] = bench_pool_serve(prompts=8, concurrency=1, num_prefixes=8, layers=12, heads=16,
                                                 setups=("prefix cache only", "kvbridge pool"))
        print(json.dumps(out["serve_distinct"]["rows"]), flush=True)
        # Random prompts (vllm bench serve's random dataset): no shared prefix at all.
        out["serve_random"] = bench_pool_serve(prompts=args.prompts, dataset="random",
                                               setups=("prefix cache only", "kvbridge pool"))
        print(json.dumps(out["serve_random"]["rows"]), flush=True)
        # 256-token replies: A stores each request's blocks while it decodes, beside A without the pool.
        out["serve_long_decode"] = bench_pool_serve(prompts=args.prompts, output_len=256,
                                                    setups=("prefix cache only", "kvbridge pool"))
        print(json.dumps(out["serve_long_decode"]["rows"]), flush=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep every causal-LM architecture through the canonical pool (`kvbridge.proofs.pool_sweep`) and
print one line per architecture and the counts; exit 1 if any moved bytes or tokens wrong (or a
row errs). `make pool-zoo`.

    python scripts/pool_zoo.py [--only mamba,llama] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model_types (default: all)")
    ap.add_argument("--json", default="", help="also write the rows as JSON here")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per architecture")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers.utils.logging as hf_logging
    from rich.progress import track

    from kvbridge.proofs.model_sweep import chosen_types, unknown_types_error
    from kvbridge.proofs.pool_sweep import pool_sweep_one

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    archs, unknown = chosen_types(args.only)
    if unknown:
        print(unknown_types_error(unknown), file=sys.stderr)
        return 2
    t0, rows = time.perf_counter(), []
    for arch in track(archs, description="pool zoo", transient=True, disable=not sys.stderr.isatty()):
        row = pool_sweep_one(arch, timeout=args.timeout)
        rows.append(row)
        print(f"{row.status:10s} {arch:32s} {','.join(row.pairs):24s} {row.kinds[:60]:60s} {row.detail[:160]}",
              flush=True)
    counts = Counter(r.status for r in rows)
    print(f"{len(rows)} architectures in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{n} {s}" for s, n in counts.most_common()))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if counts.get("mismatch") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())

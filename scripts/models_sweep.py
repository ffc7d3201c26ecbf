"""Sweep every causal-LM architecture of the installed transformers through the transformers proof
and write docs/models.md (see `kvbridge.proofs.model_sweep`). `make models` runs it.

    python scripts/models_sweep.py [--only llama,mistral] [--out docs/models.md] [--json rows.json]
    python scripts/models_sweep.py --only mamba,dbrx   # re-run a few, keep the other rows of docs/models.md

`--only` with an `--out` of your own writes those rows alone unless `--merge` is given. A merge keeps
the stray-field section of the last full run (the re-run architectures' stray cases are printed).

After the proofs, every moved architecture is swept again with stray fields (a sibling
architecture's fields added to its config, `kvbridge.proofs.stray_sweep`): plan's geometry must be
what the model builds. `--no-strays` skips that; a stray case that differs fails the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model_types (default: all)")
    ap.add_argument("--out", default="", help="the table to write (default docs/models.md; with --only, merged)")
    ap.add_argument("--json", default="", help="also write the rows as JSON here")
    ap.add_argument("--from-json", default="", help="render the rows of an earlier --json run, run nothing")
    ap.add_argument("--merge", action="store_true",
                    help="with --only: replace those rows in the existing --out, keep the others")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per architecture")
    ap.add_argument("--no-strays", action="store_true",
                    help="skip the stray-field sweep (every moved architecture with a sibling's fields added)")
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    import transformers
    import transformers.utils.logging as hf_logging

    from kvbridge.proofs.model_sweep import SweepRow, chosen_types, sweep_one, unknown_types_error
    from kvbridge.proofs.sweep_report import parse_markdown, render_markdown

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    archs, unknown = chosen_types(args.only)
    if unknown and not args.from_json:
        print(unknown_types_error(unknown), file=sys.stderr)
        return 2
    if not args.out:  # a few rows re-run never replace the whole table
        args.out = str(Path(__file__).resolve().parents[1] / "docs" / "models.md")
        args.merge = args.merge or bool(args.only)
    t0 = time.perf_counter()
    rows = []
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        if isinstance(saved, list):  # rows only: the time is their sum
            saved = {"rows": saved, "seconds": sum(r["seconds"] for r in saved)}
        rows = [SweepRow(**r) for r in saved["rows"]]
        t0 -= saved["seconds"]
        archs = []
        from kvbridge.proofs.stray_sweep import StrayRow
        saved_strays = [StrayRow(**r) for r in saved.get("strays", [])]
    for arch in archs:
        row = sweep_one(arch, timeout=args.timeout)
        rows.append(row)
        print(f"{arch:28s} {row.status:8s} {row.seconds:6.1f}s {row.kinds} {row.detail}", flush=True)
    seconds = time.perf_counter() - t0
    if args.merge and Path(args.out).is_file():
        kept, kept_seconds = parse_markdown(Path(args.out).read_text())
        ran = {r.arch: r for r in rows}
        rows = [ran.pop(r.arch, r) for r in kept] + list(ran.values())
        seconds += kept_seconds - sum(r.seconds for r in kept if r.arch in archs)
    strays = saved_strays if args.from_json else []
    if not args.no_strays and not args.from_json:  # the geometry plan prints must be what the model builds, whatever fields it carries
        from kvbridge.proofs.stray_sweep import sweep_strays
        only = set(args.only.split(",")) if args.only else None  # --only: those architectures' cases alone
        strays = sweep_strays([r.arch for r in rows if r.status == "moved" and (only is None or r.arch in only)],
                              echo=lambda r: print(
            f"{r.arch:28s} +{r.group:10s} {r.status:11s} {r.seconds:6.1f}s {r.detail}", flush=True))
    text = render_markdown(rows, transformers.__version__, seconds, strays)
    head = "## Stray fields"
    if args.merge and args.only and Path(args.out).is_file() and head in (old := Path(args.out).read_text()):
        # The section counts every architecture's cases, and the few re-run here are not all of them:
        # it stays as the last full run wrote it (their rows were printed above; a mismatch fails the run).
        text = text.split(head)[0].rstrip("\n") + "\n\n" + head + old.split(head, 1)[1]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"seconds": seconds, "rows": [r.to_dict() for r in rows],
                                               "strays": [r.to_dict() for r in strays]}, indent=1))
    bad = [r.arch for r in rows if r.status == "mismatch"]
    bad += [f"{r.arch}+{r.group}" for r in strays if r.status in ("mismatch", "refused", "error")]
    print(f"{len(rows)} architectures in {seconds:.0f} s; wrote {args.out}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

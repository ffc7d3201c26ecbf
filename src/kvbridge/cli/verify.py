"""`kvbridge verify`: random legal shape pairs, every destination byte checked."""

from __future__ import annotations

import random

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvbridge.cli.app import app, check_bounds, console, err_console, friendly_errors, print_json


@app.command()
@friendly_errors
def verify(
    cases: int = typer.Option(200, min=1, help="Random shape pairs to check."),
    seed: int = typer.Option(0),
    checksum: bool = typer.Option(False, help="Also check the end-to-end request checksum, on every axis drawn "
                                  "(cases that convert a KV dtype excepted: the checksum hashes bytes)."),
    all_axes: bool = typer.Option(True, "--all-axes/--tp-only", help="Draw PP, CP, per-group block sizes, KV "
                                  "dtypes with scales and clipped window lists too, or TP, blocks and layouts only."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Random legal shape pairs: fill sources with a coordinate pattern, move, check every byte."""
    check_bounds(cases=cases)
    from kvbridge.proofs.verify import check_case, random_case
    failures, kinds, total_bytes, total_runs, axes, checksummed = [], {}, 0, 0, {}, 0
    progress = Progress(TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, disable=as_json)
    with progress:
        task = progress.add_task("cases", total=cases)
        for i in range(cases):
            spec, src, dst, request = random_case(random.Random(seed * 1_000_003 + i), all_axes=all_axes)
            result = check_case(spec, src, dst, request, seed=i, checksum=checksum)
            key = f"TP {src.tp_size}->{dst.tp_size}"
            for axis, hit in (("PP", max(src.pp_size, dst.pp_size) > 1), ("CP", max(src.cp_size, dst.cp_size) > 1),
                              ("group blocks", bool(src.group_block_sizes or dst.group_block_sizes)),
                              ("KV dtype", bool(result.plan.needs_conversion))):
                axes[axis] = axes.get(axis, 0) + hit
            kinds[key] = kinds.get(key, 0) + 1
            checksummed += checksum and not result.plan.needs_conversion
            total_bytes += result.plan.nbytes
            total_runs += len(result.plan)
            if not result.ok:
                failures.append({"case": i, "model": spec.describe(), "prefill": src.describe(),
                                 "decode": dst.describe(), "tokens": request.num_tokens,
                                 "cached": request.num_cached_tokens, "mismatches": result.mismatches[:5]})
            progress.advance(task)
    out = {"cases": cases, "seed": seed, "failed": len(failures), "bytes_moved": total_bytes, "runs": total_runs,
           "tp_pairs": dict(sorted(kinds.items())), "axes": axes, "all_axes": all_axes,
           "checksummed": checksummed, "failures": failures}
    if as_json:
        print_json(out)
    else:
        console.print(f"checked {cases} random shape pairs ({len(kinds)} TP pairs, GQA/MQA/MLA, sliding+full "
                      f"groups, NHD/HND, kv-first/blocks-first/cross-layer, kernel blocks, prefix hits"
                      + (f"; cases with {', '.join(f'{k} {v}' for k, v in axes.items())}" if all_axes else "") + "): "
                      f"{total_bytes / 2**20:.1f} MiB in {total_runs:,} runs; every destination byte compared"
                      + (f"; request checksums of {checksummed} cases (those without a KV dtype conversion) "
                         f"{'matched' if not failures else 'checked'}" if checksum else ""))
        for f in failures[:10]:
            console.print(f"[red]case {f['case']}[/]: {f['model']} | {f['prefill']} -> {f['decode']} | "
                          f"{f['tokens']} tokens ({f['cached']} cached): {f['mismatches'][0]}")
        console.print("[bold green]all byte-exact[/]" if not failures else f"[bold red]{len(failures)} failed[/]")
    if failures:
        raise typer.Exit(1)

"""`kvbridge plan`: explain a deployment pair before any byte moves."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import typer
from rich.table import Table

from kvbridge.cli.app import Order, app, check_bounds, console, friendly_errors, load_spec, print_json
from kvbridge.core.layout import EngineLayout
from kvbridge.errors import KVBridgeError


@app.command()
@friendly_errors
def plan(
    model: str = typer.Argument(..., help="config.json or model DIR (an existing path wins), preset NAME (e.g. llama-3-8b) or built-in tiny model."),
    prefill_tp: int = typer.Option(1, min=1), decode_tp: int = typer.Option(2, min=1),
    prefill_block_size: int = typer.Option(16, min=1), decode_block_size: int = typer.Option(16, min=1),
    prefill_layout: Order = typer.Option(Order.HND, case_sensitive=False), decode_layout: Order = typer.Option(Order.HND, case_sensitive=False),
    tokens: int = typer.Option(1024, min=1, help="Request length used to count runs."),
    link_gbps: float = typer.Option(100.0, min=0.001, help="Link speed for the time estimate (Gbit/s)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Explain a deployment: per decode rank, its sources, head slices, bytes and runs."""
    check_bounds(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_block_size=prefill_block_size,
                 decode_block_size=decode_block_size, tokens=tokens)
    from kvbridge.core.plan import Request, plan_request
    from kvbridge.core.topology import TransferTopology
    spec = load_spec(model)
    n_src, n_dst = -(-tokens // prefill_block_size), -(-tokens // decode_block_size)
    prefill = EngineLayout(prefill_tp, prefill_block_size, n_src, kv_order=prefill_layout.value)
    decode = EngineLayout(decode_tp, decode_block_size, n_dst, kv_order=decode_layout.value)
    rng = random.Random(0)
    request = Request(tuple(tuple(rng.sample(range(n_src), n_src)) for _ in spec.groups),
                      tuple(tuple(rng.sample(range(n_dst), n_dst)) for _ in spec.groups), tokens)
    full = plan_request(spec, prefill, decode, request)
    ranks = []
    for d in range(decode_tp):
        topo = TransferTopology("decode", spec, decode, d)
        topo.register_remote_engine("prefill", prefill, spec)
        mine = full.select(full.dst_rank == d)
        try:
            ratio: Any = topo.tp_ratio("prefill")
        except KVBridgeError:
            ratio = None
        a = decode.addressing(spec, d)
        recurrent = np.array([layer.is_recurrent for layer in spec.layers])
        per_layer = (a.heads * a.row_bytes).sum(axis=1)
        bpt, state_bytes = int(per_layer[~recurrent].sum()), int(per_layer[recurrent].sum())
        per_1k = mine.nbytes * 1000 / max(1, tokens)
        ranks.append({
            "decode_rank": d, "tp_ratio": ratio, "source_ranks": list(topo.source_ranks("prefill")),
            "handshake_ranks": list(topo.handshake_target_ranks("prefill")),
            "head_slices": [{"src_rank": s.src_rank, "heads": [s.start, s.stop]}
                            for s in topo.head_slices("prefill")],
            "attention_source_ranks": list(topo.attention_source_ranks("prefill")),
            "recurrent_source_ranks": list(topo.recurrent_source_ranks("prefill")),
            "bytes_per_token": bpt, "state_bytes_per_request": state_bytes, "bytes": mine.nbytes, "runs": len(mine),
            "runs_per_block_layer": len(mine) / max(1, n_dst * spec.num_layers), "mean_run_bytes": mine.stats.mean_run_bytes,
            "ms_per_1k_tokens": per_1k / (link_gbps * 1e9 / 8) * 1e3, "warnings": mine.stats.warnings,
        })
    out = {"model": spec.describe(), "prefill": prefill.describe(), "decode": decode.describe(),
           "tokens": tokens, "link_gbps": link_gbps, "is_kv_replicated_prefill": prefill_tp > spec.total_kv_heads,
           "is_kv_replicated_decode": decode_tp > spec.total_kv_heads, "bytes_total": full.nbytes,
           "runs_total": len(full), "plan_seconds": full.plan_seconds, "ranks": ranks}
    if as_json:
        print_json(out)
        return
    console.print(f"[bold]{out['model']}[/]\nprefill {out['prefill']}  ->  decode {out['decode']}  "
                  f"({tokens} tokens, {full.nbytes / 2**20:.1f} MiB, planned in {full.plan_seconds * 1e3:.1f} ms)")
    table = Table("D rank", "ratio", "reads", "attention heads", "B/token", "runs/blk/layer", "mean run",
                  "ms/1K tok", caption=f"ms/1K tok: transfer time of 1,000 tokens at {link_gbps:g} Gbit/s")
    if spec.has_recurrent:
        table.add_column("state from")
        table.add_column("state B/req")
    for r in ranks:
        slices = ", ".join(f"P{s['src_rank']}:[{s['heads'][0]},{s['heads'][1]})" for s in r["head_slices"])
        extra = ([", ".join(f"P{q}" for q in r["recurrent_source_ranks"]), f"{r['state_bytes_per_request']:,}"]
                 if spec.has_recurrent else [])
        table.add_row(str(r["decode_rank"]), "n/a" if r["tp_ratio"] is None else str(r["tp_ratio"]),
                      ", ".join(f"P{q}" for q in r["source_ranks"]), slices, f"{r['bytes_per_token']:,}",
                      f"{r['runs_per_block_layer']:.1f}", f"{r['mean_run_bytes'] / 1024:.1f} KiB", f"{r['ms_per_1k_tokens']:.2f}",
                      *extra)
    console.print(table)
    for w in sorted({w for r in ranks for w in r["warnings"]}):
        console.print(f"[yellow]warning:[/] {w}", soft_wrap=True)

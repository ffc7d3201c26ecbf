"""`kvbridge plan`: explain a deployment pair before any byte moves.

Per decode rank: where it sits (TP, PP, CP rank), which prefill ranks it reads (with their TP,
PP and CP ranks) and which layers and tokens, the bytes and runs of one request (sliding windows
and a cached prefix accounted for) and their time on the link; for the pair: the TP ratio in
words, and whether vLLM's own NIXL and Mooncake connectors would accept it and why not.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import typer
from rich.markup import escape
from rich.table import Table

from kvbridge.cli.app import Order, app, check_bounds, console, friendly_errors, load_spec, print_json
from kvbridge.cli import shapes as sh
from kvbridge.cli.shapes import SHAPES, SideShape
from kvbridge.core.layout import EngineLayout
from kvbridge.core.topology import layer_spans
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import InvalidRequest, KVBridgeError

LINK_ASSUMPTION = ("every decode rank has its own link at --link-gbps, all ranks move in parallel, "
                   "no protocol overhead: a request takes as long as its busiest decode rank")


def tp_ratio_words(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout) -> str:
    """The TP relation of the pair in words (vLLM writes it as a signed integer)."""
    p, d = prefill.tp_size, decode.tp_size
    heads = spec.total_kv_heads
    what = "the latent (MLA, replicated on every rank)" if spec.is_mla else f"{heads} KV heads"
    if p == d:
        return f"same TP ({p}): decode rank r reads prefill rank r's shard of {what} as it is"
    if d > p and d % p == 0:
        if spec.is_mla or p >= heads:
            return f"decode TP is {d // p}x prefill TP: each decode rank reads a whole replica from one prefill rank"
        return (f"decode TP is {d // p}x prefill TP: each decode rank reads 1/{d // p} of one prefill rank's heads "
                f"({what} in all)")
    if p > d and p % d == 0:
        if spec.is_mla or d >= heads:
            return f"prefill TP is {p // d}x decode TP: each decode rank reads one of {p // d} identical replicas"
        return f"prefill TP is {p // d}x decode TP: each decode rank gathers whole shards from {p // d} prefill ranks"
    return (f"TP {p} and {d} do not divide each other: each decode rank reads head slices from the prefill ranks "
            f"that overlap its heads (vLLM has no ratio for this pair)")


def _request(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout, tokens: int, cached: int) -> Any:
    from kvbridge.core.plan import Request
    rng = random.Random(0)

    def ids(layout: EngineLayout) -> tuple[tuple[int, ...], ...]:
        out, free = [], rng.sample(range(layout.num_blocks), layout.num_blocks)
        for g in range(len(spec.groups)):
            need = layout.block_ids_needed(g, tokens)
            out.append(tuple(free[:need]))
            free = free[need:]
        return tuple(out)
    return Request(ids(prefill), ids(decode), tokens, cached)


@app.command()
@friendly_errors
def plan(
    model: str = typer.Argument(..., help="config.json or model DIR (an existing path wins), preset NAME (e.g. llama-3-8b) or built-in tiny model."),
    prefill_tp: int = typer.Option(1, min=1, rich_help_panel=SHAPES),
    decode_tp: int = typer.Option(2, min=1, rich_help_panel=SHAPES),
    prefill_pp: sh.PrefillPP = 1,
    decode_pp: sh.DecodePP = 1,
    prefill_layer_split: sh.PrefillLayerSplit = None,
    decode_layer_split: sh.DecodeLayerSplit = None,
    prefill_pcp: sh.PrefillPCP = 1,
    decode_pcp: sh.DecodePCP = 1,
    prefill_dcp: sh.PrefillDCP = 1,
    decode_dcp: sh.DecodeDCP = 1,
    prefill_cp_interleave: sh.PrefillInterleave = 1,
    decode_cp_interleave: sh.DecodeInterleave = 1,
    prefill_block_size: Optional[int] = typer.Option(
        None, min=1, rich_help_panel=SHAPES,
        help="Tokens per block [default: 16, or a multiple of every compress rate of the model's compressed layers]."),
    decode_block_size: Optional[int] = typer.Option(None, min=1, rich_help_panel=SHAPES),
    prefill_kernel_block_size: Optional[int] = typer.Option(
        None, min=1, help="Kernel block size [default: the block size].", rich_help_panel=SHAPES),
    decode_kernel_block_size: Optional[int] = typer.Option(None, min=1, rich_help_panel=SHAPES),
    prefill_group_block_sizes: sh.PrefillGroupBlocks = None,
    decode_group_block_sizes: sh.DecodeGroupBlocks = None,
    prefill_layout: Order = typer.Option(Order.HND, case_sensitive=False, rich_help_panel=SHAPES),
    decode_layout: Order = typer.Option(Order.HND, case_sensitive=False, rich_help_panel=SHAPES),
    prefill_kv_dtype: Optional[str] = typer.Option(
        None, help="KV cache dtype, e.g. bfloat16, fp8 (e4m3), fp8_e5m2 [default: the model's].",
        rich_help_panel=SHAPES),
    decode_kv_dtype: sh.DecodeKvDtype = None,
    tokens: int = typer.Option(1024, min=1, help="Request length."),
    num_cached_tokens: int = typer.Option(0, min=0, help="Prefix the decode side already holds (not moved)."),
    link_gbps: float = typer.Option(100.0, min=0.001, help="Link speed for the time estimate (Gbit/s)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Explain a deployment: per decode rank, the prefill ranks, layers and
    tokens it reads, bytes, runs and time per request; the TP ratio in words;
    whether vLLM's NIXL and Mooncake connectors would take the pair."""
    check_bounds(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_block_size=prefill_block_size,
                 decode_block_size=decode_block_size, prefill_kernel=prefill_kernel_block_size,
                 decode_kernel=decode_kernel_block_size, tokens=tokens)
    if num_cached_tokens >= tokens:
        raise InvalidRequest(f"--num-cached-tokens {num_cached_tokens} must be below --tokens {tokens}")
    from kvbridge.core.plan import plan_request
    from kvbridge.core.topology import TransferTopology
    from kvbridge.integrations.vllm.compat import vllm_verdicts
    spec = load_spec(model)
    sides = {}
    for side, v in (("prefill", (prefill_tp, prefill_pp, prefill_layer_split, prefill_pcp, prefill_dcp,
                                 prefill_cp_interleave, prefill_block_size, prefill_kernel_block_size,
                                 prefill_group_block_sizes, prefill_layout, prefill_kv_dtype)),
                    ("decode", (decode_tp, decode_pp, decode_layer_split, decode_pcp, decode_dcp, decode_cp_interleave,
                                decode_block_size, decode_kernel_block_size, decode_group_block_sizes, decode_layout,
                                decode_kv_dtype))):
        tp, pp, split, pcp, dcp, inter, bs, kbs, groups, order, dtype = v
        sides[side] = SideShape(side=side, tp=tp, pp=pp, layer_split=split, pcp=pcp, dcp=dcp, cp_interleave=inter,
                                block_size=bs, kernel_block_size=kbs, group_block_sizes=groups,
                                layout=order.value, kv_dtype=dtype).layout_for(spec, tokens)
    prefill, decode = sides["prefill"], sides["decode"]
    full = plan_request(spec, prefill, decode, _request(spec, prefill, decode, tokens, num_cached_tokens))
    recurrent = np.array([layer.is_recurrent for layer in spec.layers])
    ranks = []
    for d in range(decode.world_size):
        ranks.append(_rank(spec, prefill, decode, d, full, recurrent, tokens, num_cached_tokens, link_gbps,
                           TransferTopology))
    verdicts = vllm_verdicts(spec, prefill, decode)
    out = {"model": spec.describe(), "prefill": prefill.describe(), "decode": decode.describe(),
           "tokens": tokens, "num_cached_tokens": num_cached_tokens, "link_gbps": link_gbps,
           "link_assumption": LINK_ASSUMPTION, "tp_ratio_words": tp_ratio_words(spec, prefill, decode),
           "is_kv_replicated_prefill": prefill.tp_size > spec.total_kv_heads,
           "is_kv_replicated_decode": decode.tp_size > spec.total_kv_heads, "bytes_total": full.nbytes,
           "runs_total": len(full), "plan_seconds": full.plan_seconds,
           "ms_per_request": max((r["ms_per_request"] for r in ranks), default=0.0),
           "vllm": [{"connector": v.connector, "accepts": v.accepts, "reasons": list(v.reasons),
                     "conditions": list(v.conditions)} for v in verdicts],
           "ranks": ranks}
    if as_json:
        print_json(out)
        return
    _show(out, spec, full.nbytes, full.plan_seconds, verdicts)


def _rank(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout, d: int, full: Any, recurrent: np.ndarray,
          tokens: int, cached: int, link_gbps: float, topology: Any) -> dict[str, Any]:
    topo = topology("decode", spec, decode, d, converts=True)
    topo.register_remote_engine("prefill", prefill, spec)
    mine = full.select(full.dst_rank == d)
    try:
        ratio: Any = topo.tp_ratio("prefill")
    except KVBridgeError:
        ratio = None
    coords = decode.rank_coords(d)
    a = decode.addressing(spec, d)
    # bytes one token adds per layer: a layer keeping one row per r tokens adds 1/r of a row
    per_layer = (a.heads * a.row_bytes).sum(axis=1) // np.array([x.tokens_per_row for x in spec.layers])
    held = a.region[:, 0] >= 0
    bpt = int(per_layer[~recurrent & held].sum())
    state_bytes = int(per_layer[recurrent & held].sum())
    positions = np.arange(cached, tokens)
    mine_tokens = int((decode.token_owner(positions) == coords.cp).sum()) if decode.cp_size > 1 else len(positions)
    seconds = mine.nbytes / (link_gbps * 1e9 / 8)
    return {
        "decode_rank": d, "tp": coords.tp, "pp": coords.pp, "cp": coords.cp, "tp_ratio": ratio,
        "layers": layer_spans([int(x) for x in np.flatnonzero(held)]) or "-",
        "tokens": mine_tokens,
        "source_ranks": list(topo.source_ranks("prefill")),
        "reads": [{"rank": r.rank, "tp": r.tp_rank, "pp": r.pp_rank, "cp": r.cp_rank, "layers": layer_spans(r.layers) or "-"}
                  for r in topo.read_sources("prefill")],
        "handshake_ranks": list(topo.handshake_target_ranks("prefill")),
        "head_slices": [{"src_rank": s.src_rank, "heads": [s.start, s.stop]} for s in topo.head_slices("prefill")]
        if held[~recurrent].any() else [],
        "attention_source_ranks": list(topo.attention_source_ranks("prefill")),
        "recurrent_source_ranks": list(topo.recurrent_source_ranks("prefill")),
        "bytes_per_token": bpt, "state_bytes_per_request": state_bytes, "bytes": mine.nbytes, "runs": len(mine),
        "runs_per_block_layer": len(mine) / max(1, -(-tokens // decode.block_size) * spec.num_layers),
        "mean_run_bytes": mine.stats.mean_run_bytes, "ms_per_request": seconds * 1e3,
        "ms_per_1k_tokens": seconds * 1e3 * 1000 / max(1, tokens - cached), "warnings": mine.stats.warnings,
    }


def _show(out: dict[str, Any], spec: ModelSpec, nbytes: int, plan_seconds: float, verdicts: Any) -> None:
    cached = f", {out['num_cached_tokens']} cached on decode" if out["num_cached_tokens"] else ""
    console.print(f"[bold]{escape(out['model'])}[/]\nprefill {escape(out['prefill'])}  ->  "
                  f"decode {escape(out['decode'])}\n"
                  f"{out['tokens']} tokens{cached}: {nbytes / 2**20:.2f} MiB, planned in {plan_seconds * 1e3:.1f} ms; "
                  f"{out['ms_per_request']:.3f} ms per request at {out['link_gbps']:g} Gbit/s\n"
                  f"TP: {out['tp_ratio_words']}", soft_wrap=True)
    table = Table("D rank (tp,pp,cp)", "layers", "tokens", "reads P rank (tp,pp,cp): layers", "B/request",
                  "runs", "mean run", "ms/request",
                  caption=f"ms/request at {out['link_gbps']:g} Gbit/s: {out['link_assumption']}. "
                          f"B/request and runs count sliding windows (only the window moves) and skip the cached prefix.")
    for r in out["ranks"]:
        reads = "; ".join(f"P{x['rank']} ({x['tp']},{x['pp']},{x['cp']}): {x['layers']}" for x in r["reads"])
        table.add_row(f"{r['decode_rank']} ({r['tp']},{r['pp']},{r['cp']})", r["layers"], f"{r['tokens']:,}",
                      reads or "-", f"{r['bytes']:,}", f"{r['runs']:,}", f"{r['mean_run_bytes'] / 1024:.1f} KiB",
                      f"{r['ms_per_request']:.3f}")
    console.print(table)
    if spec.has_recurrent:
        for r in out["ranks"]:
            if r["recurrent_source_ranks"]:
                console.print(f"D{r['decode_rank']}: recurrent state ({r['state_bytes_per_request']:,} B per request) "
                              f"from P{', P'.join(map(str, r['recurrent_source_ranks']))}")
    for v in verdicts:
        style = "green" if v.accepts else "yellow"
        console.print(f"[{style}]{escape(v.describe())}[/]", soft_wrap=True, highlight=False)
    for w in sorted({w for r in out["ranks"] for w in r["warnings"]}):
        console.print(f"[yellow]warning:[/] {w}", soft_wrap=True)

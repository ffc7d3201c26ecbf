"""`kvbridge plan`: explain a deployment pair before any byte moves.

Per decode rank: where it sits (TP, PP, CP rank), which prefill ranks it reads (with their TP,
PP and CP ranks) and which layers and tokens, the bytes and runs of one request (sliding windows
and a cached prefix accounted for) and their time on the link; for the pair: the TP ratio in
words, and whether vLLM's own NIXL and Mooncake connectors would accept it and why not.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import msgspec
import numpy as np
import typer
from rich.markup import escape
from rich.table import Table

from kvbridge.bench.planning import DEFAULT_LINK_GBPS, LINK_ASSUMPTION, link_seconds
from kvbridge.cli.app import Order, app, check_bounds, console, friendly_errors, load_spec, print_json
from kvbridge.cli import shapes as sh
from kvbridge.cli.shapes import SHAPES, SideShape
from kvbridge.core.layout import EngineLayout
from kvbridge.core.topology import layer_spans
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import InvalidRequest, KVBridgeError
from kvbridge.integrations.vllm.compat import Verdict



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


CHUNK_TOKENS = 4_096
"""A request longer than this is planned in chunks of about this many tokens, and its equal middle
chunks are planned once and counted for all (`_figures`): memory and time stay those of a few
chunks at any length (Gemma-2-9B NHD -> HND at 1M tokens: 22 GB and 51 s as one plan)."""

RUNS_PER_CHUNK = 2_000_000
"""Runs one chunk may hold at most (a few hundred MB of run arrays while it is planned)."""


def _block_ids(spec: ModelSpec, layout: EngineLayout, start: int, stop: int) -> tuple[np.ndarray, ...]:
    """Per group, the block ids a chunk `[start, stop)` of the request reads: the table's entries
    from the first block holding a moved position on (a clipped list, as the planner takes it).
    Entry i is `2 * ((i * step) % (num_blocks // 2))`, `step` coprime: distinct even ids, so no two
    blocks of a request lie side by side in memory (a fragmented engine: no run spans two blocks,
    and a chunk's runs are the whole plan's), and any slice of the table is computed alone."""
    n = layout.num_blocks // 2
    step = max(2, int(n * 0.6180339887))
    while math.gcd(step, n) != 1:
        step += 1
    rows = layout.row_layout(spec)
    out = []
    for g in range(len(spec.groups)):
        layer = spec.group_layer(g)
        count, first = layer.rows(stop), layer.rows(start)
        need = rows.block_ids_needed(g, count)
        lo = min(rows.block_span(g, first, count)[0] if first < count else need, need - 1)
        out.append(2 * ((np.arange(lo, need, dtype=np.int64) * step + g) % n))
    return tuple(out)


def _alignment(spec: ModelSpec, *layouts: EngineLayout) -> int:
    """Tokens a chunk edge must be a multiple of: whole blocks (and rows) of every group on both
    sides, whole CP interleave rounds."""
    step = 1
    for layout in layouts:
        step = math.lcm(step, layout.cp_interleave * layout.cp_size)
        for g in range(len(spec.groups)):
            step = math.lcm(step, layout.group_block_size(g) * layout.cp_size, spec.group_layer(g).tokens_per_row)
    return step


def _tail_layers(spec: ModelSpec, tokens: int, cached: int) -> tuple[np.ndarray, int]:
    """Layers that do not move every token of `[cached, tokens)` (a window, recurrent state), and
    the first token any of them moves: the last chunk must start at or before it."""
    tail = np.zeros(spec.num_layers, dtype=bool)
    first = tokens - 1
    for li, layer in enumerate(spec.layers):
        if layer.is_recurrent:
            tail[li] = True
        elif layer.is_attention:
            moved = layer.moved_positions(tokens, cached)
            if moved.start > layer.rows(cached):
                tail[li] = True
                first = min(first, moved.start * layer.tokens_per_row)
    return tail, first


def _chunk_size(spec: ModelSpec, step: int) -> int:
    """Tokens per chunk: at most `CHUNK_TOKENS`, and few enough that a chunk holds at most
    `RUNS_PER_CHUNK` runs when every (token, head) row is a run of its own (NHD -> HND); a multiple of `step`."""
    rows = sum(c.heads for layer in spec.layers if layer.is_attention for c in layer.components)
    return max(step, min(CHUNK_TOKENS, RUNS_PER_CHUNK // max(1, rows)) // step * step)


def _chunks(tokens: int, cached: int, size: int, tail_first: int) -> list[tuple[int, int, int]]:
    """`(start, stop, count)`: the first chunk, the middle chunks (one of `count` equal ones) and the
    last one, which holds every token a windowed or recurrent layer moves."""
    last = min(tokens - 1, tail_first) // size * size
    if tokens - cached <= size or last <= cached:
        return [(cached, tokens, 1)]
    first_stop = (cached // size + 1) * size
    if first_stop >= last:
        return [(cached, last, 1), (last, tokens, 1)]
    out = [(cached, first_stop, 1)]
    middle = (last - first_stop) // size
    if middle:
        out.append((first_stop, first_stop + size, middle))
    return out + [(last, tokens, 1)]


class _Figures:
    """Per decode rank: bytes on the wire (read from the sources), bytes written, runs, warnings."""

    def __init__(self, world: int):
        self.wire, self.written = np.zeros(world, np.int64), np.zeros(world, np.int64)
        self.runs = np.zeros(world, np.int64)
        self.warnings: list[set[str]] = [set() for _ in range(world)]
        self.seconds = 0.0

    def add(self, plan: Any, count: int, keep: np.ndarray | None) -> None:
        self.seconds += plan.plan_seconds
        if keep is not None:
            plan = plan.select(keep)
        world = len(self.runs)
        self.wire += count * np.bincount(plan.dst_rank, weights=plan.src_length, minlength=world).astype(np.int64)
        self.written += count * np.bincount(plan.dst_rank, weights=plan.length, minlength=world).astype(np.int64)
        self.runs += count * np.bincount(plan.dst_rank, minlength=world)
        for d in np.unique(plan.dst_rank):  # the planner's warnings but its mean run size: that is the request's
            self.warnings[d].update(w for w in plan.select(plan.dst_rank == d).stats.warnings
                                    if not w.startswith("runs average"))

    def rank_warnings(self, d: int, src: EngineLayout, dst: EngineLayout) -> list[str]:
        """Rank `d`'s warnings, the tiny-run one (`core.plan`'s rule) from the whole request's runs."""
        from kvbridge.core.plan import TINY_RUN_BYTES
        out = set(self.warnings[d])
        if self.runs[d] and self.written[d] / self.runs[d] < TINY_RUN_BYTES:
            out.add(f"runs average {self.written[d] / self.runs[d]:.0f} B (below {TINY_RUN_BYTES} B): source "
                    f"{src.describe()} and destination {dst.describe()} share little contiguity; expect slow "
                    f"transfers")
        return sorted(out)


def _figures(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout, tokens: int,
             cached: int) -> tuple[_Figures, list[tuple[int, int, int]]]:
    """Plan the request (block ids of `_block_ids`) in chunks (`_chunks`); a chunk other than the
    last moves no windowed or recurrent layer (those runs are dropped: the last chunk moves them)."""
    from kvbridge.core.plan import Request, plan_request
    prefill, decode = (msgspec.structs.replace(x, num_blocks=2 * x.num_blocks + 2) for x in (prefill, decode))
    tail, tail_first = _tail_layers(spec, tokens, cached)
    chunks = _chunks(tokens, cached, _chunk_size(spec, _alignment(spec, prefill, decode)), tail_first)
    regions = [decode.addressing(spec, d).region for d in range(decode.world_size)]
    is_tail = np.zeros((decode.world_size, 1 + max(int(r.max()) for r in regions)), dtype=bool)
    for d, region in enumerate(regions):
        for li in np.flatnonzero(tail):
            is_tail[d, region[li][region[li] >= 0]] = True
    out = _Figures(decode.world_size)
    for i, (start, stop, count) in enumerate(chunks):
        request = Request(_block_ids(spec, prefill, start, stop), _block_ids(spec, decode, start, stop), stop, start)
        plan = plan_request(spec, prefill, decode, request)
        last = i == len(chunks) - 1
        out.add(plan, count, None if last else ~is_tail[plan.dst_rank, plan.dst_region])
    return out, chunks


def kvbridge_verdicts(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout) -> tuple[Verdict, ...]:
    """kvbridge's own engines on the pair: the local executor converts KV dtypes on its copy path;
    the transports between processes move bytes, and their handshake refuses another KV dtype."""
    from kvbridge.core.plan import pair_conversions
    from kvbridge.core.topology import TransferTopology
    converts = pair_conversions(spec, prefill, decode)
    src, dst = prefill.engine_spec(spec).dtype, decode.engine_spec(spec).dtype
    conditions = (f"a conversion {src} -> {dst} on its copy path",) if converts else ()
    local = Verdict("kvbridge local executor", (), conditions)
    try:
        TransferTopology("decode", spec, decode, 0, converts=False).register_remote_engine("prefill", prefill, spec)
        reasons: tuple[str, ...] = ()
    except KVBridgeError as e:
        reasons = (str(e).split("; this transport")[0] + ": these transports move bytes unchanged",)
    return local, Verdict("kvbridge shm/nixl/mooncake", reasons)


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
    tokens: int = typer.Option(1024, min=1, help="Request length (a long one is planned in chunks, its equal "
                               "middle chunks counted from one)."),
    num_cached_tokens: int = typer.Option(0, min=0, help="Prefix the decode side already holds (not moved; any "
                                          "count below --tokens, as the planner takes it)."),
    link_gbps: float = typer.Option(DEFAULT_LINK_GBPS, min=0.001, help="Link speed of each decode rank (Gbit/s): "
                                    "a request takes its busiest decode rank's bytes on the wire at this speed."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Explain a deployment: per decode rank, the prefill ranks, layers and
    tokens it reads, bytes, runs and time per request; the TP ratio in words;
    whether vLLM's NIXL and Mooncake connectors would take the pair."""
    check_bounds(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_block_size=prefill_block_size,
                 decode_block_size=decode_block_size, prefill_kernel=prefill_kernel_block_size,
                 decode_kernel=decode_kernel_block_size, tokens=tokens, link_gbps=link_gbps)
    if num_cached_tokens >= tokens:
        raise InvalidRequest(f"--num-cached-tokens {num_cached_tokens} must be below --tokens {tokens} "
                             f"(a prefix hit leaves at least one token to move)")
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
    figures, chunks = _figures(spec, prefill, decode, tokens, num_cached_tokens)
    recurrent = np.array([layer.is_recurrent for layer in spec.layers])
    ranks = []
    for d in range(decode.world_size):
        ranks.append(_rank(spec, prefill, decode, d, figures, recurrent, tokens, num_cached_tokens, link_gbps,
                           TransferTopology))
    verdicts = vllm_verdicts(spec, prefill, decode)
    ours = kvbridge_verdicts(spec, prefill, decode)
    chunk_tokens = chunks[1][1] - chunks[1][0] if len(chunks) > 2 else tokens - num_cached_tokens
    out = {"model": spec.describe(), "prefill": prefill.describe(), "decode": decode.describe(),
           "tokens": tokens, "num_cached_tokens": num_cached_tokens, "link_gbps": link_gbps,
           "link_assumption": LINK_ASSUMPTION, "tp_ratio_words": tp_ratio_words(spec, prefill, decode),
           "is_kv_replicated_prefill": prefill.tp_size > spec.total_kv_heads,
           "is_kv_replicated_decode": decode.tp_size > spec.total_kv_heads,
           "src_dtype": prefill.engine_spec(spec).dtype, "dst_dtype": decode.engine_spec(spec).dtype,
           "bytes_total": int(figures.wire.sum()), "dst_bytes_total": int(figures.written.sum()),
           "runs_total": int(figures.runs.sum()), "plan_seconds": figures.seconds,
           "chunks": sum(c[2] for c in chunks), "chunk_tokens": chunk_tokens, "chunks_planned": len(chunks),
           "ms_per_request": link_seconds(figures.wire, link_gbps) * 1e3,
           "kvbridge": [_verdict(v) for v in ours], "vllm": [_verdict(v) for v in verdicts],
           "ranks": ranks}
    if as_json:
        print_json(out)
        return
    _show(out, spec, ours + verdicts)


def _verdict(v: Verdict) -> dict[str, Any]:
    return {"connector": v.connector, "accepts": v.accepts, "reasons": list(v.reasons),
            "conditions": list(v.conditions)}


def _rank(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout, d: int, figures: _Figures,
          recurrent: np.ndarray, tokens: int, cached: int, link_gbps: float, topology: Any) -> dict[str, Any]:
    topo = topology("decode", spec, decode, d, converts=True)
    topo.register_remote_engine("prefill", prefill, spec)
    try:
        ratio: Any = topo.tp_ratio("prefill")
    except KVBridgeError:
        ratio = None
    coords = decode.rank_coords(d)
    rates = np.array([x.tokens_per_row for x in spec.layers])
    a = decode.addressing(spec, d)
    # bytes one token adds per layer (a layer keeping one row per r tokens adds 1/r of a row), on
    # the wire in the source's KV dtype: this rank's heads as the source stores them
    wire = a if decode.kv_dtype == prefill.kv_dtype else \
        msgspec.structs.replace(decode, kv_dtype=prefill.kv_dtype, kv_scales=()).addressing(spec, d)
    per_layer = (wire.heads * wire.row_bytes).sum(axis=1) // rates
    dst_per_layer = (a.heads * a.row_bytes).sum(axis=1) // rates
    held = a.region[:, 0] >= 0
    bpt = int(per_layer[~recurrent & held].sum())
    state_bytes = int(per_layer[recurrent & held].sum())
    mine_tokens = tokens - cached
    if decode.cp_size > 1:  # positions in slices: a long request's positions are never all in memory
        mine_tokens = sum(int((decode.token_owner(np.arange(a, min(a + 2**20, tokens))) == coords.cp).sum())
                          for a in range(cached, tokens, 2**20))
    wire_bytes, written, runs = int(figures.wire[d]), int(figures.written[d]), int(figures.runs[d])
    seconds = link_seconds([wire_bytes], link_gbps)
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
        "bytes_per_token": bpt, "dst_bytes_per_token": int(dst_per_layer[~recurrent & held].sum()),
        "state_bytes_per_request": state_bytes, "bytes": wire_bytes, "dst_bytes": written, "runs": runs,
        "runs_per_block_layer": runs / max(1, -(-tokens // decode.block_size) * spec.num_layers),
        "mean_run_bytes": written / runs if runs else 0.0, "ms_per_request": seconds * 1e3,
        "ms_per_1k_tokens": seconds * 1e3 * 1000 / max(1, tokens - cached),
        "warnings": figures.rank_warnings(d, prefill, decode),
    }


def _show(out: dict[str, Any], spec: ModelSpec, verdicts: Any) -> None:
    cached = f", {out['num_cached_tokens']:,} cached on decode" if out["num_cached_tokens"] else ""
    converts = out["src_dtype"] != out["dst_dtype"]
    written = (f" ({out['src_dtype']}), {out['dst_bytes_total'] / 2**20:,.2f} MiB written ({out['dst_dtype']})"
               if converts else "")
    chunks = (f" in {out['chunks']:,} chunks of {out['chunk_tokens']:,} tokens (the equal middle ones planned once)"
              if out["chunks"] > 1 else "")
    console.print(f"[bold]{escape(out['model'])}[/]\nprefill {escape(out['prefill'])}  ->  "
                  f"decode {escape(out['decode'])}\n"
                  f"{out['tokens']:,} tokens{cached}: {out['bytes_total'] / 2**20:,.2f} MiB on the wire{written}, "
                  f"planned{chunks} in {out['plan_seconds'] * 1e3:.1f} ms; "
                  f"{out['ms_per_request']:.3f} ms per request at {out['link_gbps']:g} Gbit/s\n"
                  f"TP: {out['tp_ratio_words']}", soft_wrap=True, highlight=False)
    table = Table("D rank (tp,pp,cp)", "layers", "tokens", "reads P rank (tp,pp,cp): layers", "B/request",
                  *(("B written",) if converts else ()), "runs", "mean run", "ms/request",
                  caption=f"ms/request at {out['link_gbps']:g} Gbit/s: {out['link_assumption']}. "
                          f"B/request (on the wire, {out['src_dtype']})"
                          + (f", B written ({out['dst_dtype']})" if converts else "")
                          + " and runs count sliding windows (only the window moves) and skip the cached prefix.")
    for r in out["ranks"]:
        reads = "; ".join(f"P{x['rank']} ({x['tp']},{x['pp']},{x['cp']}): {x['layers']}" for x in r["reads"])
        table.add_row(f"{r['decode_rank']} ({r['tp']},{r['pp']},{r['cp']})", r["layers"], f"{r['tokens']:,}",
                      reads or "-", f"{r['bytes']:,}", *((f"{r['dst_bytes']:,}",) if converts else ()),
                      f"{r['runs']:,}", f"{r['mean_run_bytes'] / 1024:.1f} KiB", f"{r['ms_per_request']:.3f}")
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
        console.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True, highlight=False)

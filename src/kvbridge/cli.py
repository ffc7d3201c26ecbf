"""The `kvbridge` command: demo | plan | verify | bench.

Every command prints a readable summary or, with `--json`, one JSON object. Bad input exits 2
with one line naming the problem; a failed proof or verification exits 1.
"""

from __future__ import annotations

import functools
import json
import random
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge.errors import KVBridgeError
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.models import spec_from_hf_config

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Move LLM KV caches between engines of any TP size, block size and layout, byte-exact.")
console = Console()
if not console.is_terminal:  # piped output: wide enough for the plan table, never squeezed to 80
    console = Console(width=160)
err_console = Console(stderr=True)


class Order(str, Enum):
    NHD = "NHD"
    HND = "HND"


class Transport(str, Enum):
    local = "local"
    shm = "shm"
    nixl = "nixl"
    mooncake = "mooncake"


class Mode(str, Enum):
    pull = "pull"
    push = "push"


class Engine(str, Enum):
    kvbridge = "kvbridge"
    vllm = "vllm"


class Role(str, Enum):
    both = "both"
    decode = "decode"


def _friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn kvbridge's own errors into one line on stderr and exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVBridgeError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    return wrapper


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def load_spec(model: str) -> ModelSpec:
    """A model NAME (preset geometry or built-in tiny model) or a config.json path / model directory."""
    from kvbridge.models.presets import PRESETS
    if model in PRESETS:
        return spec_from_hf_config({**PRESETS[model], "_name_or_path": model})
    path = Path(model)
    if path.exists():
        return spec_from_hf_config(path)
    from kvbridge.proofs.tiny_models import BUILTIN_MODELS, spec_for
    if model in BUILTIN_MODELS:
        return spec_for(BUILTIN_MODELS[model]())
    from kvbridge.errors import ConfigError
    names = ", ".join(list(PRESETS) + list(BUILTIN_MODELS))
    raise ConfigError(f"unknown model {model!r}: give a config.json path, a model directory or one of: {names}")


# --------------------------------------------------------------------------------------------- demo
_DEMO_KEYS = ("model", "transport", "mode", "prefill", "decode", "tokens_reference", "tokens_disaggregated",
              "tokens_offload", "match", "cache_equal", "bytes_moved", "num_runs", "plan_seconds",
              "transfer_seconds", "store_engine", "load_engine", "pool", "hit_tokens", "bytes_stored",
              "bytes_loaded", "store_seconds", "load_seconds", "requests_ok")


def _show(out: dict[str, Any], title: str) -> None:
    table = Table(title=title, show_header=False)
    for key in _DEMO_KEYS:
        if key in out and out[key] is not None:
            value = out[key]
            if isinstance(value, float):
                value = f"{value * 1e3:.2f} ms" if key.endswith("seconds") else f"{value:.3f}"
            table.add_row(key, str(value))
    console.print(table)


@app.command()
@_friendly_errors
def demo(
    model: str = typer.Option("tiny-llama", help="Built-in model NAME or a save_pretrained DIR."),
    prompt_ids: Optional[str] = typer.Option(None, help="Comma-separated prompt token ids, e.g. 1,2,3."),
    prompt_len: int = typer.Option(32, min=1, help="Random prompt length (when --prompt-ids is not given)."),
    new_tokens: int = typer.Option(8, min=1, help="Tokens to generate."),
    seed: int = typer.Option(0, help="Seed for weights, prompt and block ids."),
    prefill_tp: int = typer.Option(1, min=1), decode_tp: int = typer.Option(2, min=1),
    prefill_block_size: Optional[int] = typer.Option(None, min=1, help="Tokens per block [default: 16; 32 with "
                                                     "--engine vllm, whose CPU attention takes multiples of 32]."),
    decode_block_size: Optional[int] = typer.Option(None, min=1, help="[default: 16; 32 with --engine vllm]"),
    prefill_kernel_block_size: Optional[int] = typer.Option(None, min=1, help="Kernel block size (default: block size)."),
    decode_kernel_block_size: Optional[int] = typer.Option(None, min=1),
    prefill_layout: Order = typer.Option(Order.HND), decode_layout: Order = typer.Option(Order.HND),
    transport: Transport = typer.Option(Transport.local, help="local: one process; shm/nixl/mooncake: one process per rank."),
    mode: Mode = typer.Option(Mode.pull, help="pull: decode reads (NIXL style); push: prefill writes (Mooncake style)."),
    requests: int = typer.Option(1, min=1, help="Requests in flight at once (multi-process transports)."),
    timeout: float = typer.Option(120.0, min=1.0, help="Deadline in seconds for every wait (multi-process)."),
    role: Role = typer.Option(Role.both, help="decode: only the decode half, against a `kvbridge prefill-server`."),
    prefill: Optional[str] = typer.Option(None, help="HOST:PORT of the prefill server (with --role decode)."),
    num_cached_tokens: int = typer.Option(0, min=0, help="Prefix the decode side already holds (a multiple of "
                                          "its block size); only the rest moves (local transport)."),
    offload: bool = typer.Option(False, help="Offload scenario: store a prefix to CPU, evict, load it back, decode."),
    engine: Engine = typer.Option(Engine.kvbridge, help="vllm: two real vLLM CPU instances with KVBridgeConnector "
                                  "(needs `make vllm-env`); --model is then a save_pretrained DIR or omitted."),
    dump_decode_cache: Optional[Path] = typer.Option(None, help="Write the reassembled decode cache (.safetensors)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Prefill on one engine shape, move the KV cache, decode on another; compare with `generate`."""
    default_block = 32 if engine == Engine.vllm else 16
    prefill_block_size = prefill_block_size or default_block
    decode_block_size = decode_block_size or default_block
    ids = _parse_ids(prompt_ids) if prompt_ids else None
    if engine == Engine.vllm:
        from kvbridge.proofs.vllm.demo import run_vllm_demo
        model_dir = model if Path(model).is_dir() else None
        with console.status("starting vLLM instances ...", spinner="dots") if not as_json else _nullcontext():
            out = run_vllm_demo(model_dir, prefill_tp, decode_tp, ids, new_tokens,
                                prefill_block_size=prefill_block_size, decode_block_size=decode_block_size,
                                prompt_len=prompt_len, seed=seed,
                                transport="shm" if transport == Transport.local else transport.value, mode=mode.value)
        if as_json:
            _print_json(out)
        else:
            _show(out, "kvbridge demo --engine vllm")
            console.print("[bold green]MATCH[/]" if out.get("match") else "[bold red]MISMATCH[/]")
        if not out.get("match"):
            raise typer.Exit(1)
        return
    n = (len(ids) if ids else prompt_len) + new_tokens

    def layout(tp: int, bs: int, kbs: Optional[int], order: Order) -> EngineLayout:
        return EngineLayout(tp_size=tp, block_size=bs, num_blocks=(-(-n // bs) + 8) * requests,
                            kernel_block_size=kbs, kv_order=order.value)

    prefill_shape = layout(prefill_tp, prefill_block_size, prefill_kernel_block_size, prefill_layout)
    decode_shape = layout(decode_tp, decode_block_size, decode_kernel_block_size, decode_layout)
    spec = load_spec(model)
    prefill_shape.check_model(spec, "prefill engine")
    decode_shape.check_model(spec, "decode engine")
    if num_cached_tokens and (transport != Transport.local or offload or role == Role.decode):
        from kvbridge.errors import InvalidRequest
        raise InvalidRequest("--num-cached-tokens is supported with --transport local")
    if role == Role.decode and not prefill:
        from kvbridge.errors import InvalidRequest
        raise InvalidRequest("--role decode needs --prefill HOST:PORT of a running `kvbridge prefill-server`")
    status = console.status("prefill, transfer, decode ...", spinner="dots") if not as_json else _nullcontext()
    with status:
        if offload:
            from kvbridge.proofs.offload_demo import run_offload_demo
            result = run_offload_demo(model if model != "tiny-llama" else "tiny-gemma2", seed=seed,
                                      prompt_len=max(prompt_len, 16), new_tokens=new_tokens, store_tp=prefill_tp,
                                      load_tp=decode_tp, canonical=prefill_tp != decode_tp)
            ok = result.ok
        elif role == Role.decode:
            from kvbridge.proofs.connector_demo import run_decode_client
            result = run_decode_client(prefill or "", transport=transport.value, model=model, prompt_ids=ids,
                                       prompt_len=None if ids else prompt_len, new_tokens=new_tokens, seed=seed,
                                       decode=decode_shape, mode=mode.value, num_requests=requests,
                                       dump_decode_cache=dump_decode_cache, timeout=timeout)
            ok = result.match
        elif transport == Transport.local:
            from kvbridge.proofs.local_demo import run_demo
            result = run_demo(model, prompt_ids=ids, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed,
                                 prefill=prefill_shape, decode=decode_shape, dump_decode_cache=dump_decode_cache,
                                 num_cached_tokens=num_cached_tokens)
            ok = result.match
        else:
            from kvbridge.proofs.connector_demo import run_multiprocess_demo
            result = run_multiprocess_demo(transport.value, model, prompt_ids=ids,
                                           prompt_len=None if ids else prompt_len, new_tokens=new_tokens,
                                           seed=seed, prefill=prefill_shape, decode=decode_shape, mode=mode.value,
                                           dump_decode_cache=dump_decode_cache, num_requests=requests,
                                           timeout=timeout)
            ok = result.match
    out = result.to_dict()
    out.setdefault("transport", transport.value)
    if as_json:
        _print_json(out)
    else:
        _show(out, f"kvbridge demo: {out.get('model', model)}")
        verdict = "[bold green]MATCH[/]" if ok else "[bold red]MISMATCH[/]"
        what = "offloaded-and-reloaded" if offload else "disaggregated"
        console.print(f"{verdict}: {what} tokens {'equal' if ok else 'differ from'} monolithic generate")
        if dump_decode_cache and not offload:
            console.print(f"decode cache written to {dump_decode_cache}")
    if not ok:
        raise typer.Exit(1)


@app.command("prefill-server")
@_friendly_errors
def prefill_server(
    listen: str = typer.Option("127.0.0.1:5600", help="HOST:PORT the decode side connects to."),
    model: str = typer.Option("tiny-llama"), prompt_ids: Optional[str] = typer.Option(None),
    prompt_len: int = typer.Option(32, min=1), seed: int = typer.Option(0),
    prefill_tp: int = typer.Option(1, min=1), prefill_block_size: int = typer.Option(16, min=1),
    prefill_layout: Order = typer.Option(Order.HND),
    transport: Transport = typer.Option(Transport.shm), mode: Mode = typer.Option(Mode.pull),
    requests: int = typer.Option(1, min=1), timeout: float = typer.Option(120.0, min=1.0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The prefill half of the two-host demo: prefill, lease the blocks, serve one decode engine."""
    from kvbridge.proofs.connector_demo import run_prefill_server
    if transport == Transport.local:
        from kvbridge.errors import InvalidRequest
        raise InvalidRequest("prefill-server needs a transport between processes: shm, nixl or mooncake")
    ids = _parse_ids(prompt_ids) if prompt_ids else None
    n = (len(ids) if ids else prompt_len) + 8
    shape = EngineLayout(prefill_tp, prefill_block_size, (-(-n // prefill_block_size) + 8) * requests,
                         kv_order=prefill_layout.value)
    shape.check_model(load_spec(model), "prefill engine")
    result = run_prefill_server(listen, transport=transport.value, model=model, prompt_ids=ids,
                                prompt_len=None if ids else prompt_len, seed=seed, prefill=shape, mode=mode.value,
                                num_requests=requests, timeout=timeout,
                                on_listening=None if as_json else lambda a: err_console.print(f"listening on {a}"))
    if as_json:
        _print_json(result.to_dict())
    else:
        console.print(result.to_dict())


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        from kvbridge.errors import InvalidRequest
        raise InvalidRequest(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


# --------------------------------------------------------------------------------------------- plan
@app.command()
@_friendly_errors
def plan(
    model: str = typer.Argument(..., help="Preset NAME (e.g. llama-3-8b), built-in tiny model, config.json or DIR."),
    prefill_tp: int = typer.Option(1, min=1), decode_tp: int = typer.Option(2, min=1),
    prefill_block_size: int = typer.Option(16, min=1), decode_block_size: int = typer.Option(16, min=1),
    prefill_layout: Order = typer.Option(Order.HND), decode_layout: Order = typer.Option(Order.HND),
    tokens: int = typer.Option(1024, min=1, help="Request length used to count runs."),
    link_gbps: float = typer.Option(100.0, min=0.001, help="Link speed for the time estimate (Gbit/s)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Explain a deployment: per decode rank, its sources, head slices, bytes and runs."""
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
        _print_json(out)
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


# --------------------------------------------------------------------------------------------- verify
@app.command()
@_friendly_errors
def verify(
    cases: int = typer.Option(200, min=1, help="Random shape pairs to check."),
    seed: int = typer.Option(0),
    checksum: bool = typer.Option(False, help="Also check the end-to-end request checksum."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Random legal shape pairs: fill sources with a coordinate pattern, move, check every byte."""
    from kvbridge.proofs.verify import check_case, random_case
    failures, kinds, total_bytes, total_runs = [], {}, 0, 0
    progress = Progress(TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, disable=as_json)
    with progress:
        task = progress.add_task("cases", total=cases)
        for i in range(cases):
            spec, src, dst, request = random_case(random.Random(seed * 1_000_003 + i))
            result = check_case(spec, src, dst, request, seed=i, checksum=checksum)
            key = f"TP {src.tp_size}->{dst.tp_size}"
            kinds[key] = kinds.get(key, 0) + 1
            total_bytes += result.plan.nbytes
            total_runs += len(result.plan)
            if not result.ok:
                failures.append({"case": i, "model": spec.describe(), "prefill": src.describe(),
                                 "decode": dst.describe(), "tokens": request.num_tokens,
                                 "cached": request.num_cached_tokens, "mismatches": result.mismatches[:5]})
            progress.advance(task)
    out = {"cases": cases, "seed": seed, "failed": len(failures), "bytes_moved": total_bytes, "runs": total_runs,
           "tp_pairs": dict(sorted(kinds.items())), "failures": failures}
    if as_json:
        _print_json(out)
    else:
        console.print(f"checked {cases} random shape pairs ({len(kinds)} TP pairs, GQA/MQA/MLA, sliding+full "
                      f"groups, NHD/HND, kv-first/blocks-first/cross-layer, kernel blocks, prefix hits): "
                      f"{total_bytes / 2**20:.1f} MiB in {total_runs:,} runs; every destination byte compared"
                      f"{' and request checksums matched' if checksum and not failures else ''}")
        for f in failures[:10]:
            console.print(f"[red]case {f['case']}[/]: {f['model']} | {f['prefill']} -> {f['decode']} | "
                          f"{f['tokens']} tokens ({f['cached']} cached): {f['mismatches'][0]}")
        console.print("[bold green]all byte-exact[/]" if not failures else f"[bold red]{len(failures)} failed[/]")
    if failures:
        raise typer.Exit(1)


# --------------------------------------------------------------------------------------------- bench
@app.command()
@_friendly_errors
def bench(
    model: str = typer.Option("llama-3-8b", help="Preset geometry."),
    tokens: int = typer.Option(4096, min=1),
    prefill_tp: int = typer.Option(1, min=1), decode_tp: int = typer.Option(2, min=1),
    prefill_block_size: int = typer.Option(16, min=1), decode_block_size: int = typer.Option(16, min=1),
    prefill_layout: Order = typer.Option(Order.HND), decode_layout: Order = typer.Option(Order.HND),
    repeats: int = typer.Option(7, min=1, help="Interleaved repetitions; medians are reported."),
    transport: Transport = typer.Option(Transport.local, help="local executor, or a real engine between processes."),
    op: Mode = typer.Option(Mode.pull, help="pull (READ) or push (WRITE), for --transport shm/nixl/mooncake."),
    offload: bool = typer.Option(False, help="GPU<->CPU offload store and load instead of a P/D transfer."),
    engine: Engine = typer.Option(Engine.kvbridge, help="vllm: KVBridgeConnector vs vLLM's NixlConnector per request."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Our copies vs a plain contiguous copy of the same bytes, side by side in one run."""
    if engine == Engine.vllm:
        from kvbridge.bench.vllm import bench_vllm
        out = bench_vllm(None, prefill_tp, decode_tp)
        _print_json(out) if as_json else console.print(out)
        return
    from kvbridge.models.presets import PRESETS
    if model not in PRESETS:
        from kvbridge.errors import ConfigError
        raise ConfigError(f"unknown preset {model!r}; choose one of: {', '.join(PRESETS)}")
    prefill = EngineLayout(prefill_tp, prefill_block_size, kv_order=prefill_layout.value)
    decode = EngineLayout(decode_tp, decode_block_size, kv_order=decode_layout.value)
    progress = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, disable=as_json)
    with progress:
        task = progress.add_task("repeats", total=repeats)
        tick = lambda done, total: progress.update(task, completed=done)  # noqa: E731
        if offload:
            from kvbridge.bench.offload import bench_offload
            result: Any = bench_offload(model, tokens, prefill_block_size, tp_size=prefill_tp, repeats=repeats,
                                        progress=tick)
        elif transport != Transport.local:
            from kvbridge.bench.transport import bench_transport
            result = bench_transport(transport.value, model, tokens, prefill, decode,
                                     op="read" if op == Mode.pull else "write", repeats=repeats, progress=tick)
        else:
            from kvbridge.bench.local import bench_local
            result = bench_local(model, tokens, prefill, decode, repeats, progress=tick)
    out = result.to_dict()
    if as_json:
        _print_json(out)
        return
    if offload or transport != Transport.local:
        table = Table(title=f"{model}, {tokens} tokens ({'offload' if offload else transport.value})", show_header=False)
        for key, value in out.items():
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        console.print(table)
        console.print(f"medians of {repeats} interleaved repetitions; compare ratios, not absolute times")
        return
    table = Table(title=f"{model}, {tokens} tokens: {result.prefill} -> {result.decode}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("bytes moved", f"{result.bytes / 2**20:.1f} MiB in {result.num_runs:,} runs "
                                 f"(mean {result.mean_run_bytes / 1024:.1f} KiB)")
    table.add_row(f"kvbridge local executor ({result.backend})", f"{result.executor_gbps:.2f} GB/s")
    table.add_row("contiguous copy of the same bytes", f"{result.contiguous_gbps:.2f} GB/s")
    table.add_row("ratio (executor / contiguous)", f"{result.ratio:.2f}x")
    table.add_row("planning time", f"{result.plan_seconds * 1e3:.2f} ms "
                                   f"({result.plan_fraction:.1%} of the copy)")
    console.print(table)
    console.print(f"medians of {repeats} interleaved repetitions; compare ratios, not absolute times")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

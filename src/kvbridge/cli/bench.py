"""`kvbridge bench`: our copies beside a plain contiguous copy of the same bytes, in one run."""

from __future__ import annotations

from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge.bench.planning import DEFAULT_LINK_GBPS
from kvbridge.cli.app import (BOUNDS, Engine, Mode, Order, Transport, app, check_bounds, console, err_console,
                              friendly_errors, print_json)
from kvbridge.core.layout import EngineLayout
from kvbridge.errors import ConfigError


# The options each bench runner reads; one given on the command line to a runner that ignores it
# exits 2 naming the runner that takes it (as `demo` does).
_SHAPE = {"prefill_tp", "decode_tp", "prefill_block_size", "decode_block_size", "prefill_layout", "decode_layout"}
_COMMON = {"as_json", "transport", "offload", "engine", "staged", "serve", "pool", "routing"}
BENCH_RUNNERS: dict[str, set[str]] = {
    "local": _COMMON | _SHAPE | {"model", "tokens", "repeats", "link_gbps"},
    "staged": _COMMON | _SHAPE | {"model", "tokens", "repeats"},
    "offload": _COMMON | {"model", "tokens", "repeats", "prefill_tp", "prefill_block_size", "device"},
    "transport": _COMMON | _SHAPE | {"model", "tokens", "repeats", "op"},
    "vllm": _COMMON | {"prefill_tp", "decode_tp"},
    "serve": _COMMON | {"prefill_tp", "decode_tp", "prefill_block_size", "decode_block_size", "repeats"},
    "pool": _COMMON | {"tokens", "repeats"},
    "routing": _COMMON | {"repeats"},
}
BENCH_FLAGS = {"local": "the local executor (default)", "staged": "--staged", "offload": "--offload",
               "transport": "--transport shm|nixl|mooncake", "vllm": "--engine vllm", "serve": "--serve", "pool": "--pool",
               "routing": "--routing"}


def torch_cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _bench_runner(transport: Any, offload: bool, engine: Any, staged: bool, serve: bool = False,
                  pool: bool = False) -> str:
    if pool:
        return "pool"
    if serve:
        return "serve"
    if engine == Engine.vllm:
        return "vllm"
    if staged:
        return "staged"
    if offload:
        return "offload"
    return "local" if transport == Transport.local else "transport"


def _refuse_ignored(ctx: typer.Context, runner: str) -> None:
    takes = BENCH_RUNNERS[runner]
    for name in ctx.params:
        source = ctx.get_parameter_source(name)
        if getattr(source, "name", None) != "COMMANDLINE" or name in takes:
            continue
        flag = "--json" if name == "as_json" else "--" + name.replace("_", "-")
        others = [BENCH_FLAGS[r] for r, opts in BENCH_RUNNERS.items() if name in opts and r != runner]
        raise ConfigError(f"{flag} does not apply to bench with {BENCH_FLAGS[runner]}"
                          + (f"; it is taken with {' or '.join(others)}" if others else ""))


@app.command()
@friendly_errors
def bench(
    ctx: typer.Context,
    model: str = typer.Option("llama-3-8b", help="Preset geometry."),
    tokens: int = typer.Option(4096, min=1),
    prefill_tp: int = typer.Option(1, min=1), decode_tp: int = typer.Option(2, min=1),
    prefill_block_size: int = typer.Option(16, min=1), decode_block_size: int = typer.Option(16, min=1),
    prefill_layout: Order = typer.Option(Order.HND, case_sensitive=False), decode_layout: Order = typer.Option(Order.HND, case_sensitive=False),
    repeats: int = typer.Option(7, min=1, help="Interleaved repetitions; medians are reported (--serve: rounds "
                                "per dataset and connector of 64 prompts each, default 5)."),
    transport: Transport = typer.Option(Transport.local, help="local executor, or a real engine between processes."),
    op: Mode = typer.Option(Mode.pull, help="pull (READ) or push (WRITE), for --transport shm/nixl/mooncake."),
    offload: bool = typer.Option(False, help="GPU<->CPU offload store and load instead of a P/D transfer."),
    device: str = typer.Option("cpu", help="--offload: where the engine's cache lives (cpu, or cuda with a "
                               "pinned pool, against a plain device<->host copy)."),
    engine: Engine = typer.Option(Engine.kvbridge, help="vllm: KVBridgeConnector vs vLLM's NixlConnector per request."),
    staged: bool = typer.Option(False, help="Device staging (gather / one copy / scatter per rank pair) beside "
                                "the direct executor and one contiguous copy, with the path each pair took."),
    link_gbps: float = typer.Option(DEFAULT_LINK_GBPS, min=0.001, help="Link speed of each decode rank in "
                                    "Gbit/s that planning time is set against: the request's time is its busiest "
                                    "decode rank's bytes at this speed, as `kvbridge plan` computes it."),
    serve: bool = typer.Option(False, help="Serving: `vllm bench serve` (random and prefix-repetition) through "
                               "vllm-router against a fleet of one prefill and one decode instance of the "
                               "--prefill-/--decode- TP and block sizes (block default 32), with KVBridgeConnector "
                               "and with vLLM's NixlConnector in turns; needs `make vllm-env`."),
    pool: bool = typer.Option(False, help="The shared pool: store from TP 2 / block 16 and load into TP 1 / block 64 "
                              "from another process through this host's shared-memory tier (64- and 1024-token pool "
                              "blocks), then through a Mooncake Store (a master started here), sealing and checking "
                              "included, each beside a contiguous copy of the same bytes (serving figures: `make "
                              "pool-bench`)."),
    routing: bool = typer.Option(False, help="Routing policies (kv_aware, cache_aware, round_robin) side by side: "
                                 "a fleet of prefill blocks 64 and 32 per policy, in turn, given shared prefixes and "
                                 "a multi-turn chat by `vllm bench serve`; prefix hit rate, TTFT, failures, answers "
                                 "against a plain instance (--repeats: rounds, default 2; needs `make vllm-env`)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Our copies vs a plain contiguous copy of the same bytes, side by side in one run."""
    if routing:
        _refuse_ignored(ctx, "routing")
        if serve or pool or offload or staged or transport != Transport.local or engine == Engine.vllm:
            raise ConfigError("--routing runs its own fleets: drop --serve, --pool, --transport, --offload, --staged "
                              "and --engine")
        rounds = repeats if ctx.get_parameter_source("repeats").name == "COMMANDLINE" else 2
        if not 1 <= rounds <= 20:
            raise ConfigError(f"--repeats for --routing (rounds of each workload per policy) must be in 1..20, "
                              f"got {rounds}")
        from kvbridge.bench import exit_on_sigterm
        from kvbridge.bench.routing import bench_routing

        exit_on_sigterm()  # a killed run still stops the fleets it started
        with console.status("one fleet per routing policy, in turn, then vllm bench serve", spinner="dots") \
                if not as_json else _nothing():
            out = bench_routing(rounds=rounds)
        print_json(out) if as_json else routing_table(out)
        return
    if pool:
        _refuse_ignored(ctx, "pool")
        if serve or offload or staged or transport != Transport.local or engine == Engine.vllm:
            raise ConfigError("--pool runs its own engines and store: drop --serve, --transport, --offload, --staged "
                              "and --engine")
        if not 64 <= tokens <= 65536 or tokens % 64:
            raise ConfigError(f"--tokens for --pool must be a multiple of the 64-token pool block in [64, 65536], "
                              f"got {tokens}")
        from kvbridge.bench.pool import bench_pool_transfer
        from kvbridge.bench.pool_host import bench_host_transfer
        with console.status("storing into this host's tier, loading from another process", spinner="dots") \
                if not as_json else _nothing():
            host = bench_host_transfer(tokens=tokens, rounds=min(max(repeats, 3), 20),
                                       block_sizes=tuple(b for b in (64, 1024) if b <= tokens))
        with console.status("storing and loading through a Mooncake Store", spinner="dots") \
                if not as_json else _nothing():
            out = bench_pool_transfer(tokens=tokens, rounds=min(repeats, 20))
        if as_json:  # docs/pool-transfer.json is one (scripts/serve_tables.py renders docs/pool.md's table)
            import datetime
            import os
            print_json({"date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
                        "command": f"kvbridge bench --pool --tokens {tokens} --repeats {repeats}",
                        "host_tier": host, "mooncake": out})
        else:
            host_table(host)
            pool_table(out)
        return
    if serve:
        _refuse_ignored(ctx, "serve")
        if transport != Transport.local or offload or staged or engine == Engine.vllm:
            raise ConfigError("--serve runs its own fleets: drop --transport, --offload, --staged and --engine")
        blocks = [b if ctx.get_parameter_source(n).name == "COMMANDLINE" else 32
                  for n, b in (("prefill_block_size", prefill_block_size), ("decode_block_size", decode_block_size))]
        from kvbridge.bench import exit_on_sigterm
        from kvbridge.bench.serving import bench_serve

        exit_on_sigterm()  # a killed run still stops the fleets it started
        with console.status("starting both fleets, then vllm bench serve in turns", spinner="dots") \
                if not as_json else _nothing():
            rounds = repeats if ctx.get_parameter_source("repeats").name == "COMMANDLINE" else 5
            if not 1 <= rounds <= 20:
                raise ConfigError(f"--repeats for --serve (rounds of each dataset per connector) must be in 1..20, "
                                  f"got {rounds}")
            out = bench_serve(prefill=f"tp={prefill_tp},block={blocks[0]}", decode=f"tp={decode_tp},block={blocks[1]}",
                              rounds=rounds)
        if as_json:
            print_json(out)
        else:
            serve_table(out)
        return
    if staged and (offload or transport != Transport.local or engine == Engine.vllm):
        raise ConfigError("--staged compares paths of the local executor: drop --offload, --transport and --engine")
    if offload and (transport != Transport.local or engine == Engine.vllm):
        raise ConfigError("--offload measures GPU<->CPU store and load in this process: drop --transport and --engine")
    if engine == Engine.vllm and transport != Transport.local:
        raise ConfigError("--engine vllm runs vLLM's own connectors against KVBridgeConnector: drop --transport")
    _refuse_ignored(ctx, _bench_runner(transport, offload, engine, staged))
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device is cpu or cuda, not {device!r}")
    if device == "cuda" and not torch_cuda_available():
        raise ConfigError("--device cuda: this torch build sees no CUDA device")
    check_bounds(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_block_size=prefill_block_size,
                 decode_block_size=decode_block_size, repeats=repeats, link_gbps=link_gbps)
    if tokens > BOUNDS["bench_tokens"]:
        raise ConfigError(f"--tokens {tokens} is above kvbridge's bound of {BOUNDS['bench_tokens']:,} for bench "
                          f"(it allocates and moves the request's bytes in this process; `kvbridge plan` explains "
                          f"longer requests)")
    if engine == Engine.vllm:
        from kvbridge.cli.demo import _check_vllm_shape
        _check_vllm_shape(None, prefill_tp, decode_tp)  # before any instance starts, as demo --engine vllm
        from kvbridge.bench.vllm import bench_vllm
        out = bench_vllm(None, prefill_tp, decode_tp)
        print_json(out) if as_json else console.print(out)
        return
    from kvbridge.models.presets import PRESETS
    if model not in PRESETS:
        raise ConfigError(f"unknown preset {model!r}; choose one of: {', '.join(PRESETS)}")
    prefill = EngineLayout(prefill_tp, prefill_block_size, kv_order=prefill_layout.value)
    decode = EngineLayout(decode_tp, decode_block_size, kv_order=decode_layout.value)
    progress = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, disable=as_json)
    with progress:
        task = progress.add_task("repeats", total=repeats)
        tick = lambda done, total: progress.update(task, completed=done)  # noqa: E731
        if staged:
            from kvbridge.bench.staging import bench_staging_pair
            result = bench_staging_pair(model, tokens, prefill, decode, repeats)
        elif offload:
            from kvbridge.bench.offload import bench_offload
            result: Any = bench_offload(model, tokens, prefill_block_size, tp_size=prefill_tp, repeats=repeats,
                                        progress=tick, device=device)
        elif transport != Transport.local:
            from kvbridge.bench.transport import bench_transport
            result = bench_transport(transport.value, model, tokens, prefill, decode,
                                     op="read" if op == Mode.pull else "write", repeats=repeats, progress=tick)
        else:
            from kvbridge.bench.local import bench_local
            result = bench_local(model, tokens, prefill, decode, repeats, progress=tick, link_gbps=link_gbps)
    out = result.to_dict()
    if as_json:
        print_json(out)
        return
    if staged or offload or transport != Transport.local:
        what = "device staging" if staged else "offload" if offload else transport.value
        table = Table(title=f"{model}, {tokens} tokens ({what})", show_header=False)
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
    table.add_row("planning per request, warm (median)", f"{result.plan_warm_seconds * 1e3:.3f} ms "
                                                         f"({result.plan_fraction:.1%} of the copy)")
    table.add_row(f"transfer at {result.link_gbps:g} Gbit/s per decode rank (busiest rank's bytes)",
                  f"{result.link_seconds * 1e3:.2f} ms")
    table.add_row("planning / transfer", f"{result.plan_link_percent:.2f}%")
    table.add_row("planning, cold (the pair's first request)", f"{result.plan_cold_seconds * 1e3:.2f} ms")
    table.add_row("planning token by token (reference)", f"{result.plan_reference_seconds * 1e3:.3f} ms")
    console.print(table)
    console.print(f"medians of {repeats} interleaved repetitions; compare ratios, not absolute times")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def host_table(out: dict[str, Any]) -> None:
    table = Table(title=f"pool host tier: {out['store_engine']} stores, {out['load_engine']} loads, {out['model']}; "
                        f"each side beside a copy of the same bytes in its own process, median of the rounds")
    for col in ("pool block", "MiB", "store GB/s", "store vs copy", "load GB/s", "load vs copy", "copy GB/s",
                "AES-GCM alone vs copy"):
        table.add_column(col, justify="right")
    for r in out["rows"]:
        table.add_row(f"{r['pool_block_tokens']} tokens", f"{r['bytes'] / 2**20:.0f}", f"{r['store_gb_s']:.2f}",
                      f"{r['store_vs_copy']:.3f}", f"{r['load_gb_s']:.2f}", f"{r['load_vs_copy']:.3f}",
                      f"{r['copy_gb_s_store_side']:.1f} / {r['copy_gb_s_load_side']:.1f}",
                      f"{r['seal_only_vs_copy']:.3f} ({r['seal_threads']} threads, "
                      f"{r['seal_object_bytes'] // 1024} KiB objects)")
    console.print(table)


def pool_table(out: dict[str, Any]) -> None:
    table = Table(title=f"shared pool: {out['store_engine']} stores, {out['load_engine']} loads, {out['tokens']} "
                        f"tokens of {out['spec']} ({out['bytes'] / 2**20:.0f} MiB), median of {out['rounds']}")
    for col in ("", "GB/s", "vs copy"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("store (device -> staging -> seal -> put)", f"{out['store_gb_s']:.2f}", f"{out['store_vs_copy']:.3f}")
    table.add_row("load by another instance (get -> check -> staging -> device)", f"{out['load_gb_s']:.2f}",
                  f"{out['load_vs_copy']:.3f}")
    if "reload_gb_s" in out:
        table.add_row("reload by the writer (its own segment)", f"{out['reload_gb_s']:.2f}", f"{out['reload_vs_copy']:.3f}")
    table.add_row("contiguous copy of the same bytes", f"{out['copy_gb_s']:.2f}", "1")
    console.print(table)


def _step_path_table(out: dict[str, Any]) -> None:
    """kvbridge's calls on its decode instance's step path in the measured rounds (issue 31)."""
    rows = [(r["dataset"], r["kvbridge"]["step_path"]) for r in out["table"] if "step_path" in r.get("kvbridge", {})]
    if not rows:
        return
    t = Table(title="kvbridge on its decode instance's step path, measured rounds (sidecar rounds run beside it)")
    for col in ("dataset", "call", "calls", "p50 ms", "p99 ms", "max ms", "all calls"):
        t.add_column(col)
    for ds, prof in rows:
        for kind, c in prof["calls"].items():
            if kind == "sidecar":  # CPU ms: a round's wall time includes the idle fleet's SIGSTOP
                cells = [c.get("p50_cpu_ms"), c.get("p99_cpu_ms"), c["max_cpu_ms"]]
                total = f"{c['cpu_ms']:,.0f} ms CPU"
            else:
                cells, total = [c["p50_ms"], c["p99_ms"], c["max_ms"]], f"{c['total_ms']:,.1f} ms"
            t.add_row(ds, kind, str(c["calls"]), *("-" if x is None else f"{x:.3f}" for x in cells), total)
    console.print(t)


def _rounds_table(out: dict[str, Any]) -> None:
    """Each round's figures side by side, and in how many rounds kvbridge was at or ahead (issue 46.2)."""
    rows = [r for r in out["table"] if "rounds_ahead" in r]
    if not rows:
        return
    from kvbridge.bench.serving import round_cells
    table = Table(title="round by round (kvbridge / NIXL; rounds ran in turns), and rounds kvbridge was at or ahead")
    for col in ("dataset", "figure", "per round: kvbridge / NIXL", "kvbridge spread", "NIXL spread", "at or ahead"):
        table.add_column(col)

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"

    for row in rows:
        for cells in round_cells(row, fmt):
            table.add_row(row["dataset"], *cells)
    console.print(table)


def routing_table(out: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"routing policies: prefill {' + '.join(out['prefill'])}, decode {' + '.join(out['decode'])}, "
                    f"{out['prompts']} prompts, {out['concurrency']} at once, {out['rounds']} rounds")
    for c in ("workload", "policy", "prefix hits", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "failed",
              "answers = plain"):
        t.add_column(c)
    for r in out["rows"]:
        if "error" in r:
            t.add_row(r["workload"], r["policy"], f"error: {r['error'][-120:]}")
            continue
        t.add_row(r["workload"], r["policy"], f"{r.get('hit_rate', 0) or 0:.1%}", f"{r['median_ttft_ms']:.0f}",
                  f"{r['p99_ttft_ms']:.0f}", f"{r['output_throughput']:.1f}", str(r["failed"]),
                  f"{r['answers_equal']}/{r['answers']}")
    console.print(t)


def serve_table(out: dict[str, Any]) -> None:
    """The serving benchmark as tables: both connectors' figures and the ratios per dataset, then
    the decode instance's step-time histogram and what else the host ran."""
    table = Table(title=f"vllm bench serve through vllm-router: prefill {out['prefill']} -> decode {out['decode']}, "
                  f"{out['prompts']} prompts, {out['concurrency']} in flight, {out['rounds']} rounds")
    keys = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms",
            "output_throughput")
    for col in ("dataset", "connector", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms",
                "ITL p99 ms", "ITL max ms", "out tok/s", "completed", "failed"):
        table.add_column(col)
    steps = Table(title="decode instance: steps by time (vLLM's iteration log), all rounds")
    buckets = None
    for row in out["table"]:
        for c in ("kvbridge", "nixl", "ratios"):
            v = row.get(c)
            if v is None:
                continue
            if "refused" in v:
                table.add_row(row["dataset"], "nixl", "refused: " + str(v["refused"]), *[""] * 9)
                continue
            cells = [f"{v[k]:.2f}" if isinstance(v.get(k), (int, float)) else "-" for k in keys]
            tail = ["", ""] if c == "ratios" else [str(v.get("completed")), str(v.get("failed"))]
            table.add_row(row["dataset"], "NIXL / kvbridge (tok/s: kvbridge / NIXL)" if c == "ratios" else c,
                          *cells, *tail)
            if c != "ratios":
                h = v["decode_steps"]
                if buckets is None:
                    buckets = list(h["buckets"])
                    for col in ("dataset", "connector", "steps", "p50 ms", "p99 ms", "max ms", *buckets):
                        steps.add_column(col)
                steps.add_row(row["dataset"], c, str(h["steps"]), *[f"{h[k]:.1f}" if h[k] is not None else "-"
                                                                   for k in ("p50_ms", "p99_ms", "max_ms")],
                              *[str(h["buckets"][b]) for b in buckets])
    console.print(table)
    _rounds_table(out)
    if buckets:
        console.print(steps)
    _step_path_table(out)
    others = [h for row in out["table"] for c in ("kvbridge", "nixl") if "host" in row[c] for h in row[c]["host"]]
    if others:
        console.print(f"host: {out.get('cores')} cores; load average (1 min) at the runs' starts "
                      f"{min(h['load_avg_1m'][0] for h in others):.1f}..{max(h['load_avg_1m'][0] for h in others):.1f}; "
                      f"other processes used {sum(h['others_cpu_s'] for h in others):.0f} of "
                      f"{sum(h['host_cpu_s'] for h in others):.0f} CPU-seconds during the runs")
    if out.get("warmup_seconds"):
        console.print(f"fleets healthy after {out['startup_seconds']:.0f} s; unmeasured warm-up (first steps compile): "
                      + ", ".join(f"{c} {s:.0f} s" for c, s in out["warmup_seconds"].items()))
    console.print("compare the ratios, measured side by side in one run; absolute times on a shared host are noise")

"""`kvbridge demo`: the transformers proof, run by one of five runners chosen by the options.

The runner is `--engine vllm`, else `--offload`, else `--role decode`, else `--transport`
(local: one process; shm/nixl/mooncake: one process per rank). Each runner's options are
grouped under its own heading in `--help`; an option given to a runner that does not take it
exits 2 naming the runner that does, so nothing is silently ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvbridge.cli.app import (BOUNDS, Engine, Mode, Order, Role, Transport, app, check_bounds, check_secret_file,
                              console, friendly_errors, load_spec, nullcontext, parse_ids, print_json)
from kvbridge.cli.demo_configs import (DEFAULT_MODEL, RUNNER_FLAGS, RUNNERS, DecodeClient, LocalDemo, OffloadDemo,
                                       TransportDemo, VllmDemo)
from kvbridge.cli import shapes as sh
from kvbridge.cli.shapes import SideShape
from kvbridge.errors import ConfigError, InvalidRequest, KVBridgeError

_KEYS = ("model", "transport", "mode", "prefill", "decode", "tokens_reference", "tokens_disaggregated",
         "tokens_offload", "match", "cache_equal", "kv_conversion", "elements_checked", "bytes_moved", "num_runs", "plan_seconds", "transfer_seconds",
         "store_engine", "load_engine", "pool", "hit_tokens", "bytes_stored", "bytes_loaded", "store_seconds",
         "load_seconds", "requests_ok")

MODEL = "Model and prompt"
SHAPES = "Engine shapes"
MULTI = "Processes and transports (--transport shm|nixl|mooncake, --role decode)"
RUNNER = "Runner"


def _show(out: dict[str, Any], title: str) -> None:
    table = Table(title=title, show_header=False)
    for key in _KEYS:
        if key in out and out[key] is not None:
            value = out[key]
            if isinstance(value, float):
                value = f"{value * 1e3:.2f} ms" if key.endswith("seconds") else f"{value:.3f}"
            table.add_row(key, str(value))
    console.print(table)
    for w in out.get("warnings") or ():
        console.print(f"[yellow]warning:[/] {escape(str(w))}", soft_wrap=True, highlight=False)


def _runner(engine: Engine, offload: bool, role: Role, transport: Transport) -> str:
    if engine == Engine.vllm:
        return "vllm"
    if offload:
        return "offload"
    if role == Role.decode:
        return "decode"
    return "local" if transport == Transport.local else "transport"


def _refuse_foreign_options(ctx: typer.Context, runner: str) -> None:
    """Exit 2 on an option the chosen runner would ignore, naming a runner that takes it."""
    takes = RUNNERS[runner].OPTIONS
    for name, value in ctx.params.items():
        source = ctx.get_parameter_source(name)  # typer's click: compare by name, not by enum class
        if getattr(source, "name", None) != "COMMANDLINE" or name in takes:
            continue
        flag = "--" + name.replace("_", "-") if name != "as_json" else "--json"
        if name == "prefill":
            raise InvalidRequest("--prefill HOST:PORT is the prefill server of `--role decode`; add --role decode")
        others = [RUNNER_FLAGS[r] for r, cfg in RUNNERS.items() if name in cfg.OPTIONS]
        raise InvalidRequest(f"{flag} does not apply to the {RUNNER_FLAGS[runner]} demo"
                             + (f"; it is taken with {' or '.join(others)}" if others else ""))


def _refuse_contradictions(ctx: typer.Context, runner: str, transport: Transport, secret_file: Path | None,
                           insecure: bool) -> None:
    """Exit 2 on options given together that the runner cannot honour both of (one would be ignored)."""
    def given(name: str) -> bool:
        return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"
    if given("prompt_ids") and given("prompt_len"):
        raise InvalidRequest("--prompt-ids and --prompt-len both give the prompt: drop one")
    if transport == Transport.local and given("transport") and runner in ("vllm", "decode"):
        what = "--engine vllm runs each vLLM instance in its own process" if runner == "vllm" else \
            "--role decode reaches a prefill server in another process"
        raise InvalidRequest(f"--transport local moves bytes inside one process; {what}: use --transport shm, "
                             f"nixl or mooncake")
    if insecure and secret_file:
        raise ConfigError("--insecure and --secret-file contradict each other: give one")


def _check_writable(path: Path, flag: str) -> None:
    """Refuse, before the run, a file the run could not write at its end."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: a directory; give a file name (.safetensors)")
    parent = path.expanduser().absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write there ({parent} is not a writable directory)")


def _check_vllm_shape(model: str | None, prefill_tp: int, decode_tp: int, prefill_block_size: int | None = None,
                      decode_block_size: int | None = None) -> None:
    """The checks vLLM runs on the shapes (in its config validation, 20 s into an instance's start)
    and kvbridge's own, before any instance starts."""
    from kvbridge.core.layout import EngineLayout
    from kvbridge.proofs.vllm.cluster import check_block_size
    for flag, size in (("--prefill-block-size", prefill_block_size), ("--decode-block-size", decode_block_size)):
        try:
            check_block_size(size)
        except KVBridgeError as e:
            raise ConfigError(f"{flag} {size}: {str(e).split(' (e.g.')[0]}") from None
    if model is not None and not Path(model).expanduser().is_dir():
        load_spec(model, "--model", presets=False)  # says what is wrong: missing path, a file, a name
        raise ConfigError(f"--model {model}: --engine vllm takes a model DIR (config.json and weights)")
    if model is None:
        import inspect
        from kvbridge.proofs.vllm.model import make_tiny_llama
        defaults = inspect.signature(make_tiny_llama).parameters
        heads, what = defaults["num_heads"].default, "the demo's tiny Llama"
        from kvbridge.core.spec import ModelSpec
        spec = ModelSpec.uniform(defaults["num_layers"].default, defaults["num_kv_heads"].default,
                                 defaults["head_dim"].default, "float32", "tiny-llama")
    else:
        from kvbridge.proofs.workload import model_config
        config = model_config(model)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads, what = int(getattr(text, "num_attention_heads", 0) or 0), model
        spec = load_spec(model, "--model", presets=False)
    for flag, tp in (("--prefill-tp", prefill_tp), ("--decode-tp", decode_tp)):
        if heads and heads % tp:  # vLLM's ModelConfig.verify_with_parallel_config, its sentence
            raise ConfigError(f"{flag} {tp}: vLLM refuses {what}: Total number of attention heads ({heads}) must be "
                              f"divisible by tensor parallel size ({tp}).")
        try:
            EngineLayout(tp, 32).check_model(spec, f"{flag} {tp}")
        except KVBridgeError as e:
            raise ConfigError(str(e)) from None


def _context_length(model: str) -> int | None:
    """The model's maximum sequence length (`max_position_embeddings`), when its config says."""
    if model is None:
        return None
    try:
        from kvbridge.proofs.workload import model_config
        config = model_config(model)
    except ConfigError:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


@app.command()
@friendly_errors
def demo(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(
        None, help="Built-in model NAME or a model DIR (its weights, or random ones drawn from its config.json alone) [default: tiny-llama; tiny-gemma2 with "
        "--offload; a tiny Llama DIR it writes with --engine vllm].", rich_help_panel=MODEL),
    prompt_ids: Optional[str] = typer.Option(None, help="Comma-separated prompt token ids, e.g. 1,2,3.",
                                             rich_help_panel=MODEL),
    prompt_len: int = typer.Option(32, min=1, help="Random prompt length (without --prompt-ids).",
                                   rich_help_panel=MODEL),
    new_tokens: int = typer.Option(8, min=1, help="Tokens to generate.", rich_help_panel=MODEL),
    seed: int = typer.Option(0, help="Seed for weights, prompt and block ids.", rich_help_panel=MODEL),
    prefill_tp: int = typer.Option(1, min=1, help="TP size of the prefill engine.", rich_help_panel=SHAPES),
    decode_tp: int = typer.Option(2, min=1, help="TP size of the decode engine.", rich_help_panel=SHAPES),
    prefill_block_size: Optional[int] = typer.Option(
        None, min=1, help="Tokens per block [default: 16, or a multiple of every compress rate of the model; 32 with --engine vllm].", rich_help_panel=SHAPES),
    decode_block_size: Optional[int] = typer.Option(
        None, min=1, help="Tokens per block [default: 16, or a multiple of every compress rate of the model; 32 with --engine vllm].", rich_help_panel=SHAPES),
    prefill_kernel_block_size: Optional[int] = typer.Option(
        None, min=1, help="Kernel block size [default: the block size].", rich_help_panel=SHAPES),
    decode_kernel_block_size: Optional[int] = typer.Option(
        None, min=1, help="Kernel block size [default: the block size].", rich_help_panel=SHAPES),
    prefill_layout: Order = typer.Option(Order.HND, case_sensitive=False, rich_help_panel=SHAPES),
    decode_layout: Order = typer.Option(Order.HND, case_sensitive=False, rich_help_panel=SHAPES),
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
    prefill_group_block_sizes: sh.PrefillGroupBlocks = None,
    decode_group_block_sizes: sh.DecodeGroupBlocks = None,
    prefill_kv_dtype: Optional[str] = typer.Option(
        None, help="KV cache dtype, e.g. fp8 (e4m3), fp8_e5m2, bfloat16 [default: the model's]; another dtype "
        "than the model's is proven element by element (lossy by nature). Local runner.", rich_help_panel=SHAPES),
    decode_kv_dtype: sh.DecodeKvDtype = None,
    num_cached_tokens: int = typer.Option(
        0, min=0, help="Prefix the decode side already holds (any count below the prompt length, as the "
        "planner takes it); only the rest moves. Local runner.", rich_help_panel=SHAPES),
    transport: Transport = typer.Option(
        Transport.local, case_sensitive=False, help="local: one process; shm/nixl/mooncake: one process per "
        "rank [default with --role decode: shm, as prefill-server].", rich_help_panel=RUNNER),
    role: Role = typer.Option(Role.both, case_sensitive=False, help="decode: only the decode half, against a "
                              "`kvbridge prefill-server`.", rich_help_panel=RUNNER),
    offload: bool = typer.Option(False, help="Store a prefix to CPU, evict, load it back, decode.",
                                 rich_help_panel=RUNNER),
    engine: Engine = typer.Option(Engine.kvbridge, case_sensitive=False, help="vllm: two vLLM CPU instances "
                                  "with KVBridgeConnector (needs `make vllm-env`).", rich_help_panel=RUNNER),
    mode: Mode = typer.Option(Mode.pull, case_sensitive=False, help="pull: decode reads (NIXL style); push: "
                              "prefill writes (Mooncake style).", rich_help_panel=MULTI),
    requests: int = typer.Option(1, min=1, help="Requests in flight at once.", rich_help_panel=MULTI),
    timeout: float = typer.Option(120.0, min=1.0, help="Deadline in seconds for every wait.",
                                  rich_help_panel=MULTI),
    prefill: Optional[str] = typer.Option(None, help="HOST:PORT of the prefill server (--role decode).",
                                          rich_help_panel=MULTI),
    secret_file: Optional[Path] = typer.Option(
        None, help="Side-channel secret, a 0600 file shared with the prefill server (--role decode).",
        rich_help_panel=MULTI),
    insecure: bool = typer.Option(False, help="No side-channel authentication (--role decode; trusted "
                                  "networks only).", rich_help_panel=MULTI),
    dump_decode_cache: Optional[Path] = typer.Option(None, help="Write the reassembled decode cache "
                                                     "(.safetensors)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Prefill on one engine shape, move the KV cache, decode on another; compare
    with `generate`. Five runners; each refuses an option it does not take:

    \b
    local      (default) --prefill-*/--decode-* shapes (TP, PP, CP, blocks,
               layouts, KV dtype), --num-cached-tokens
    transport  --transport shm|nixl|mooncake: one process per rank;
               shapes, --mode, --requests, --timeout
    decode     --role decode --prefill HOST:PORT: the decode half against
               `kvbridge prefill-server`; --decode-* shapes, --mode,
               --requests, --timeout, --secret-file or --insecure
    offload    --offload: --prefill-tp stores, --decode-tp loads
    vllm       --engine vllm: TP and block sizes, --transport, --mode,
               --requests
    """
    runner = _runner(engine, offload, role, transport)
    _refuse_foreign_options(ctx, runner)
    _refuse_contradictions(ctx, runner, transport, secret_file, insecure)
    check_bounds(prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_block_size=prefill_block_size,
                 decode_block_size=decode_block_size, prefill_kernel=prefill_kernel_block_size,
                 decode_kernel=decode_kernel_block_size, prompt_len=prompt_len, new_tokens=new_tokens,
                 requests=requests, timeout=timeout)
    ids = parse_ids(prompt_ids) if prompt_ids else None
    if ids is not None and len(ids) > BOUNDS["prompt_len"]:
        raise ConfigError(f"--prompt-ids has {len(ids)} ids, above kvbridge's bound of {BOUNDS['prompt_len']:,}")
    model = model or DEFAULT_MODEL[runner]
    prompt = len(ids) if ids else prompt_len
    limit = _context_length(model) if runner != "vllm" else None
    if limit is not None and prompt + new_tokens > limit:
        raise ConfigError(f"prompt ({prompt}) + new tokens ({new_tokens}) exceed {model}'s context of {limit} "
                          f"tokens (max_position_embeddings)")
    if role == Role.decode and not prefill:
        raise InvalidRequest("--role decode needs --prefill HOST:PORT of a running `kvbridge prefill-server`")
    if role == Role.decode and not (secret_file or insecure):
        raise ConfigError("--role decode needs --secret-file FILE (the prefill server's) or --insecure")
    check_secret_file(secret_file)
    if role == Role.decode and prefill:
        from kvbridge.connector.side_channel import parse_address
        try:
            parse_address(prefill)
        except KVBridgeError as e:
            raise InvalidRequest(f"--prefill {prefill}: {str(e).split(': ', 1)[-1]}") from None
    if dump_decode_cache is not None:
        _check_writable(dump_decode_cache, "--dump-decode-cache")
    if runner == "local" and not 0 <= num_cached_tokens < prompt:
        given = f"--prompt-ids ({prompt} ids)" if ids else f"--prompt-len {prompt}"
        raise InvalidRequest(f"--num-cached-tokens {num_cached_tokens} must be below {given} (a prefix hit "
                             f"leaves at least one token to move)")
    if runner == "vllm":
        _check_vllm_shape(model, prefill_tp, decode_tp, prefill_block_size, decode_block_size)
    shapes = {side: SideShape(side=side, tp=v[0], block_size=v[1], kernel_block_size=v[2], layout=v[3].value,
                              pp=v[4], layer_split=v[5], pcp=v[6], dcp=v[7], cp_interleave=v[8],
                              group_block_sizes=v[9], kv_dtype=v[10])
              for side, v in (("prefill", (prefill_tp, prefill_block_size, prefill_kernel_block_size, prefill_layout,
                                           prefill_pp, prefill_layer_split, prefill_pcp, prefill_dcp,
                                           prefill_cp_interleave, prefill_group_block_sizes, prefill_kv_dtype)),
                              ("decode", (decode_tp, decode_block_size, decode_kernel_block_size, decode_layout,
                                          decode_pp, decode_layer_split, decode_pcp, decode_dcp, decode_cp_interleave,
                                          decode_group_block_sizes, decode_kv_dtype)))}
    config = _config(runner, model, ids, prompt_len, new_tokens, seed, shapes, prefill_block_size, decode_block_size,
                     num_cached_tokens, transport, mode, requests, timeout, prefill, secret_file, insecure,
                     dump_decode_cache)
    status = console.status("prefill, transfer, decode ...", spinner="dots") if not as_json else nullcontext()
    with status:
        result = config.run()
    out = result if isinstance(result, dict) else result.to_dict()
    ok = bool(out.get("match")) if isinstance(result, dict) else (
        result.ok if runner in ("offload", "local") else result.match)
    lossy = bool(out.get("kv_conversion"))
    out.setdefault("transport", getattr(config, "transport", "local"))
    if as_json:
        print_json(out)
    else:
        _show(out, f"kvbridge demo ({RUNNER_FLAGS[runner]}): {out.get('model', model)}")
        verdict = "[bold green]MATCH[/]" if ok else "[bold red]MISMATCH[/]"
        what = "offloaded-and-reloaded" if runner == "offload" else "disaggregated"
        if lossy:
            console.print(f"{verdict}: KV dtype {out['kv_conversion']}: {out['elements_checked']:,} moved elements "
                          f"{'are each' if ok else 'are NOT all'} the reference conversion of their source; tokens "
                          f"{'equal' if out['match'] else 'differ from'} monolithic generate (not required: "
                          f"quantization is lossy by nature)")
        else:
            console.print(f"{verdict}: {what} tokens {'equal' if ok else 'differ from'} monolithic generate"
                          + ("" if ok or out.get("match") is False else " or the cache is not bit-exact"))
        if dump_decode_cache:
            console.print(f"decode cache written to {dump_decode_cache}")
    if not ok:
        raise typer.Exit(1)


def _config(runner: str, model: str, ids: list[int] | None, prompt_len: int, new_tokens: int, seed: int,
            shapes: dict[str, SideShape], prefill_block_size: int | None, decode_block_size: int | None,
            num_cached_tokens: int, transport: Transport, mode: Mode, requests: int, timeout: float,
            prefill: str | None, secret_file: Path | None, insecure: bool, dump: Path | None) -> Any:
    """The runner's typed config; engine layouts sized to the prompt and checked against the model."""
    prefill_tp, decode_tp = shapes["prefill"].tp, shapes["decode"].tp
    if runner == "vllm":
        return VllmDemo(model_dir=model, prompt_ids=ids, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed,
                        prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_block_size=prefill_block_size or 32,
                        decode_block_size=decode_block_size or 32,
                        transport="shm" if transport == Transport.local else transport.value, mode=mode.value,
                        requests=requests)
    if runner == "offload":
        load_spec(model, "--model", presets=False)  # a missing path or unknown name: one line, before any work
        import inspect
        from kvbridge.proofs.offload_demo import run_offload_demo
        defaults = inspect.signature(run_offload_demo).parameters
        block = defaults["block_size"].default * defaults["block_size_factor"].default
        if prompt_len <= block:
            raise InvalidRequest(f"--prompt-len {prompt_len}: --offload stores a prefix of whole {block}-token blocks "
                                 f"and computes the rest, so the prompt needs at least {block + 1} tokens")
        return OffloadDemo(model=model, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed,
                           store_tp=prefill_tp, load_tp=decode_tp)
    n = (len(ids) if ids else prompt_len) + new_tokens
    spec = load_spec(model, "--model", presets=False)
    decode = shapes["decode"].layout_for(spec, n, requests)
    common = {"model": model, "prompt_ids": ids, "prompt_len": prompt_len, "new_tokens": new_tokens, "seed": seed,
              "dump_decode_cache": dump}
    if runner == "decode":
        return DecodeClient(prefill=prefill or "", transport="shm" if transport == Transport.local else transport.value,
                            decode=decode, mode=mode.value, requests=requests, timeout=timeout,
                            secret_file=secret_file, insecure=insecure, **common)
    shape = shapes["prefill"].layout_for(spec, n, requests)
    if runner == "local":
        return LocalDemo(prefill=shape, decode=decode, num_cached_tokens=num_cached_tokens, **common)
    return TransportDemo(transport=transport.value, prefill=shape, decode=decode, mode=mode.value,
                         requests=requests, timeout=timeout, **common)

"""`kvbridge prefill-server`: the prefill half of the two-host demo (`demo --role decode` is the other)."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Optional

import typer

from kvbridge.cli.app import (
    Mode,
    Order,
    Transport,
    app,
    check_bounds,
    check_secret_file,
    console,
    err_console,
    friendly_errors,
    load_spec,
    parse_ids,
    print_json,
)
from kvbridge.cli.shapes import default_block_size
from kvbridge.core.layout import EngineLayout
from kvbridge.errors import ConfigError, InvalidRequest, KVBridgeError


def check_listen(listen: str) -> None:
    """Refuse, in one line naming --listen, an address this host cannot listen on: a malformed
    one, a wildcard (peers connect to what rank 0 advertises), one that is not this host's, or a
    port in use. A socket is bound and closed at once (the server binds it again after the prefill)."""
    from kvbridge.connector.side_channel import parse_address
    try:
        host, port = parse_address(listen)
    except KVBridgeError as e:
        raise ConfigError(f"--listen {listen}: {str(e).split(': ', 1)[-1]}") from None
    if host in ("0.0.0.0", "::", "*"):
        raise ConfigError(f"--listen {listen}: give a concrete address of this host (peers connect to the address "
                          f"rank 0 advertises), not a wildcard")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"--listen {listen}: cannot resolve {host!r} ({e.strerror or e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as e:
            why = "the port is in use" if e.errno == errno.EADDRINUSE else \
                "not an address of this host" if e.errno == errno.EADDRNOTAVAIL else (e.strerror or str(e))
            raise ConfigError(f"--listen {listen}: cannot listen there: {why}") from None


@app.command("prefill-server")
@friendly_errors
def prefill_server(
    ctx: typer.Context,
    listen: str = typer.Option("127.0.0.1:5600", help="HOST:PORT the decode side connects to."),
    model: str = typer.Option("tiny-llama", help="Built-in model NAME or a model DIR (its weights, or random ones drawn from its config.json alone)."),
    prompt_ids: Optional[str] = typer.Option(None, help="Comma-separated prompt token ids."),
    prompt_len: int = typer.Option(32, min=1), seed: int = typer.Option(0),
    prefill_tp: int = typer.Option(1, min=1), prefill_block_size: Optional[int] = typer.Option(
        None, min=1, help="Tokens per block [default: 16, or a multiple of every compress rate of the model]."),
    prefill_layout: Order = typer.Option(Order.HND, case_sensitive=False),
    transport: Transport = typer.Option(Transport.shm, case_sensitive=False, help="shm, nixl or mooncake."),
    mode: Mode = typer.Option(Mode.pull, case_sensitive=False),
    requests: int = typer.Option(1, min=1), timeout: float = typer.Option(120.0, min=1.0),
    secret_file: Optional[Path] = typer.Option(None, help="Side-channel secret: a 0600 file the decode side "
                                               "is given too (`(umask 077; head -c 32 /dev/urandom > FILE)`)."),
    insecure: bool = typer.Option(False, help="No side-channel authentication (trusted networks only)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The prefill half of the two-host demo: prefill, lease the blocks, serve one decode engine."""
    check_bounds(prefill_tp=prefill_tp, prefill_block_size=prefill_block_size, prompt_len=prompt_len,
                 requests=requests, timeout=timeout)
    if transport == Transport.local:
        raise InvalidRequest("prefill-server needs a transport between processes: shm, nixl or mooncake")
    if insecure and secret_file:
        raise ConfigError("--insecure and --secret-file contradict each other: give one")
    if prompt_ids and getattr(ctx.get_parameter_source("prompt_len"), "name", None) == "COMMANDLINE":
        raise InvalidRequest("--prompt-ids and --prompt-len both give the prompt: drop one")
    if not (secret_file or insecure):
        raise ConfigError("prefill-server needs --secret-file FILE (a 0600 file the decode side gets too) or "
                          "--insecure")
    ids = parse_ids(prompt_ids) if prompt_ids else None
    check_secret_file(secret_file)  # before the model is built and the prompt prefilled
    check_listen(listen)
    n = (len(ids) if ids else prompt_len) + 8
    spec = load_spec(model, "--model", presets=False)
    block = prefill_block_size or default_block_size(spec)
    shape = EngineLayout(prefill_tp, block, (-(-n // block) + 8) * requests, kv_order=prefill_layout.value)
    shape.check_model(spec, "prefill engine")
    from kvbridge.proofs.connector_demo import run_prefill_server
    result = run_prefill_server(listen, transport=transport.value, model=model, prompt_ids=ids,
                                prompt_len=None if ids else prompt_len, seed=seed, prefill=shape, mode=mode.value,
                                num_requests=requests, timeout=timeout, secret_file=secret_file, insecure=insecure,
                                on_listening=None if as_json else lambda a: err_console.print(f"listening on {a}"))
    if as_json:
        print_json(result.to_dict())
    else:
        console.print(result.to_dict())

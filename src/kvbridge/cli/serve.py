"""`kvbridge serve`: a P/D fleet of `vllm serve` instances of any shapes behind `vllm-router`."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from kvbridge.cli.app import app, console, err_console, friendly_errors
from kvbridge.errors import ConfigError

if TYPE_CHECKING:
    from kvbridge.integrations.vllm.fleet_file import FleetFile

PROGRESS_S = 30.0
"""Without a terminal, how often the start says what it waits for."""
SUPERVISE_S = 1.0
"""How often the supervisor looks at the fleet (restarts, and notes the segments its processes map)."""
FIRST_REQUEST = ("The first request may wait while vLLM compiles on first use (tens of seconds on vLLM CPU, the "
                 "first time on a host); the next ones do not.")
"""Said under the ready banner: "ready" is health, and a first answer 20-30 s later looked like a hang
(a host whose compiler caches are warm answers at once: 0.4 s here on a second day)."""

_EXAMPLE = "e.g. --prefill tp=1,block=64 --prefill tp=2,block=32 --decode tp=2,block=32 --decode tp=1,block=128"


TINY_SERVABLE = {"tiny-llama": {}, "tiny-llama-mqa": {"num_kv_heads": 1},
                 "tiny-llama-6kv": {"num_heads": 12, "num_kv_heads": 6}}
"""Built-in tiny model names `serve` makes a servable directory for: `kvbridge demo`'s names whose
geometry vLLM CPU runs (head size 32; the demo's own tiny configs have 16, which vLLM CPU's
attention does not take)."""


def tiny_servable(name: str) -> Path:
    """The servable directory of built-in tiny model `name` (random weights, byte tokenizer),
    made once under the user's cache directory."""
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbridge" / "serve-models"
    path = root / name
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        import shutil
        try:  # made beside its place and renamed into it: a run cut short leaves no half-made model
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=_made_dir(root)))
            add_byte_tokenizer(make_tiny_llama(tmp, seed=3, **TINY_SERVABLE[name]))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        except OSError as e:
            raise ConfigError(f"cannot make {name} in {root}: {e.strerror or e}") from None
    return path


def _made_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_log_dir(path: Path) -> None:
    """--log-dir must be a directory this user can create and write: else one line, exit 2."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--log-dir {path}: cannot create it ({e.strerror or e})") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {path}: not a directory this user can write")


def _remove_if_empty(path: Path | None) -> None:
    if path is not None:
        try:
            path.rmdir()
        except OSError:
            pass


@app.command("serve")
@friendly_errors
def serve(
    model: Optional[Path] = typer.Argument(None, help="A model directory vLLM can serve (config.json, weights, "
                                           "tokenizer), or a built-in tiny model to try a fleet with "
                                           f"({', '.join(TINY_SERVABLE)}: random weights, made once in "
                                           "~/.cache/kvbridge/serve-models; it answers garbage)."),
    prefill: list[str] = typer.Option([], "--prefill", help="One prefill instance: key=value pairs of tp (1..256), "
                                      "pp (1..16), block (1..4096; vLLM CPU: multiples of 32), transport "
                                      f"(shm|nixl|mooncake), mode (pull|push); repeat per instance; {_EXAMPLE}."),
    decode: list[str] = typer.Option([], "--decode", help="One decode instance, as --prefill."),
    host: str = typer.Option("127.0.0.1", help="Interface the router and the instances' HTTP servers listen on."),
    port: int = typer.Option(8000, help="The router's port: the fleet's endpoint."),
    side_channel_host: str = typer.Option("127.0.0.1", help="Interface of kvbridge's side channel (prefill ranks)."),
    log_dir: Optional[Path] = typer.Option(None, help="Where each instance's log goes [default: a new temporary "
                                           "directory, printed]."),
    max_model_len: int = typer.Option(1024, min=16, max=1 << 20, help="vLLM --max-model-len of every instance: "
                                      "the longest prompt plus answer, in tokens; at most the model's positions "
                                      "(max_position_embeddings)."),
    dtype: str = typer.Option("float32", help="vLLM --dtype of every instance."),
    kv_cache_gib: int = typer.Option(1, min=1, max=4096, help="VLLM_CPU_KVCACHE_SPACE of each instance (CPU)."),
    router_policy: str = typer.Option("round_robin", help="round_robin, random, power_of_two, consistent_hash, "
                                      "cache_aware (the router's text tree) or kv_aware (prefill instances chosen "
                                      "by the KV their prefix caches hold, relayed in one block size whatever "
                                      "each instance's; docs/serving.md)."),
    startup_timeout: float = typer.Option(1800.0, min=10.0, max=86400.0, help="Seconds to wait for health."),
    vllm_python: Optional[Path] = typer.Option(None, help="Python of the vLLM environment [default: .venv-vllm]."),
    stats_path: Optional[Path] = typer.Option(None, help="Append one JSON line per KV transfer (every rank of every "
                                              "instance) to this file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the shapes and print the command lines; start "
                                 "nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line (endpoint, instances, logs) when healthy."),
    pool: str = typer.Option("", help="A prefix cache every instance shares (Mooncake Store): 'start' runs a "
                             "mooncake_master of the fleet's, host:port names a running one [default: none]."),
    pool_block_tokens: int = typer.Option(64, help="Tokens per pool block; every instance's block size divides it."),
    pool_host_mib: int = typer.Option(0, help="Each host's shared-memory tier of the pool, MiB (0: none): its "
                                      "instances store into and load from it as memory copies; what it does not "
                                      "hold comes from the master's store."),
    pool_secret_file: Optional[Path] = typer.Option(None, help="The pool's secret (a 0600 file of 16+ bytes, the "
                                                    "same for every fleet that shares the pool): keeps the pool's "
                                                    "names across restarts, so objects still held by a master and "
                                                    "memory that outlived the restart (other instances, a host "
                                                    "tier) stay usable; what only the restarted instances lent is "
                                                    "gone with them [default: a new secret per run]."),
    fleet_file: Optional[Path] = typer.Option(None, "--fleet", help="A fleet across hosts: a TOML file, the same "
                                              "on every host, naming each instance (name, role, host, port, "
                                              "side_channel_port, shape) and the router's host and port (see "
                                              "docs/serving.md, 'Across hosts'); replaces --prefill, --decode, "
                                              "--host, --port and --side-channel-host. Needs --on and "
                                              "--secret-file."),
    on: str = typer.Option("", "--on", help="With --fleet: this host, as the file names it (an address or a name "
                           "resolving to one here); starts exactly the members the file puts on it, the router "
                           "too if it is there, each bound to this host's address."),
    secret_file: Optional[Path] = typer.Option(None, help="The side channel's secret: a 0600 file of 16+ bytes "
                                               "this user owns, the same on every host of a fleet (needed with "
                                               "--fleet) [default: a new secret per run]."),
    stop_dir: Optional[Path] = typer.Option(None, "--stop", help="Stop the fleet whose --log-dir this is, and "
                                            "start nothing: through its launcher while that runs (SIGTERM), else "
                                            "(its launcher and watchdog gone) every process, segment and secret "
                                            "file it left. Takes no MODEL."),
) -> None:
    """Start P/D instances (`vllm serve` with KVBridgeConnector) and vLLM's router in front of them.

    With `--pool`, every instance also shares a prefix cache in Mooncake Store (vLLM's
    MultiConnector: P/D first, then the pool). Every shape is checked against vLLM's and
    kvbridge's rules before anything starts. Once healthy, a member (instance, router, the
    pool's master) that dies is restarted on its ports with backoff (1, 2, 4, 8, 16 s); one that
    dies 6 times in a row without serving for a minute in between stops the fleet: exit 1, with
    its log's last lines. Ctrl-C or
    SIGTERM stops the whole fleet: router, instances, their workers and sidecars, and their
    shared-memory segments.

    Across hosts: the same `--fleet FILE` and `--secret-file` on every host, and `--on HOST`;
    each host's command starts and supervises (and stops) only the members the file puts on it.

    A fleet dies with its launcher: if `kvbridge serve` is killed (SIGKILL, an OOM kill), its
    watchdog stops every member within seconds and releases its ports, segments and secret file.
    `kvbridge serve --stop LOG_DIR` stops a fleet from another shell.
    """
    if stop_dir is not None:
        if model is not None:
            raise ConfigError("--stop DIR stops a running fleet and starts none: give no MODEL with it")
        from kvbridge.integrations.vllm.fleet_record import stop_dir as stop_recorded
        for line in stop_recorded(stop_dir):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
        return
    if model is None:
        raise ConfigError("missing MODEL: a model directory vLLM can serve, or a built-in tiny model "
                          f"({', '.join(TINY_SERVABLE)}); or --stop DIR to stop a running fleet")
    from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, FleetError, InstanceShape
    from kvbridge.integrations.vllm.fleet_config import check_model
    from kvbridge.integrations.vllm.fleet_supervisor import Supervisor

    prefill_shapes = [InstanceShape.parse(t, "--prefill") for t in prefill]
    decode_shapes = [InstanceShape.parse(t, "--decode") for t in decode]
    across = _fleet_file(fleet_file, on, bool(prefill or decode), (host, port, side_channel_host), secret_file)
    if log_dir is not None and not dry_run:
        _check_log_dir(log_dir)
    if not model.exists() and str(model) in TINY_SERVABLE:
        model = tiny_servable(str(model))
        err_console.print(f"{model.name}: a tiny Llama with random weights and a byte tokenizer ({model}): it answers "
                          "garbage; a fleet to try, not a model to use", highlight=False, markup=False,
                          soft_wrap=True)
    elif not model.exists() and "/" not in str(model):
        from kvbridge.models.presets import PRESETS
        if str(model) in PRESETS:  # `kvbridge plan llama-3-8b` takes it: say why serve does not
            raise ConfigError(f"{model}: a preset geometry that `kvbridge plan` and `bench` take (no weights, no "
                              "tokenizer); serve runs vLLM, which needs a model directory (config.json, weights, "
                              f"tokenizer), or a built-in tiny model ({', '.join(TINY_SERVABLE)})")
        raise ConfigError(f"{str(model)[:80]}: no such model directory, nor a built-in tiny model "
                          f"({', '.join(TINY_SERVABLE)})")
    made = None if log_dir or dry_run else Path(tempfile.mkdtemp(prefix="kvbridge-serve-"))
    config = FleetConfig(
        model=model, prefill=prefill_shapes, decode=decode_shapes,
        log_dir=log_dir or made or Path(tempfile.gettempdir()) / "kvbridge-serve-DRY-RUN", host=host, port=port,
        side_channel_host=side_channel_host, max_model_len=max_model_len, dtype=dtype, kv_cache_gib=kv_cache_gib,
        router_policy=router_policy, vllm_python=str(vllm_python) if vllm_python else None,
        stats_path=str(stats_path.resolve()) if stats_path else "", pool=pool, pool_block_tokens=pool_block_tokens, pool_host_mib=pool_host_mib,
        pool_secret_file=str(pool_secret_file) if pool_secret_file else "",
        secret_file=str(secret_file) if secret_file else "", fleet_file=across, on=on)
    try:
        check_model(config)  # at once: the shape checks below take seconds
        fleet = Fleet(config)
    except BaseException:
        _remove_if_empty(made)  # a start refused before anything ran leaves no empty temporary directory
        raise
    if dry_run:
        if fleet.master is not None:
            console.print(f"# mooncake-master (log {fleet.master.log_path})", highlight=False, markup=False)
            console.print(" ".join(_quote(a) for a in fleet.master.argv), highlight=False, markup=False,
                          soft_wrap=True)
        for m in fleet.everyone():
            console.print(f"# {m.name} (log {m.log_path})", highlight=False, markup=False)
            console.print(" ".join(_quote(a) for a in m.argv), highlight=False, markup=False, soft_wrap=True)
        fleet.port_locks.release()
        return
    if (unreachable := fleet.pool_unreachable()):
        err_console.print(f"warning: {unreachable}", highlight=False, markup=False, soft_wrap=True)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    t0 = time.monotonic()
    where = f"logs in {fleet.log_dir}" + (f"; pool master {fleet.pool_address}" if fleet.pool_address else "")
    # Said at once, on every output: without a terminal (nohup, systemd, CI) the spinner shows
    # nothing, and a start that hangs for minutes must leave the log directory in its output.
    what = f"{len(fleet.members)} instance{'s' if len(fleet.members) != 1 else ''}" + (
        " and the router" if fleet.router is not None else "")
    err_console.print(f"starting {what} ({where})", highlight=False, markup=False, soft_wrap=True)
    try:
        fleet.start()
        with console.status("starting", spinner="dots") if console.is_terminal and not as_json else \
                _Lines(PROGRESS_S) as status:
            fleet.wait_ready(startup_timeout, lambda states: status.update(
                f"{time.monotonic() - t0:.0f} s, waiting for health: " + ", ".join(f"{n} {s}" for n, s in states)
                + f" ({where})"))
        if as_json:
            sys.stdout.write(json.dumps(fleet.summary()) + "\n")
            sys.stdout.flush()
        else:
            if across is None:
                console.print(f"fleet ready at [bold]{fleet.endpoint}[/] (logs in {config.log_dir})", highlight=False)
            else:
                router = "the router" if fleet.router is not None else f"the router on {across.router_host}"
                console.print(f"{on}'s part of the fleet is ready (logs in {config.log_dir}); {router} serves it "
                              f"at [bold]{fleet.endpoint}[/] once every host's part is", highlight=False)
            if fleet.pool_address:
                # asked again: a master named by --pool may have come up while the fleet started
                where = ("the fleet's own master" if fleet.master else
                         "a master that does not accept connections: the instances serve without the pool until "
                         "it does" if fleet.pool_unreachable() else "a running master")
                secret = (f"secret from {fleet.pool_secret_file}" if config.pool_secret_file
                          else "secret new this run: --pool-secret-file keeps one across restarts")
                console.print(f"  {'pool':<10} {fleet.pool_address} ({where}; {secret})", highlight=False,
                              markup=False, soft_wrap=True)  # one line in a log file too
            for m in fleet.members:
                console.print(f"  {m.name:<10} {m.shape.describe():<32} {m.url}", highlight=False, markup=False)
            console.print(fleet.curl_example(), highlight=False, markup=False, soft_wrap=True)
            console.print(FIRST_REQUEST, highlight=False, markup=False, soft_wrap=True)
            console.print("Ctrl-C stops the fleet.", highlight=False)
        supervisor = Supervisor(fleet, _reporter(as_json))
        while not stop.is_set():  # supervise: a member that dies is restarted; one that keeps dying ends it
            stop.wait(SUPERVISE_S)
            supervisor.step()
    except KeyboardInterrupt:
        pass
    except FleetError as e:
        err_console.print(f"error: {e}", highlight=False, markup=False, soft_wrap=True)
        code = 1
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN)
        fleet.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        if not as_json:
            err_console.print("fleet stopped", highlight=False)
        _remove_if_empty(made)
    if code:
        raise typer.Exit(code)


def _fleet_file(path: Path | None, on: str, shapes: bool, places: tuple[str, int, str],
                secret: Path | None) -> FleetFile | None:
    """--fleet FILE read and checked (a FleetFile), None without it; the options it replaces or
    needs refused in one line."""
    if path is None:
        if on:
            raise ConfigError("--on needs --fleet FILE (the fleet across hosts it names a host of)")
        return None
    if shapes or places != ("127.0.0.1", 8000, "127.0.0.1"):
        raise ConfigError("--fleet names every instance and address: give no --prefill, --decode, --host, --port "
                          "or --side-channel-host with it")
    if not on:
        raise ConfigError("--fleet needs --on HOST: which of the file's hosts this one is")
    if secret is None:
        raise ConfigError("--fleet needs --secret-file: the side channel's secret, the same 0600 file of 16+ bytes "
                          "on every host")
    from kvbridge.integrations.vllm.fleet_file import read_fleet_file
    fleet = read_fleet_file(path)
    fleet.on(on)
    return fleet


def _reporter(as_json: bool):
    """Supervision events: one JSON line each on stdout with --json (after the summary line), else
    one line each on stderr."""
    def report(event: dict) -> None:
        if as_json:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()
            return
        what = {"died": "died (rc {rc}, {deaths_in_a_row} in a row); restarting in {restart_in_s:g} s",
                "restarted": "restarted (pid {pid}, incarnation {incarnation})",
                "back": "serving again, {after_s:g} s after it died"}[event["event"]]
        err_console.print(f"{event['member']} {what.format(**event)}", highlight=False, markup=False)
    return report


class _Lines:
    """The start's progress without a terminal: the spinner's text as a line on stderr, the first
    at once, then at most one every `every` seconds (a hung start leaves a trail in a log file)."""

    def __init__(self, every: float):
        self.every, self.last = every, None

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, text: str) -> None:
        now = time.monotonic()
        if self.last is None or now - self.last >= self.every:
            self.last = now
            err_console.print(text, highlight=False, markup=False, soft_wrap=True)


class _Quiet:
    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *_: object) -> None:
        return None


def _quote(arg: str) -> str:
    import shlex
    return shlex.quote(arg)

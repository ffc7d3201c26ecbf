"""A P/D fleet of `vllm serve` instances behind vLLM's own router: what `kvbridge serve` starts.

Why a launcher and no proxy of our own: people run P/D as `vllm serve` processes with
`--kv-transfer-config`, a router speaking NixlConnector's request protocol (`vllm-router
--vllm-pd-disaggregation`) and an OpenAI-compatible client. KVBridgeConnector speaks that
protocol, so the fleet is vLLM's parts only; this module computes their command lines (ports
checked free, one secret for the fleet in a 0600 file, the side channel on the given interface,
`kv_load_failure_policy: recompute` so a KV cache that cannot come is computed rather than
failed), checks every shape against vLLM's and kvbridge's rules before anything starts, starts
the processes each in its own session with its log in a file, waits for health, and stops them
all, leaving no process, port or shared-memory segment behind.

Every instance is `kv_both` (it can serve either role; the router assigns them), runs vLLM with
prefix caching on (vLLM's serving default) and takes its shape from an `InstanceShape`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvbridge.errors import ConfigError, KVBridgeError

MAX_INSTANCES = 16  # per role: each instance is at least three processes
MAX_TP, MAX_PP = 64, 16
MAX_BLOCK = 4096
TRANSPORTS = ("shm", "nixl", "mooncake")
ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "consistent_hash", "cache_aware")


class FleetError(KVBridgeError, RuntimeError):
    """A fleet member failed to start or died; the message names it and its log file."""


class InstanceShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One instance's shape, as `--prefill tp=2,block=32,transport=shm,mode=pull` writes it."""

    tp: int = 1
    pp: int = 1
    block: int = 32
    transport: str = "shm"
    mode: str = "pull"

    @classmethod
    def parse(cls, text: str, flag: str) -> InstanceShape:
        """`key=value[,key=value...]` with keys tp, pp, block, transport, mode; refused in one line."""
        fields: dict[str, Any] = {}
        for item in text.split(","):
            key, eq, value = item.strip().partition("=")
            if not eq or not key or not value:
                raise ConfigError(f"{flag} {text!r}: expected key=value pairs such as tp=2,block=32 (keys: tp, pp, "
                                  "block, transport, mode)")
            if key not in cls.__struct_fields__:
                raise ConfigError(f"{flag} {text!r}: unknown key {key!r} (keys: tp, pp, block, transport, mode)")
            if key in fields:
                raise ConfigError(f"{flag} {text!r}: {key} given twice")
            if key in ("tp", "pp", "block"):
                if not value.isdigit() or len(value) > 6:
                    raise ConfigError(f"{flag} {text!r}: {key} must be a positive integer, got {value!r}")
                fields[key] = int(value)
            else:
                fields[key] = value
        shape = cls(**fields)
        for key, top in (("tp", MAX_TP), ("pp", MAX_PP), ("block", MAX_BLOCK)):
            if not 1 <= getattr(shape, key) <= top:
                raise ConfigError(f"{flag} {text!r}: {key} must be in 1..{top}, got {getattr(shape, key)}")
        if shape.transport not in TRANSPORTS:
            raise ConfigError(f"{flag} {text!r}: transport must be one of {', '.join(TRANSPORTS)}, got "
                              f"{shape.transport!r}")
        if shape.mode not in ("pull", "push"):
            raise ConfigError(f"{flag} {text!r}: mode must be pull or push, got {shape.mode!r}")
        return shape

    def describe(self) -> str:
        pp = f" PP={self.pp}" if self.pp > 1 else ""
        return f"TP={self.tp}{pp} block {self.block} {self.transport}/{self.mode}"


@dataclass
class FleetConfig:
    """Everything `kvbridge serve` takes; `Fleet` checks it before anything starts."""

    model: Path
    prefill: Sequence[InstanceShape]
    decode: Sequence[InstanceShape]
    log_dir: Path
    host: str = "127.0.0.1"  # where the router and the instances' HTTP servers listen
    port: int = 8000  # the router's
    side_channel_host: str = "127.0.0.1"
    max_model_len: int = 1024
    dtype: str = "float32"
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE per instance
    router_policy: str = "round_robin"
    vllm_python: str | None = None  # the vLLM environment's interpreter (default: .venv-vllm)
    request_timeout_s: int = 600  # the router's per-request bound: generous, a starved instance is slow, not dead
    extra_env: dict[str, str] = field(default_factory=dict)
    stats_path: str = ""  # KVBridgeConnector's per-transfer JSON lines (tests, benchmarks)


@dataclass
class Member:
    """One process of the fleet: an instance (`prefill-0`, `decode-1`) or the router."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    http_port: int
    shape: InstanceShape | None = None
    engine_id: str | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.argv_host)}:{self.http_port}"

    argv_host: str = "127.0.0.1"

    def state(self) -> str:
        """'stopped', 'exited (rc N)', 'ready' or 'starting' (health not yet 200)."""
        if self.proc is None:
            return "stopped"
        rc = self.proc.poll()
        if rc is not None:
            return f"exited (rc {rc})"
        return "ready" if healthy(self.url) else "starting"

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (with SO_REUSEADDR, as servers bind: a
    closed server's connections in TIME_WAIT do not hold its port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def find_tool(python: str, name: str) -> str | None:
    """`name` (an executable) beside the vLLM environment's interpreter, or on PATH."""
    beside = Path(python).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def check_shapes(config: FleetConfig) -> list[str]:
    """Refuse, before anything starts, a fleet vLLM or kvbridge cannot run; returns notes."""
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.topology import TransferTopology
    from kvbridge.models import spec_from_hf_config

    if not config.prefill or not config.decode:
        raise ConfigError("a P/D fleet needs at least one --prefill and one --decode instance")
    for role, shapes in (("--prefill", config.prefill), ("--decode", config.decode)):
        if len(shapes) > MAX_INSTANCES:
            raise ConfigError(f"{role} given {len(shapes)} times; at most {MAX_INSTANCES} instances per role")
    model = Path(config.model)
    if not model.exists():
        raise ConfigError(f"model directory {model} does not exist")
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model} is not a model directory (no config.json)")
    if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"{model} has no tokenizer (tokenizer.json / tokenizer_config.json): vllm serve takes text")
    everyone = [*config.prefill, *config.decode]
    kinds = {(s.transport, s.mode) for s in everyone}
    if len(kinds) > 1:
        raise ConfigError("every instance of a fleet must use the same transport and mode (a prefill and a decode "
                          f"instance of different ones cannot pair); got {', '.join(sorted(map('/'.join, kinds)))}")
    spec = spec_from_hf_config(str(model))
    heads = {layer.num_kv_heads for layer in spec.layers if layer.is_attention and layer.kind != "mla"}
    layers = len(spec.layers)
    cpu = _is_cpu_build(config)
    for role, shapes in (("--prefill", config.prefill), ("--decode", config.decode)):
        for s in shapes:
            if cpu and s.block % 32:
                raise ConfigError(f"{role} {s.describe()}: vLLM's CPU attention takes block sizes that are multiples "
                                  "of 32")
            if s.pp > layers:
                raise ConfigError(f"{role} {s.describe()}: PP {s.pp} is more than the model's {layers} layers")
            q_heads = _query_heads(model)
            if q_heads and q_heads % s.tp:
                raise ConfigError(f"{role} {s.describe()}: vLLM splits the model's {q_heads} attention heads evenly "
                                  f"over TP ranks; TP {s.tp} does not divide them")
            for h in heads:
                if h % s.tp and s.tp % h:
                    raise ConfigError(f"{role} {s.describe()}: TP {s.tp} neither divides nor is a multiple of the "
                                      f"model's {h} KV heads (vLLM shards or replicates them)")
    for p in config.prefill:
        for d in config.decode:
            dst = EngineLayout(tp_size=d.tp, pp_size=d.pp, block_size=d.block)
            topo = TransferTopology("decode", spec, dst, tp_rank=0)
            try:
                topo.register_remote_engine("prefill", EngineLayout(tp_size=p.tp, pp_size=p.pp, block_size=p.block),
                                            spec)
            except KVBridgeError as e:
                raise ConfigError(f"prefill {p.describe()} -> decode {d.describe()}: {str(e).splitlines()[0]}") \
                    from None
    if config.router_policy not in ROUTER_POLICIES:
        raise ConfigError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}, got {config.router_policy!r}")
    if not 1 <= config.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {config.port}")
    if not port_free(config.host, config.port):
        raise ConfigError(f"--port {config.port}: {config.host}:{config.port} is in use or cannot be bound")
    return [f"{len(config.prefill)} prefill x {len(config.decode)} decode instances of {model.name}, "
            f"{layers} layers"]


def _query_heads(model: Path) -> int | None:
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("num_attention_heads") if isinstance(cfg, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def _is_cpu_build(config: FleetConfig) -> bool:
    """Whether the vLLM environment holds vLLM's CPU wheel (block sizes in multiples of 32)."""
    python = Path(config.vllm_python or "")
    root = python.parent.parent if python.name else None
    if root is None or not root.is_dir():
        return True
    return any(root.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


class Fleet:
    """The processes of one fleet: `start`, `wait_ready`, `stop` (also on SIGINT / SIGTERM by the CLI)."""

    def __init__(self, config: FleetConfig):
        from kvbridge.proofs.vllm.cluster import free_ports, vllm_python

        self.config = config
        self.python = vllm_python(config.vllm_python)
        config.vllm_python = self.python
        self.notes = check_shapes(config)
        vllm = find_tool(self.python, "vllm")
        router = find_tool(self.python, "vllm-router")
        if vllm is None:
            raise ConfigError(f"no `vllm` command beside {self.python}: run `make vllm-env`")
        if router is None:
            raise ConfigError("no `vllm-router` command: `pip install 'kvbridge[serve]'` into the vLLM environment "
                              "(make vllm-env does)")
        self.log_dir = Path(config.log_dir)
        self.secret_file = self.log_dir / "fleet.secret"  # written by `start`, removed by `stop`
        self.tag = os.urandom(4).hex()
        self.segments: set[str] = set()  # /dev/shm names the fleet's processes mapped (`track_segments`)
        promised: set[int] = {config.port}
        self.members: list[Member] = []
        for role, shapes in (("prefill", config.prefill), ("decode", config.decode)):
            for i, shape in enumerate(shapes):
                base = free_ports(1 + shape.tp * shape.pp, promised)
                promised.update(range(base, base + 1 + shape.tp * shape.pp))
                self.members.append(self._instance(vllm, f"{role}-{i}", shape, http_port=base, side_port=base + 1))
        prometheus = free_ports(1, promised)
        argv = [router, "--host", config.host, "--port", str(config.port), "--vllm-pd-disaggregation",
                "--policy", config.router_policy, "--prometheus-host", "127.0.0.1", "--prometheus-port",
                str(prometheus), "--request-timeout-secs", str(config.request_timeout_s),
                "--worker-startup-timeout-secs", "1800"]
        for m in self.members:
            argv += ["--prefill" if m.name.startswith("prefill") else "--decode", m.url]
        self.router = Member("router", argv, dict(os.environ), self.log_dir / "router.log", config.port,
                             argv_host=config.host)

    def _instance(self, vllm: str, name: str, shape: InstanceShape, http_port: int, side_port: int) -> Member:
        c = self.config
        engine_id = f"{name}-{self.tag}"
        extra = {"transport": shape.transport, "mode": shape.mode, "side_channel_host": c.side_channel_host,
                 "side_channel_port": side_port, "secret_file": str(self.secret_file)}
        if c.stats_path:
            extra["stats_path"] = c.stats_path
        kv = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
              "kv_role": "kv_both", "engine_id": engine_id, "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
        member = vllm_serve_member(c, vllm, name, shape, http_port, self.log_dir, kv)
        member.engine_id = engine_id
        return member

    @property
    def endpoint(self) -> str:
        return self.router.url

    def everyone(self) -> list[Member]:
        return [*self.members, self.router]

    def start_member(self, m: Member) -> None:
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(m.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      env=m.env, start_new_session=True, cwd=str(self.log_dir))

    def start(self) -> None:
        """Start every instance (together: their imports overlap), then the router."""
        from kvbridge.connector.secrets import write_secret_file
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.secret_file.exists():
            self.secret_file.unlink()
        write_secret_file(self.secret_file)
        for m in self.members:
            self.start_member(m)
        self.start_member(self.router)

    def wait_ready(self, timeout: float, on_progress: Callable[[list[tuple[str, str]]], None] | None = None) -> None:
        """Until every instance and the router answer /health; a member that exits raises."""
        deadline = time.monotonic() + timeout
        while True:
            states = [(m.name, m.state()) for m in self.everyone()]
            if on_progress:
                on_progress(states)
            for (name, st), m in zip(states, self.everyone()):
                if st.startswith("exited"):
                    raise FleetError(f"{name} {st} during start; its log: {m.log_path}\n{m.log_tail(8)}")
            self.track_segments()
            if all(st == "ready" for _, st in states):
                return
            if time.monotonic() > deadline:
                late = [n for n, st in states if st != "ready"]
                raise FleetError(f"not healthy after {timeout:.0f} s: {', '.join(late)} (logs in {self.log_dir})")
            time.sleep(1.0)

    def stop_member(self, m: Member, timeout: float = 20.0) -> None:
        """SIGTERM the member's process session, then SIGKILL what is left of it after `timeout`."""
        if m.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(m.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            end = time.monotonic() + wait
            while time.monotonic() < end and _group_alive(m.proc.pid):
                m.proc.poll()
                time.sleep(0.1)
            if not _group_alive(m.proc.pid):
                break
        m.proc.poll()
        m.proc = None

    def track_segments(self) -> None:
        """Note the shared-memory segments the fleet's processes map (vLLM's TP channels, Python's
        multiprocessing blocks and semaphores, kvbridge's caches): killed workers leave theirs in
        /dev/shm, and `stop` removes them. Called while waiting for health and by the CLI's watch."""
        groups = {m.proc.pid for m in self.everyone() if m.proc is not None}
        for pid in _pids_in_groups(groups):
            self.segments.update(_mapped_segments(pid))

    def stop(self) -> None:
        """Stop the router first (no new requests), then every instance; remove their segments."""
        self.track_segments()
        self.stop_member(self.router, timeout=5.0)
        for m in self.members:
            if m.proc is not None:
                try:
                    os.killpg(m.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for m in self.members:
            self.stop_member(m)
        from kvbridge.transport.shm import reap_stale_segments
        reap_stale_segments()
        still_used = {name for pid in _all_pids() for name in _mapped_segments(pid)}
        for name in self.segments - still_used:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        try:
            self.secret_file.unlink()
        except OSError:
            pass

    def summary(self) -> dict[str, Any]:
        """What `kvbridge serve --json` prints once the fleet is healthy."""
        return {"endpoint": self.endpoint, "model": "model", "log_dir": str(self.log_dir),
                "instances": [{"name": m.name, "url": m.url, "shape": m.shape.describe() if m.shape else None,
                               "engine_id": m.engine_id, "pid": m.proc.pid if m.proc else None,
                               "log": str(m.log_path)} for m in self.members],
                "router": {"url": self.router.url, "pid": self.router.proc.pid if self.router.proc else None,
                           "log": str(self.router.log_path)}}

    def curl_example(self) -> str:
        body = json.dumps({"model": "model", "prompt": "Hello", "max_tokens": 16, "temperature": 0})
        return f"curl -s {self.endpoint}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


def vllm_serve_member(c: FleetConfig, vllm: str, name: str, shape: InstanceShape, http_port: int, log_dir: Path,
                      kv: dict[str, Any] | None) -> Member:
    """One `vllm serve` instance of the fleet's model and settings; `kv` None: a plain instance
    (no connector: the reference every fleet answer must equal)."""
    argv = [vllm, "serve", str(Path(c.model).resolve()), "--host", c.host, "--port", str(http_port),
            "--served-model-name", "model", "--dtype", c.dtype, "--max-model-len", str(c.max_model_len),
            "--block-size", str(shape.block), "--tensor-parallel-size", str(shape.tp),
            "--pipeline-parallel-size", str(shape.pp), "--enforce-eager"]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gib),
           "TORCHINDUCTOR_CACHE_DIR": str(log_dir / f"inductor-{name}"), **c.extra_env}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # see proofs/vllm/cluster._instance_config
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    return Member(name, argv, env, log_dir / f"{name}.log", http_port, shape, argv_host=c.host)


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _pids_in_groups(groups: set[int]) -> list[int]:
    """Processes whose process group is one of `groups` (each member leads its own session)."""
    out = []
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:
            out.append(pid)
    return out


def _mapped_segments(pid: int) -> set[str]:
    """Names of /dev/shm files process `pid` maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split("/dev/shm/", 1)[1].split(" (deleted)")[0].strip() for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


__all__ = ["Fleet", "FleetConfig", "FleetError", "InstanceShape", "Member", "check_shapes", "healthy",
           "vllm_serve_member"]

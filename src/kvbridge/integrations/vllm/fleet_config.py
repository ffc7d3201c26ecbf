"""What a P/D fleet is (`kvbridge serve`'s shapes and settings) and the checks that refuse, before
anything starts, a fleet vLLM or kvbridge cannot run. The processes are `fleet.py`'s."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.integrations.vllm.fleet_processes import port_free

MAX_INSTANCES = 16  # per role: each instance is at least three processes
MAX_TP, MAX_PP = 256, 16  # TP as every kvbridge command bounds it (cli.app.BOUNDS, connector/peer_bounds.py)
MAX_BLOCK = 4096
TRANSPORTS = ("shm", "nixl", "mooncake")
ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "consistent_hash", "cache_aware", "kv_aware")


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
        shown = text if len(text) <= 80 else text[:77] + "..."  # echoed in errors: bounded
        fields: dict[str, Any] = {}
        for item in text.split(","):
            key, eq, value = item.strip().partition("=")
            if not eq or not key or not value:
                raise ConfigError(f"{flag} {shown!r}: expected key=value pairs such as tp=2,block=32 (keys: tp, pp, "
                                  "block, transport, mode)")
            if key not in cls.__struct_fields__:
                raise ConfigError(f"{flag} {shown!r}: unknown key {key[:40]!r} (keys: tp, pp, block, transport, mode)")
            if key in fields:
                raise ConfigError(f"{flag} {shown!r}: {key} given twice")
            if key in ("tp", "pp", "block"):
                if not value.isdigit():
                    raise ConfigError(f"{flag} {shown!r}: {key} must be a positive integer, got {value!r}")
                fields[key] = int(value) if len(value) <= 12 else 10 ** 12  # out of every range below either way
            else:
                fields[key] = value
        shape = cls(**fields)
        for key, top in (("tp", MAX_TP), ("pp", MAX_PP), ("block", MAX_BLOCK)):
            value = getattr(shape, key)
            if not 1 <= value <= top:
                got = value if value < 10 ** 12 else "more than 12 digits"
                raise ConfigError(f"{flag} {shown!r}: {key} must be in 1..{top}, got {got}")
        if shape.transport not in TRANSPORTS:
            raise ConfigError(f"{flag} {shown!r}: transport must be one of {', '.join(TRANSPORTS)}, got "
                              f"{shape.transport!r}")
        if shape.mode not in ("pull", "push"):
            raise ConfigError(f"{flag} {shown!r}: mode must be pull or push, got {shape.mode!r}")
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
    connector: str = "kvbridge"  # or "nixl": vLLM's own NixlConnector (kv_buffer_device cpu), for benchmarks
    pool: str = ""  # "" none; "start": a mooncake_master of the fleet's; "host:port": a running one (issue 23)
    pool_block_tokens: int = 64  # the shared pool's block; every instance's block size divides it
    pool_host_mib: int = 0  # each host's shared-memory tier of the pool (0: none), shared by its instances
    pool_secret_file: str = ""  # the pool's secret, kept across restarts (default: the fleet's own, new per run)
    secret_file: str = ""  # the side channel's secret, a 0600 file every host shares (default: the fleet's own, new)
    fleet_file: Any = None  # a FleetFile (fleet_file.py): a fleet across hosts, of which this launcher runs...
    on: str = ""  # ...the members on this host (`fleet_file.place_here` fills the fields above from the file)


def check_model(config: FleetConfig) -> Path:
    """The model directory, refused in one line (before anything starts, in well under a second)
    when `vllm serve` would fail on it later: missing, no config, tokenizer or weights, or a
    --max-model-len above its positions."""
    model = Path(config.model)
    if not model.exists():
        raise ConfigError(f"model directory {model} does not exist")
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model} is not a model directory (no config.json)")
    if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"{model} has no tokenizer (tokenizer.json / tokenizer_config.json): vllm serve takes text")
    if not any(next(model.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(f"{model} has no weights (*.safetensors, *.bin, *.pt): vllm serve would fail to load it "
                          "(`kvbridge serve tiny-llama ...` makes a servable tiny model)")
    positions = _max_positions(model)
    if positions and config.max_model_len > positions:
        raise ConfigError(f"--max-model-len {config.max_model_len} is more than the model's {positions} positions "
                          f"(max_position_embeddings in config.json): give --max-model-len {positions} or less")
    return model


def check_shapes(config: FleetConfig) -> list[str]:
    """Refuse, before anything starts, a fleet vLLM or kvbridge cannot run; returns notes."""
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.topology import TransferTopology
    from kvbridge.models.spec_cache import spec_of_dir

    if not config.prefill or not config.decode:
        raise ConfigError("a P/D fleet needs at least one --prefill and one --decode instance")
    for role, shapes in (("--prefill", config.prefill), ("--decode", config.decode)):
        if len(shapes) > MAX_INSTANCES:
            raise ConfigError(f"{role} given {len(shapes)} times; at most {MAX_INSTANCES} instances per role")
    model = check_model(config)
    everyone = [*config.prefill, *config.decode]
    kinds = {(s.transport, s.mode) for s in everyone}
    if len(kinds) > 1:
        raise ConfigError("every instance of a fleet must use the same transport and mode (a prefill and a decode "
                          f"instance of different ones cannot pair); got {', '.join(sorted(map('/'.join, kinds)))}")
    spec = spec_of_dir(model)  # remembered per config: deriving it imports transformers, 5-7 s a start
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
    if config.pool:
        if config.connector != "kvbridge":
            raise ConfigError("--pool needs kvbridge's connector on every instance (not vLLM's NixlConnector)")
        if config.pool != "start":
            host, _, port = config.pool.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65535:
                raise ConfigError(f"--pool must be 'start' or the host:port of a running mooncake_master, got "
                                  f"{config.pool[:80]!r}")
        if not 1 <= config.pool_block_tokens <= 1 << 16:
            raise ConfigError(f"--pool-block-tokens must be in 1..65536, got {config.pool_block_tokens}")
        if not 0 <= config.pool_host_mib <= 1 << 24:
            raise ConfigError(f"--pool-host-mib must be in 0..16777216, got {config.pool_host_mib}")
        if config.pool_secret_file:
            config.pool_secret_file = _checked_secret(config.pool_secret_file, "--pool-secret-file")
        for s in everyone:
            if config.pool_block_tokens % s.block:
                raise ConfigError(f"instance {s.describe()}: block {s.block} does not divide the pool's "
                                  f"{config.pool_block_tokens}-token block (--pool-block-tokens)")
    elif config.pool_secret_file or config.pool_block_tokens != 64 or config.pool_host_mib:
        raise ConfigError("--pool-secret-file, --pool-block-tokens and --pool-host-mib need --pool (start or HOST:PORT)")
    if config.secret_file:
        config.secret_file = _checked_secret(config.secret_file, "--secret-file")
    elif config.fleet_file is not None:
        raise ConfigError("--fleet needs --secret-file: the side channel's secret, the same 0600 file of 16+ bytes "
                          "on every host")
    if config.router_policy not in ROUTER_POLICIES:
        raise ConfigError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}, got {config.router_policy!r}")
    if config.router_policy == "kv_aware" and config.fleet_file is not None:
        raise ConfigError("--router-policy kv_aware runs on a fleet of one host for now (its event relay reads every "
                          "prefill instance on this host); across hosts use cache_aware")
    if not 1 <= config.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {config.port}")
    router_here = config.fleet_file is None or config.fleet_file.router_host == config.on
    if router_here and not port_free(config.host, config.port):
        raise ConfigError(f"--port {config.port}: {config.host}:{config.port} is in use or cannot be bound")
    return [f"{len(config.prefill)} prefill x {len(config.decode)} decode instances of {model.name}, "
            f"{layers} layers"]


START_METHODS = ("fork", "spawn", "forkserver")


def check_environment(env: dict[str, str]) -> None:
    """The kvbridge variables of the environment every member inherits (`env`), each refused in
    one line naming it (issue 43 point 5): each is read deep inside a vLLM process, where a bad
    value was a traceback in one instance's log minutes later, or silently replaced."""
    import os

    from kvbridge.integrations.vllm.idle_wake import idle_wait_max_s
    idle_wait_max_s(env)  # the connector's own reading of KVBRIDGE_VLLM_IDLE_WAIT_S
    method = env.get("KVBRIDGE_START_METHOD")
    if method is not None and method not in START_METHODS:
        raise ConfigError(f"KVBRIDGE_START_METHOD must be one of {', '.join(START_METHODS)}, got {method[:40]!r}")
    profile = env.get("KVBRIDGE_STEP_PROFILE")
    if profile and not (os.path.isdir(profile) and os.access(profile, os.W_OK | os.X_OK)):
        raise ConfigError(f"KVBRIDGE_STEP_PROFILE {profile[:200]!r}: not a directory this user can write (every "
                          "process of an instance writes its step profile there)")


def _checked_secret(path: str, flag: str) -> str:
    """A secret file as every kvbridge secret is checked (ours, 0600, no symlink, 16+ bytes), or
    one line naming `flag`; its absolute path (instances run in the log directory)."""
    from kvbridge.core.secrets import read_secret_file
    try:
        read_secret_file(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("secret file ", f"{flag} ", 1)) from None
    return str(Path(path).resolve())


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def _max_positions(model: Path) -> int | None:
    """The model's positions when vLLM takes them as they are (no RoPE scaling that stretches
    them), else None: vLLM judges."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(key)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            return None
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


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


__all__ = ["FleetConfig", "FleetError", "InstanceShape", "check_environment", "check_model", "check_shapes"]

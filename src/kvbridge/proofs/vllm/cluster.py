"""vLLM CPU instances as subprocesses of the vLLM environment, for the P/D demo, bench and tests.

Each instance is a subprocess (`server.py`) of the vLLM environment's python (default
`<repo>/.venv-vllm/bin/python`, `KVBRIDGE_VLLM_PYTHON`, or this interpreter when it has vLLM),
so kvbridge's own environment (the CLI) can drive them. Every wait has a deadline; a failure
raises `VllmDemoError` with the instance's log tail. All instances run in their own process
groups and are killed (by group id) at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvbridge.core.secrets import write_secret_file
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.integrations.vllm.fleet_processes import SegmentLedger, free_ports, vllm_python  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[4]
START_TIMEOUT_S = 600.0  # one instance, on a loaded 2-core machine (idle: ~25-40 s)
REQUEST_TIMEOUT_S = 300.0


class VllmDemoError(KVBridgeError, RuntimeError):
    """A vLLM instance failed, timed out, or disagreed; the message carries its log tail."""


class Instance:
    """One vLLM instance (subprocess) and its command pipe."""

    def __init__(self, name: str, config: dict[str, Any], python: str, workdir: Path):
        self.name, self.config = name, config
        self.log_path = workdir / f"{name}.log"
        r, w = os.pipe()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # One inductor cache per instance: instances started together compiled into the shared
        # /tmp/torchinductor_<user> at once and one died of a half-written header (seen once:
        # "'at::vec' has not been declared", EngineDeadError).
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(workdir / f"inductor-{name}"))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "kvbridge.proofs.vllm.server", json.dumps(config), str(w)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,), env=env,
                start_new_session=True, text=True, cwd=str(workdir))
        os.close(w)
        self._fd = r
        self._buf = b""
        self.ready: dict[str, Any] = {}
        self.closed = False
        self.engine_id: str | None = None  # set by `Cluster`: its kv_transfer_config engine id
        self.tp = int(config.get("tp") or 1)
        self.attempt = 0  # restarts after a lost port bind race (`Cluster.wait_ready`)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _fail(self, what: str) -> VllmDemoError:
        return VllmDemoError(f"vLLM instance {self.name}: {what}\n--- log tail ({self.log_path}) ---\n{self.log_tail()}")

    def read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer within {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    raise self._fail(f"exited (rc {self.proc.poll()})")
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise self._fail(f"exited (rc {self.proc.returncode})")
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise self._fail(f"{msg['error']}\n{msg.get('traceback', '')}")
        return msg

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        self.ready = self.read(timeout)
        return self.ready

    def command(self, timeout: float = REQUEST_TIMEOUT_S, **cmd: Any) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail("its command pipe is closed") from None
        return self.read(timeout)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, kv_transfer_params: dict | None = None,
                 timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        return self.command(timeout, op="generate", prompt_ids=list(prompt_ids), max_tokens=max_tokens,
                            kv_transfer_params=kv_transfer_params)

    def kill(self) -> None:
        """SIGKILL the process group this instance started (server, engine core, workers, sidecars)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self, timeout: float = 10.0) -> None:
        """Kill the instance and wait (at most `timeout` s) until all its processes are gone.
        (No graceful shutdown: vLLM's waits for its workers for tens of seconds, and nothing of an
        instance outlives it but its shared-memory segments, which `Cluster.close` reaps.)"""
        if self.closed:
            return
        self.closed = True
        self.kill()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout  # until the whole group is gone (then its shm segments can be reaped)
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)
        try:
            os.close(self._fd)
        except OSError:
            pass


def kvbridge_transfer_config(role: str, engine_id: str, port: int, *, transport: str = "shm", mode: str = "pull",
                             stats_path: str = "", **extra: Any) -> dict[str, Any]:
    """The `--kv-transfer-config` of a KVBridgeConnector instance (as a dict)."""
    cfg = {"transport": transport, "mode": mode, "side_channel_port": port, **extra}
    if stats_path:
        cfg["stats_path"] = stats_path
    return {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
            "kv_role": role, "engine_id": engine_id, "kv_connector_extra_config": cfg}


def nixl_transfer_config(role: str, engine_id: str) -> dict[str, Any]:
    """vLLM's own NixlConnector on CPU (kv_buffer_device cpu)."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id, "kv_buffer_device": "cpu"}


def _read_stats(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_released(stats: Path, engine_id: str, request_ids: list[str], tp: int, timeout: float = 20.0) -> None:
    """Give the prefill ranks a moment to record their releases (they follow the decode reads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = {(e["request_id"], e["rank"]) for e in _read_stats(stats)
                if e["event"] == "release" and e["engine_id"] == engine_id}
        if all((rid, r) in done for rid in request_ids for r in range(tp)):
            return
        time.sleep(0.1)


def model_directory(model_dir: str | os.PathLike | None, python: str, workdir: Path) -> str:
    if model_dir is not None:
        if not (Path(model_dir) / "config.json").is_file():
            raise ConfigError(f"{model_dir} is not a model directory (no config.json)")
        return str(model_dir)
    from kvbridge.proofs.vllm.model import make_tiny_llama
    return str(make_tiny_llama(workdir / "tiny-llama"))


def prompt_ids_for(prompt_ids: Sequence[int] | None, prompt_len: int, seed: int, vocab: int = 256) -> list[int]:
    if prompt_ids:
        return [int(t) for t in prompt_ids]
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(prompt_len)]


def cpu_binding(tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` that pins `tp` CPU workers to this host's CPUs, round robin.

    vLLM's automatic binding ("auto") wants one NUMA node per TP rank and refuses TP > 1 on a
    single-node host: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers.
    Allowed NUMA nodes are [0]. Please try to bind threads manually or decrease DP/TP/PP."
    (The demo does not pin by default, see `_instance_config`; set the variable to pin.)
    """
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[i % len(cpus)]) for i in range(tp))


def check_block_size(block_size: int | None) -> None:
    """Refuse a block size vLLM 0.32 CPU cannot run, at once: it fails it only at the worker's
    start, a minute later, with "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"."""
    if block_size is not None and (block_size <= 0 or block_size % 32):
        raise ConfigError(f"vLLM CPU attention takes block sizes that are multiples of 32, got {block_size} "
                          f"(e.g. --prefill-block-size 64 --decode-block-size 32)")


def _instance_config(model: str, tp: int, block_size: int | None, kv: dict | None, env: dict | None = None,
                     log_stats: bool = False) -> dict[str, Any]:
    """One instance's server config. Its CPU workers are not pinned and run one OpenMP thread
    each (`VLLM_CPU_OMP_THREADS_BIND=nobind`, `OMP_NUM_THREADS=1`) unless the caller's environment
    sets `VLLM_CPU_OMP_THREADS_BIND`: "auto" refuses TP > 1 here (see `cpu_binding`), and a worker
    pinned to one CPU of a shared 2-core host stalled for 60 s while another process held that
    CPU (measured: TP 2 decode, its rank-0 worker pinned to CPU 0; the engine core logged "No
    available shared memory broadcast block found in 60 seconds"), where an unpinned one moves."""
    check_block_size(block_size)
    env = dict(env or {})
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    return {"model": model, "tp": tp, "block_size": block_size, "kv_transfer_config": kv, "env": env,
            "prefix_caching": False, "log_stats": log_stats}


class Cluster:
    """The vLLM instances of one setup, started together, and the proxy between them.

    `start` launches an instance and returns at once (a vLLM CPU instance spends most of its
    start importing torch and vLLM in three processes, one after the other: starting several
    together keeps both cores of a small host busy), `wait_ready` waits for them, `pd` sends
    one request through a prefill instance and a decode instance (NixlConnector's proxy
    protocol) and collects what the connector recorded about it, `close` stops instances.
    Every KVBridgeConnector instance of a cluster appends its transfer events to one stats file.
    """

    PORT_RETRIES = 2

    def __init__(self, model: str, python: str, workdir: Path, *, transport: str = "shm", mode: str = "pull"):
        self.model, self.python, self.work = model, python, Path(workdir)
        self.transport, self.mode = transport, mode
        self.stats = self.work / "kvbridge-stats.jsonl"
        self.instances: dict[str, Instance] = {}
        self._specs: dict[str, tuple[int, int | None, str | None, str, bool]] = {}
        self._tag = uuid.uuid4().hex[:8]
        self._promised: set[int] = set()

    def _secret_file(self) -> str:
        """A per-cluster side-channel secret in a 0600 file (a command line would show it in `ps`)."""
        path = self.work / f"kvbridge-secret-{self._tag}"
        if not path.exists():
            write_secret_file(path)
        return str(path)

    def engine_id(self, name: str) -> str:
        return f"{name}-{self._tag}"

    def start(self, name: str, tp: int = 1, block_size: int | None = None, role: str | None = None, *,
              connector: str = "kvbridge", log_stats: bool = False, transport: str | None = None) -> Instance:
        """Launch instance `name` without waiting: `role` kv_producer / kv_consumer / kv_both with
        `connector` "kvbridge" (KVBridgeConnector, over `transport`, default the cluster's) or "nixl"
        (vLLM's NixlConnector); None: plain."""
        if name in self.instances and not self.instances[name].closed:
            raise ConfigError(f"instance {name!r} is already running")
        self._specs[name] = (tp, block_size, role, connector, log_stats, transport or self.transport)
        return self._launch(name, attempt=0)

    def _launch(self, name: str, attempt: int) -> Instance:
        tp, block_size, role, connector, log_stats, transport = self._specs[name]
        kv, env = None, {}
        eid = self.engine_id(name)
        if role is not None and connector == "kvbridge":
            # Ports below the ephemeral range, free now; a bind race with another process is retried (`wait_ready`).
            port = self._ports(tp) if role != "kv_consumer" else 5570
            # Heartbeats every 30 s (a peer is lost after 90 s of silence): with seven instances on two
            # cores a sidecar went unheard for over 30 s (the default's limit) and a request failed.
            kv = kvbridge_transfer_config(role, eid, port, transport=transport, mode=self.mode,
                                          stats_path=str(self.stats), secret_file=self._secret_file(),
                                          heartbeat_seconds=30.0)
        elif role is not None:
            kv = nixl_transfer_config(role, eid)
            if role != "kv_consumer":
                env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": self._ports(tp)}
        log_name = name if attempt == 0 else f"{name}.retry{attempt}"
        inst = Instance(log_name, _instance_config(self.model, tp, block_size, kv, env, log_stats=log_stats),
                        self.python, self.work)
        inst.name, inst.engine_id, inst.attempt = name, eid, attempt
        self.instances[name] = inst
        return inst

    def _ports(self, count: int) -> int:
        base = free_ports(count, self._promised)
        self._promised.update(range(base, base + count))
        return base

    def wait_ready(self, names: Sequence[str] | None = None, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the instances are ready; the deadline covers them all.

        An instance whose side channel lost a port bind race ("Address already in use": the port
        was free when we chose it, then another process took it during the instance's start) is
        started again on fresh ports, at most `PORT_RETRIES` times; any other failure raises."""
        deadline = time.monotonic() + timeout
        for name in names if names is not None else list(self.instances):
            inst = self.instances[name]
            while True:
                try:
                    inst.wait_ready(max(1.0, deadline - time.monotonic()))
                    break
                except VllmDemoError as e:
                    if "Address already in use" not in str(e) or inst.attempt >= self.PORT_RETRIES:
                        raise
                    sys.stderr.write(f"[kvbridge] vLLM instance {name}: a side-channel port was taken during its "
                                     f"start; starting it again on other ports\n")
                    inst.close()
                    inst = self._launch(name, inst.attempt + 1)

    def close(self, names: Sequence[str] | None = None) -> None:
        names = list(names if names is not None else self.instances)
        # What the instances map in /dev/shm (vLLM's psm_* blocks, sem.mp-* semaphores): a SIGKILL
        # leaves them, and only the instances' own are removed once nobody maps them.
        ledger = SegmentLedger()
        ledger.track(*(self.instances[n].proc.pid for n in names if not self.instances[n].closed))
        for name in names:  # all at once, then wait for each
            self.instances[name].kill()
        for name in names:
            self.instances[name].close()
        ledger.remove_unused()
        try:
            from kvbridge.transport.shm import reap_stale_segments
            reap_stale_segments()  # segments of the killed vLLM workers
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def pd(self, prefill: str, decode: str, prompt: Sequence[int], new_tokens: int,
           timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """One request, proxied as NixlConnector's proxy does: the prompt to `prefill` with
        max_tokens=1 and do_remote_decode, then to `decode` with the kv_transfer_params it returned.

        Returns the decoded tokens and log-probs, and (KVBridgeConnector) what each decode rank
        recorded (`per_rank`: ok, reason, bytes, runs, transfer seconds) and how each prefill rank
        released its blocks (`prefill_released`)."""
        p, d = self.instances[prefill], self.instances[decode]
        p_out = p.generate(prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_decode_engine_id": d.engine_id}, timeout=timeout)
        params = p_out.get("kv_transfer_params")
        if not params or not params.get("do_remote_prefill"):
            raise VllmDemoError(f"prefill instance {prefill} returned no kv_transfer_params for decode: {p_out}")
        d_out = d.generate(prompt, new_tokens, params, timeout=timeout)
        rid = params["remote_request_id"]
        out = {"prefill_instance": prefill, "decode_instance": decode, "remote_request_id": rid,
               "tokens": d_out["token_ids"], "logprobs": d_out["logprobs"], "params": params,
               "prefill_first_token": p_out["token_ids"][:1], "prefill_seconds": p_out["seconds"],
               "decode_seconds": d_out["seconds"]}
        if params.get("kv_connector") == "KVBridgeConnector":
            _wait_released(self.stats, p.engine_id, [rid], p.tp)
            events = _read_stats(self.stats)
            ranks = sorted((e for e in events if e["event"] == "recv" and e["engine_id"] == d.engine_id
                            and e["remote_request_id"] == rid), key=lambda e: e["rank"])
            out.update(
                ok=len(ranks) == d.tp and all(e["ok"] for e in ranks),
                bytes_moved=sum(e.get("nbytes") or 0 for e in ranks),
                num_runs=sum(e.get("nruns") or 0 for e in ranks),
                transfer_seconds=max((e.get("transfer_seconds") or 0.0 for e in ranks), default=None),
                per_rank=[{k: e.get(k) for k in ("rank", "ok", "reason", "nbytes", "nruns", "transfer_seconds",
                                                  "seconds")} for e in ranks],
                prefill_released=sorted({e["reason"] for e in events if e["event"] == "release"
                                         and e["engine_id"] == p.engine_id and e["request_id"] == rid}))
        return out


def median_seconds(values: Sequence[float | None]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


@contextlib.contextmanager
def workspace(workdir: str | os.PathLike | None, prefix: str) -> Iterator[tuple[Path, bool]]:
    """(directory, owned) for one run: a given `workdir` is kept; a temporary one is removed
    when the run succeeds and kept, with the instances' logs, when it raises."""
    owned = workdir is None
    work = Path(tempfile.mkdtemp(prefix=prefix)) if owned else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    yield work, owned
    if owned:
        shutil.rmtree(work, ignore_errors=True)


__all__ = ["Cluster", "Instance", "VllmDemoError", "free_ports", "kvbridge_transfer_config", "median_seconds",
           "model_directory", "nixl_transfer_config", "prompt_ids_for", "vllm_python", "workspace"]

"""Prefill/decode with real vLLM CPU instances: `run_vllm_demo` and `bench_vllm`.

Each vLLM instance is a subprocess (`server.py`) of the vLLM environment's python (default
`<repo>/.venv-vllm/bin/python`, `KVBRIDGE_VLLM_PYTHON`, or this interpreter when it has vLLM),
so these functions run from kvbridge's own environment too. The proxy is the function itself,
NixlConnector's protocol: the prompt goes to the prefill instance with max_tokens=1 and
`{"do_remote_decode": true}`; the `kv_transfer_params` it returns go with the same prompt to
the decode instance, which loads the prompt's KV through the connector, recomputes the last
prompt token and decodes. The reference is one plain vLLM instance (no connector), greedy.

Every wait has a deadline; a failure raises `VllmDemoError` with the instance's log tail. All
instances run in their own process groups and are killed (by group id) at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError, KVBridgeError

REPO = Path(__file__).resolve().parents[4]
START_TIMEOUT_S = 600.0  # one instance, on a loaded 2-core machine (idle: ~25-40 s)
REQUEST_TIMEOUT_S = 300.0


class VllmDemoError(KVBridgeError, RuntimeError):
    """A vLLM instance failed, timed out, or disagreed; the message carries its log tail."""


def vllm_python(python: str | os.PathLike | None = None) -> str:
    """The interpreter that runs vLLM: `python`, $KVBRIDGE_VLLM_PYTHON, .venv-vllm, or this one."""
    for cand in (python, os.environ.get("KVBRIDGE_VLLM_PYTHON"), REPO / ".venv-vllm" / "bin" / "python"):
        if cand and Path(cand).is_file():
            return str(cand)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ConfigError("no vLLM environment: run `make vllm-env` (creates .venv-vllm) or set KVBRIDGE_VLLM_PYTHON")


def free_ports(count: int = 1) -> int:
    """A base port such that `count` consecutive ports are free on 127.0.0.1, below the kernel's
    ephemeral range (an ephemeral port that is free now may be taken by any outgoing connection
    before the side channel binds it: seen as "Address already in use")."""
    rng = random.Random()
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(20000 + 1000, min(low, 60000))
    for _ in range(200):
        base = rng.randrange(20000, top - count)
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise VllmDemoError(f"no {count} consecutive free ports found")


class Instance:
    """One vLLM instance (subprocess) and its command pipe."""

    def __init__(self, name: str, config: dict[str, Any], python: str, workdir: Path):
        self.name, self.config = name, config
        self.log_path = workdir / f"{name}.log"
        r, w = os.pipe()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "kvbridge.integrations.vllm.server", json.dumps(config), str(w)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,), env=env,
                start_new_session=True, text=True, cwd=str(workdir))
        os.close(w)
        self._fd = r
        self._buf = b""
        self.ready: dict[str, Any] = {}
        self.closed = False

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

    def close(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            try:
                self.command(timeout, op="exit")
            except VllmDemoError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this instance started: engine core, workers
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
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


def _model(model_dir: str | os.PathLike | None, python: str, workdir: Path) -> str:
    if model_dir is not None:
        if not (Path(model_dir) / "config.json").is_file():
            raise ConfigError(f"{model_dir} is not a model directory (no config.json)")
        return str(model_dir)
    path = workdir / "tiny-llama"
    res = subprocess.run([python, "-m", "kvbridge.integrations.vllm.model", str(path)], capture_output=True,
                         text=True, timeout=300, cwd=str(workdir))
    if res.returncode:
        raise VllmDemoError(f"making the tiny model failed: {res.stderr[-3000:]}")
    return str(path)


def _prompt(prompt_ids: Sequence[int] | None, prompt_len: int, seed: int, vocab: int = 256) -> list[int]:
    if prompt_ids:
        return [int(t) for t in prompt_ids]
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(prompt_len)]


def cpu_binding(tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` CPU workers on this host's CPUs, round robin.

    vLLM's automatic binding ("auto") wants one NUMA node per TP rank and refuses TP > 1 on a
    single-node host: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers.
    Allowed NUMA nodes are [0]. Please try to bind threads manually or decrease DP/TP/PP."
    """
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[i % len(cpus)]) for i in range(tp))


def _instance_config(model: str, tp: int, block_size: int | None, kv: dict | None, env: dict | None = None,
                     log_stats: bool = False) -> dict[str, Any]:
    env = dict(env or {})
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tp))
    return {"model": model, "tp": tp, "block_size": block_size, "kv_transfer_config": kv, "env": env,
            "prefix_caching": False, "log_stats": log_stats}


def _start(instances: list[Instance], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for inst in instances:
        inst.wait_ready(max(1.0, deadline - time.monotonic()))


def _close_all(instances: list[Instance]) -> None:
    for inst in instances:
        inst.close()
    try:
        from kvbridge.transport.shm import reap_stale_segments
        reap_stale_segments()  # segments of the killed vLLM workers
    except Exception:  # noqa: BLE001
        pass


def run_vllm_demo(model_dir: str | os.PathLike | None = None, prefill_tp: int = 1, decode_tp: int = 1,
                  prompt_ids: Sequence[int] | None = None, new_tokens: int = 8, *, prefill_block_size: int = 32,
                  decode_block_size: int = 32, prompt_len: int = 48, seed: int = 0, transport: str = "shm",
                  mode: str = "pull", reference: str = "separate", requests: int = 1, python: str | None = None,
                  timeout_s: float = 1800.0, workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Prefill on one vLLM instance, move the KV with KVBridgeConnector, decode on another.

    `reference="separate"` runs the reference on a third, plain instance (no connector);
    `"prefill"` asks the prefill instance itself (a plain request there touches no connector
    path; it saves one instance start). `requests` > 1 repeats the P/D request (fresh request
    ids, same prompt) to time steady-state transfers. Returns a JSON-able dict: tokens_reference,
    tokens_disaggregated, match, logprobs_max_abs_diff, transfer figures (bytes_moved, num_runs,
    transfer_seconds per decode rank and request), start-up and request seconds.
    """
    if reference not in ("separate", "prefill"):
        raise ConfigError(f"reference must be 'separate' or 'prefill', got {reference!r}")
    t_start = time.monotonic()
    python = vllm_python(python)
    own_dir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvbridge-vllm-")) if own_dir else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    stats = work / "kvbridge-stats.jsonl"
    model = _model(model_dir, python, work)
    prompt = _prompt(prompt_ids, prompt_len, seed)
    tag = uuid.uuid4().hex[:8]
    p_id, d_id = f"prefill-{tag}", f"decode-{tag}"
    port = free_ports(prefill_tp)
    d_port = free_ports(max(1, decode_tp))
    instances: list[Instance] = []
    ok = False
    try:
        prefill = Instance("prefill", _instance_config(
            model, prefill_tp, prefill_block_size,
            kvbridge_transfer_config("kv_producer", p_id, port, transport=transport, mode=mode,
                                     stats_path=str(stats))), python, work)
        instances.append(prefill)
        decode = Instance("decode", _instance_config(
            model, decode_tp, decode_block_size,
            kvbridge_transfer_config("kv_consumer", d_id, d_port, transport=transport, mode=mode,
                                     stats_path=str(stats))), python, work)
        instances.append(decode)
        _start(instances, min(timeout_s, START_TIMEOUT_S * 1.5))

        runs = []
        for i in range(max(1, requests)):
            p_out = prefill.generate(prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                                 "remote_decode_engine_id": d_id})
            params = p_out.get("kv_transfer_params")
            if not params or not params.get("do_remote_prefill"):
                raise VllmDemoError(f"prefill returned no kv_transfer_params for decode: {p_out}")
            d_out = decode.generate(prompt, new_tokens, params)
            runs.append({"prefill": p_out, "decode": d_out, "params": params})
        _wait_released(stats, p_id, [r["params"]["remote_request_id"] for r in runs], prefill_tp)
        if reference == "separate":  # after the pair is gone: three instances at once overload a 2-core host
            pair = list(instances)
            _close_all(pair)
            ref = Instance("reference", _instance_config(model, 1, None, None), python, work)
            instances.append(ref)
            _start([ref], min(timeout_s, START_TIMEOUT_S))
        else:
            ref = prefill
        r_out = ref.generate(prompt, new_tokens)

        events = _read_stats(stats)
        recv = [e for e in events if e["event"] == "recv" and e["engine_id"] == d_id]
        release = [e for e in events if e["event"] == "release" and e["engine_id"] == p_id]
        last = runs[-1]
        tokens_d = last["decode"]["token_ids"]
        tokens_r = r_out["token_ids"]
        lp_d, lp_r = last["decode"]["logprobs"], r_out["logprobs"]
        diff = max((abs(a - b) for a, b in zip(lp_d, lp_r)), default=0.0) if len(lp_d) == len(lp_r) else None
        all_match = all(r["decode"]["token_ids"] == tokens_r for r in runs)
        per_request = []
        for r in runs:
            rid = r["params"]["remote_request_id"]
            ranks = sorted((e for e in recv if e["remote_request_id"] == rid), key=lambda e: e["rank"])
            per_request.append({
                "remote_request_id": rid, "ok": bool(ranks) and all(e["ok"] for e in ranks) and len(ranks) == decode_tp,
                "bytes_moved": sum(e.get("nbytes", 0) for e in ranks), "num_runs": sum(e.get("nruns", 0) for e in ranks),
                "transfer_seconds": max((e.get("transfer_seconds", 0.0) for e in ranks), default=None),
                "per_rank": [{k: e.get(k) for k in ("rank", "ok", "reason", "nbytes", "nruns", "transfer_seconds",
                                                     "seconds")} for e in ranks],
                "prefill_released": sorted({e["reason"] for e in release if e["request_id"] == rid}),
                "prefill_seconds": r["prefill"]["seconds"], "decode_seconds": r["decode"]["seconds"]})
        steady = per_request[1:] or per_request
        ok = True
        return {
            "engine": "vllm", "connector": "KVBridgeConnector", "transport": transport, "mode": mode, "model": model,
            "prefill": {"engine_id": p_id, "tp": prefill_tp, "block_size": prefill.ready.get("block_size")},
            "decode": {"engine_id": d_id, "tp": decode_tp, "block_size": decode.ready.get("block_size")},
            "reference": reference, "prompt_ids": prompt, "new_tokens": new_tokens,
            "tokens_reference": tokens_r, "tokens_disaggregated": tokens_d, "match": tokens_d == tokens_r and all_match,
            "logprobs_max_abs_diff": diff, "prefill_first_token": last["prefill"]["token_ids"][:1],
            "bytes_moved": per_request[-1]["bytes_moved"], "num_runs": per_request[-1]["num_runs"],
            "transfer_seconds": per_request[-1]["transfer_seconds"],
            "transfer_seconds_median": _median([r["transfer_seconds"] for r in steady]),
            "requests": per_request, "kv_transfer_params": {k: v for k, v in last["params"].items()
                                                            if k != "remote_block_ids"},
            "startup_seconds": {i.name: i.ready.get("startup_seconds") for i in instances},
            "wall_seconds": time.monotonic() - t_start, "workdir": None if own_dir else str(work),
        }
    except VllmDemoError:
        raise
    finally:
        _close_all(instances)
        if own_dir and ok:
            shutil.rmtree(work, ignore_errors=True)


def _median(values: Sequence[float | None]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _nixl_totals(metrics: dict[str, Any]) -> tuple[float, float, float]:
    """(seconds, transfers, bytes) so far from vLLM's NIXL Prometheus histograms."""
    def hist(name: str) -> tuple[float, float]:
        h = metrics.get(name) or {}
        return float(h.get("sum", 0.0)), float(h.get("count", 0.0))
    secs, count = hist("vllm:nixl_xfer_time_seconds")
    nbytes, _ = hist("vllm:nixl_bytes_transferred")
    return secs, count, nbytes


def _run_pair(kind: str, model: str, prefill_tp: int, decode_tp: int, block_size: int, prompts: list[list[int]],
              new_tokens: int, python: str, work: Path, timeout_s: float) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    p_id, d_id = f"{kind}-prefill-{tag}", f"{kind}-decode-{tag}"
    stats = work / f"{kind}-stats.jsonl"
    if kind == "kvbridge":
        port = free_ports(prefill_tp)
        p_kv = kvbridge_transfer_config("kv_producer", p_id, port, stats_path=str(stats))
        d_kv = kvbridge_transfer_config("kv_consumer", d_id, free_ports(1), stats_path=str(stats))
        p_env: dict[str, Any] = {}
    else:
        p_kv, d_kv = nixl_transfer_config("kv_producer", p_id), nixl_transfer_config("kv_consumer", d_id)
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": free_ports(prefill_tp)}
    instances: list[Instance] = []
    try:
        prefill = Instance(f"{kind}-prefill", _instance_config(model, prefill_tp, block_size, p_kv, p_env), python, work)
        instances.append(prefill)
        decode = Instance(f"{kind}-decode", _instance_config(model, decode_tp, block_size, d_kv, log_stats=True),
                          python, work)
        instances.append(decode)
        _start(instances, min(timeout_s, START_TIMEOUT_S * 1.5))
        reference = [prefill.generate(p, new_tokens)["token_ids"] for p in prompts] if kind == "kvbridge" else []
        rows = []
        for prompt in prompts:
            before = _nixl_totals(decode.command(op="metrics")["metrics"]) if kind == "nixl" else None
            p_out = prefill.generate(prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False})
            params = p_out.get("kv_transfer_params")
            if not params:
                raise VllmDemoError(f"{kind} prefill returned no kv_transfer_params: {p_out}")
            d_out = decode.generate(prompt, new_tokens, params)
            row = {"tokens": d_out["token_ids"], "decode_seconds": d_out["seconds"],
                   "prefill_seconds": p_out["seconds"], "remote_request_id": params.get("remote_request_id")}
            if kind == "nixl":
                # vLLM publishes connector stats with the engine's periodic stats; give them a moment.
                deadline = time.monotonic() + 10
                while True:
                    after = _nixl_totals(decode.command(op="metrics")["metrics"])
                    if after[1] > before[1] or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                n = after[1] - before[1]
                row.update(transfer_seconds=(after[0] - before[0]) / n if n else None,
                           bytes_moved=int(after[2] - before[2]) if n else None, transfers=int(n))
            rows.append(row)
        if kind == "kvbridge":
            events = [e for e in _read_stats(stats) if e["event"] == "recv" and e["engine_id"] == d_id]
            for row in rows:
                ranks = [e for e in events if e["remote_request_id"] == row["remote_request_id"]]
                row.update(transfer_seconds=max((e.get("transfer_seconds") or 0.0 for e in ranks), default=None),
                           bytes_moved=sum(e.get("nbytes", 0) for e in ranks),
                           num_runs=sum(e.get("nruns", 0) for e in ranks), ok=all(e["ok"] for e in ranks))
        return {"rows": rows, "reference": reference,
                "startup_seconds": {i.name: i.ready.get("startup_seconds") for i in instances}}
    finally:
        _close_all(instances)


def bench_vllm(model_dir: str | os.PathLike | None = None, prefill_tp: int = 1, decode_tp: int = 1,
               prompt_len: int = 256, new_tokens: int = 4, requests: int = 4, *, block_size: int = 32,
               seed: int = 0, python: str | None = None, timeout_s: float = 2400.0,
               workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The same P/D requests through KVBridgeConnector and through vLLM's NixlConnector (CPU).

    Runs a kvbridge prefill/decode pair, then a NIXL pair (`kv_buffer_device: cpu`), on the same
    model, shapes and prompts (`requests` prompts of `prompt_len` tokens), one pair at a time so
    they do not compete for the CPU. Reports per request and connector the decoded tokens (both
    must equal the prefill instance's plain greedy output), the transfer time as each connector
    measures it (kvbridge: first read posted to last read done on the decode ranks; NIXL: vLLM's
    `nixl_xfer_time_seconds` histogram, transfer start to completion), the bytes moved, and the
    decode request's wall time; medians skip the first request (handshakes, first-use costs).
    """
    t_start = time.monotonic()
    python = vllm_python(python)
    own_dir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="kvbridge-vllm-bench-")) if own_dir else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = _model(model_dir, python, work)
    prompts = [_prompt(None, prompt_len, seed + i) for i in range(max(1, requests))]
    ok = False
    try:
        kvb = _run_pair("kvbridge", model, prefill_tp, decode_tp, block_size, prompts, new_tokens, python, work,
                        timeout_s)
        nixl = _run_pair("nixl", model, prefill_tp, decode_tp, block_size, prompts, new_tokens, python, work,
                         timeout_s)
        reference = kvb["reference"]

        def summary(res: dict[str, Any]) -> dict[str, Any]:
            rows = res["rows"]
            steady = rows[1:] or rows
            return {"match_reference": [r["tokens"] == ref for r, ref in zip(rows, reference)],
                    "transfer_seconds": [r.get("transfer_seconds") for r in rows],
                    "transfer_seconds_median": _median([r.get("transfer_seconds") for r in steady]),
                    "decode_seconds": [r["decode_seconds"] for r in rows],
                    "decode_seconds_median": _median([r["decode_seconds"] for r in steady]),
                    "bytes_moved": [r.get("bytes_moved") for r in rows],
                    "num_runs": [r.get("num_runs") for r in rows] if "num_runs" in rows[0] else None,
                    "startup_seconds": res["startup_seconds"]}

        out = {"engine": "vllm", "model": model, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
               "block_size": block_size, "prompt_len": prompt_len, "new_tokens": new_tokens, "requests": len(prompts),
               "tokens_reference": reference, "kvbridge": summary(kvb), "nixl": summary(nixl),
               "tokens_kvbridge": [r["tokens"] for r in kvb["rows"]], "tokens_nixl": [r["tokens"] for r in nixl["rows"]]}
        out["same_tokens"] = out["tokens_kvbridge"] == out["tokens_nixl"] == reference
        out["wall_seconds"] = time.monotonic() - t_start
        ok = True
        return out
    finally:
        if own_dir and ok:
            shutil.rmtree(work, ignore_errors=True)


__all__ = ["Instance", "VllmDemoError", "bench_vllm", "free_ports", "kvbridge_transfer_config", "nixl_transfer_config",
           "run_vllm_demo", "vllm_python"]

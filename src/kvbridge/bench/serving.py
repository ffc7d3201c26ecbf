"""Serving benchmark, side by side: one fleet shape behind `vllm-router`, once with KVBridgeConnector
and once with vLLM's NixlConnector, loaded by vLLM's own load generator (`vllm bench serve`).

Both fleets are started before the first run and are loaded in turns (kvbridge, NIXL, kvbridge,
NIXL, ... per dataset), so the machine's noise falls on both alike; the fleet not being loaded is
stopped (SIGSTOP of its sessions) meanwhile, so that its own idle work does not either. A shape NixlConnector refuses
(`integrations.vllm.compat.nixl_verdict`: e.g. a prefill block larger than the decode block) is
reported as refused and only kvbridge runs.

Figures (issue 31): TTFT p50/p99 and output tokens/s as the median over the rounds; inter-token
latency p50/p90/p99 and max over every gap of every round together; completed and failed summed.
And round by round (issue 46.2: five rounds of 64 prompts by default, so a round's p99 TTFT is
read off 64 requests): each round's mean and p99 TTFT, ITL p50 and p99 over its own gaps and
tokens/s, their spread, and in how many rounds kvbridge was at or ahead of NIXL on each
(`rounds_ahead`, round i against round i: they ran in turns). Before the rounds each fleet serves one unmeasured warm-up of every
dataset (as many prompts as are in flight, other prompts than the rounds'): a fleet's first steps
compile (10-60 s here), a one-time start cost that otherwise lands in one round's TTFT or ITL
tail. The decode instance's step times come from vLLM's own per-iteration
log (`--enable-logging-iteration-details`, the same on both fleets) as a histogram per dataset.
Each run notes the host's load average and the CPU time the rest of the host used meanwhile,
so a reader sees what else ran. Ratios: time NIXL / kvbridge, throughput kvbridge / NIXL (above
1: kvbridge better).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape
from kvbridge.transport.parent_death import parent_death_command

WARMUP_SEED = 7  # other prompts (and prefixes) than the measured rounds' seeds 100, 101, ...
DATASETS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "192",
                          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "16"],
}
ROUND_FIGURES = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput")
ITL_FIGURES = ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms")
TIME_FIGURES = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", *ITL_FIGURES)
PER_ROUND = ("mean_ttft_ms", "p99_ttft_ms", "itl_p50_ms", "itl_p99_ms", "output_throughput")
"""Figures kept per round (issue 46.2): a tail is judged round by round, not only as a median."""
HIGHER_IS_BETTER = ("output_throughput",)
STEP_EDGES_MS = (10, 20, 40, 80, 160, 320, 640, 1280)
"""Upper edges of the step-time histogram's buckets; the last bucket is everything above."""
_ITERATION = re.compile(r"Iteration\(\d+\): .*?iteration elapsed time: ([0-9.]+) ms")


def _nixl_refusal(model: Path, prefill: InstanceShape, decode: InstanceShape) -> str | None:
    from kvbridge.core.layout import EngineLayout
    from kvbridge.integrations.vllm.compat import nixl_verdict
    from kvbridge.models import spec_from_hf_config
    verdict = nixl_verdict(spec_from_hf_config(str(model)), EngineLayout(tp_size=prefill.tp, block_size=prefill.block),
                           EngineLayout(tp_size=decode.tp, block_size=decode.block))
    return None if verdict.accepts else "; ".join(verdict.reasons)


def percentile(xs: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile of `xs`, q in [0, 100]; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_histogram(steps_ms: list[float]) -> dict[str, Any]:
    """Counts per bucket (`<=10`, ..., `>1280` ms) and the p50/p99/max of the decode steps."""
    counts = {f"<={e}": 0 for e in STEP_EDGES_MS} | {f">{STEP_EDGES_MS[-1]}": 0}
    for ms in steps_ms:
        edge = next((e for e in STEP_EDGES_MS if ms <= e), None)
        counts[f"<={edge}" if edge is not None else f">{STEP_EDGES_MS[-1]}"] += 1
    return {"steps": len(steps_ms), "p50_ms": percentile(steps_ms, 50), "p99_ms": percentile(steps_ms, 99),
            "max_ms": max(steps_ms) if steps_ms else None, "buckets": counts}


def iteration_times(log_text: str) -> list[float]:
    """The elapsed milliseconds of every step vLLM logged (`--enable-logging-iteration-details`)."""
    return [float(m.group(1)) for m in _ITERATION.finditer(log_text)]


class _HostCpu:
    """CPU seconds the whole host, the fleets' process sessions and this process's children used
    between `start` and `stop`: what is left is what else ran on the machine meanwhile."""

    def __init__(self, sessions: set[int]):
        self.sessions = sessions

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    def _ours(self) -> float:
        ticks = 0
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    st = open(f"/proc/{d}/stat").read()
                except OSError:
                    continue
                f = st[st.rindex(")") + 2:].split()
                if int(f[3]) in self.sessions:
                    ticks += int(f[11]) + int(f[12])
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ticks / os.sysconf("SC_CLK_TCK") + r.ru_utime + r.ru_stime

    def start(self) -> None:
        self.t0, self.busy0, self.ours0, self.load0 = time.monotonic(), self._busy(), self._ours(), os.getloadavg()

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        busy, ours = self._busy() - self.busy0, self._ours() - self.ours0
        return {"seconds": round(wall, 1), "load_avg_1m": [round(self.load0[0], 2), round(os.getloadavg()[0], 2)],
                "host_cpu_s": round(busy, 1), "benchmark_cpu_s": round(ours, 1),
                "others_cpu_s": round(max(0.0, busy - ours), 1), "cores": os.cpu_count()}


def pause_sessions(leaders: list[int], stop: bool) -> None:
    """SIGSTOP (or SIGCONT) every process of the sessions these members lead: the fleet that is
    not being measured waits, stopped, so that its busy-waiting does not land on the other's
    figures (measured: NixlConnector's idle prefill worker, holding blocks nobody read, spun 13.6
    of 20 CPU-seconds on this 2-core host during a kvbridge run)."""
    for pid in leaders:
        try:
            os.killpg(pid, signal.SIGSTOP if stop else signal.SIGCONT)
        except ProcessLookupError:
            pass


def _leaders(fleet: Fleet) -> list[int]:
    return [m.proc.pid for m in fleet.everyone() if m.proc is not None and m.proc.poll() is None]


@contextlib.contextmanager
def _alone(fleets: dict[str, Fleet], connector: str) -> Iterator[None]:
    """Every other fleet stopped (SIGSTOP of its sessions) while `connector`'s is loaded."""
    idle = [pid for c, g in fleets.items() if c != connector for pid in _leaders(g)]
    pause_sessions(idle, True)
    try:
        yield
    finally:
        pause_sessions(idle, False)


def _bench_once(fleet: Fleet, model: Path, dataset: str, prompts: int, concurrency: int, seed: int,
                out: Path) -> dict[str, Any]:
    name = f"{fleet.config.connector}-{dataset}-{seed}.json"
    cmd = [str(Path(fleet.python).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url",
           fleet.endpoint, "--model", "model", "--tokenizer", str(model), *DATASETS[dataset],
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", name,
           "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,99"]
    decode_logs = [m.log_path for m in fleet.members if m.name.startswith("decode")]
    offsets = [p.stat().st_size if p.exists() else 0 for p in decode_logs]
    sessions = {m.proc.pid for m in fleet.everyone() if m.proc is not None}
    host = _HostCpu(sessions)
    host.start()
    t0 = time.monotonic()
    # the load generator dies with the benchmark (its fleets have their watchdogs: fleet.py)
    res = subprocess.run(parent_death_command(cmd), capture_output=True, text=True, timeout=3600)
    window = (t0, time.monotonic())
    load = host.stop()
    steps: list[float] = []
    for p, off in zip(decode_logs, offsets):
        with open(p, "rb") as f:
            f.seek(off)
            steps += iteration_times(f.read().decode(errors="replace"))
    if res.returncode:
        return {"error": (res.stdout + res.stderr)[-600:], "host": load, "steps_ms": steps, "window": window}
    data = json.loads((out / name).read_text())
    itls = [1e3 * x for r in data.get("itls") or [] for x in r]  # seconds, per request
    return {**{k: data.get(k) for k in ROUND_FIGURES}, "completed": data.get("completed"),
            "failed": data.get("failed", 0), "itls_ms": itls, "steps_ms": steps, "host": load, "window": window}


def step_path_profile(directory: Path, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """What kvbridge's connector did on the decode instance's step path during `windows` (the
    measured rounds of one dataset), from its `KVBRIDGE_STEP_PROFILE` files: per timed call kind
    (scheduler `schedule` on steps with tokens, `schedule_idle` on the idle steps it pauses until a
    transfer ends (`idle_wake`); each worker's `start_load_kv` and `get_finished`), the count and the
    p50/p99/max/total milliseconds; for the sidecars, the rounds that used CPU and their CPU
    milliseconds (their work runs beside the step, not on it)."""
    from kvbridge.integrations.vllm.step_profile import read_profiles
    spans: dict[str, list[tuple[float, list[str]]]] = {}
    for lines in read_profiles(directory).values():
        for kind, t0, ms, counts in lines:
            if kind == "schedule" and counts[:1] == ["0"]:  # no token scheduled: the paced idle loop
                kind = "schedule_idle"
            if any(a <= t0 <= b for a, b in windows):
                spans.setdefault(kind, []).append((ms, counts))
    out: dict[str, Any] = {"seconds": round(sum(b - a for a, b in windows), 1), "calls": {}}
    for kind, xs in sorted(spans.items()):
        ms = [m for m, _ in xs]
        entry = {"calls": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms),
                 "total_ms": sum(ms)}
        if kind == "sidecar":  # its wall time includes the SIGSTOP of an idle fleet: CPU is what it took
            cpu = [float(c[0]) for _, c in xs if c]
            entry |= {"cpu_ms": sum(cpu), "max_cpu_ms": max(cpu, default=0.0), "p50_cpu_ms": percentile(cpu, 50),
                      "p99_cpu_ms": percentile(cpu, 99)}
        out["calls"][kind] = entry
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One connector's rounds of one dataset: medians of the per-round figures, ITL percentiles
    over every gap of every round, the decode steps' histogram, the host's notes per round."""
    ok = [x for x in runs if "error" not in x and x.get("completed")]  # a round where all failed has no times
    row: dict[str, Any] = {k: statistics.median(x[k] for x in ok) if ok and all(x.get(k) is not None for x in ok)
                           else None for k in ROUND_FIGURES}
    itls = [v for x in ok for v in x["itls_ms"]]
    row |= {"itl_p50_ms": percentile(itls, 50), "itl_p90_ms": percentile(itls, 90),
            "itl_p99_ms": percentile(itls, 99), "itl_max_ms": max(itls) if itls else None, "itl_samples": len(itls)}
    row["completed"] = sum(x.get("completed") or 0 for x in ok)
    row["failed"] = sum(x.get("failed") or 0 for x in runs if "error" not in x) + sum("error" in x for x in runs)
    row["decode_steps"] = step_histogram([v for x in runs for v in x["steps_ms"]])
    row["host"] = [x["host"] for x in runs]
    row["errors"] = [x["error"] for x in runs if "error" in x]
    row["per_round"] = per_round(runs)
    row["spread"] = {k: [min(v), max(v)] if (v := [x for x in row["per_round"][k] if x is not None]) else None
                     for k in PER_ROUND}
    return row


def per_round(runs: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """Each round's figures, in round order (None for a round that failed): TTFT and throughput as
    `vllm bench serve` gave them, ITL p50/p99 over that round's own gaps (a round of at least 64
    requests of 16 tokens has 960 of them)."""
    out: dict[str, list[float | None]] = {k: [] for k in PER_ROUND}
    for x in runs:
        ok = "error" not in x and bool(x.get("completed"))
        for k in PER_ROUND:
            if not ok:
                v = None
            elif k.startswith("itl_"):
                v = percentile(x["itls_ms"], 50 if k == "itl_p50_ms" else 99)
            else:
                v = x.get(k)
            out[k].append(v)
    return out


ROUND_NAMES = {"mean_ttft_ms": "TTFT mean ms", "p99_ttft_ms": "TTFT p99 ms", "itl_p50_ms": "ITL p50 ms",
               "itl_p99_ms": "ITL p99 ms", "output_throughput": "out tok/s"}


def round_cells(row: dict[str, Any], fmt: Callable[[Any], str], sep: str = "/") -> list[tuple[str, ...]]:
    """A table row's round-by-round figures as text, for the CLI and the docs alike: per figure,
    (name, each round's kvbridge`sep`NIXL, kvbridge's spread, NIXL's spread, "k of n" at or ahead)."""
    k, n = row["kvbridge"], row["nixl"]
    out = []
    for f, name in ROUND_NAMES.items():
        pairs = " ".join(f"{fmt(a)}{sep}{fmt(b)}" for a, b in zip(k["per_round"][f], n["per_round"][f]))
        spread = ["-" if not x["spread"][f] else f"{fmt(x['spread'][f][0])}..{fmt(x['spread'][f][1])}" for x in (k, n)]
        better, of = row["rounds_ahead"][f]
        out.append((name, pairs, *spread, f"{better} of {of}"))
    return out


def rounds_ahead(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, list[int]]:
    """Per figure, [rounds where kvbridge's figure is at or better than NIXL's, rounds compared]:
    round i of one is paired with round i of the other (they ran in turns)."""
    out = {}
    for k in PER_ROUND:
        pairs = [(a, b) for a, b in zip(ours["per_round"][k], theirs["per_round"][k]) if a is not None and b is not None]
        better = sum((a >= b) if k in HIGHER_IS_BETTER else (a <= b) for a, b in pairs)
        out[k] = [better, len(pairs)]
    return out


def _flush_request(fleet: Fleet) -> None:
    from kvbridge.testing.serving import prompt_text, request
    request(fleet.endpoint, prompt_text(1, 64), 2)


def bench_serve(model: Path | None = None, prefill: str = "tp=1,block=32", decode: str = "tp=2,block=32",
                prompts: int = 64, concurrency: int = 8, rounds: int = 5, python: str | None = None,
                work: Path | None = None) -> dict[str, Any]:
    """Run both fleets (or kvbridge's alone where NIXL refuses the shape) and return the table."""
    work = Path(work or tempfile.mkdtemp(prefix="kvbridge-bench-serve-")).resolve()
    if model is None:
        from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
        model = add_byte_tokenizer(make_tiny_llama(work / "tiny-llama", seed=3))
    p, d = InstanceShape.parse(prefill, "--prefill"), InstanceShape.parse(decode, "--decode")
    refused = _nixl_refusal(Path(model), p, d)
    from kvbridge.proofs.vllm.cluster import free_ports
    fleets = {}
    for connector in ("kvbridge",) + (() if refused else ("nixl",)):
        fleets[connector] = f = Fleet(FleetConfig(model=Path(model), prefill=[p], decode=[d],
                                                  log_dir=work / connector, port=free_ports(1), vllm_python=python,
                                                  connector=connector))
        for m in f.members:  # vLLM's own step timer, the same on both fleets
            if m.name.startswith("decode"):
                m.argv.append("--enable-logging-iteration-details")
                if connector == "kvbridge":  # and what kvbridge does on its step path (issue 31)
                    (work / "step-profile").mkdir(parents=True, exist_ok=True)
                    m.env["KVBRIDGE_STEP_PROFILE"] = str(work / "step-profile")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {ds: [] for ds in DATASETS} for c in fleets}
    warmup: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        for f in fleets.values():
            f.start()
        for f in fleets.values():
            f.wait_ready(1800)
        startup = time.monotonic() - t0
        (work / "warmup").mkdir(parents=True, exist_ok=True)
        for connector, f in fleets.items():  # unmeasured: each fleet's first steps compile (tens of s)
            with _alone(fleets, connector):
                w0 = time.monotonic()
                for ds in DATASETS:
                    _bench_once(f, Path(model), ds, concurrency, concurrency, WARMUP_SEED, work / "warmup")
                warmup[connector] = round(time.monotonic() - w0, 1)
        for r in range(rounds):
            for ds in DATASETS:
                for connector, f in fleets.items():
                    with _alone(fleets, connector):
                        runs[connector][ds].append(_bench_once(f, Path(model), ds, prompts, concurrency, 100 + r,
                                                               work))
        with _alone(fleets, "kvbridge"):  # a profile is written a second after its lines: one more request
            time.sleep(1.5)
            _flush_request(fleets["kvbridge"])
    finally:
        for f in fleets.values():
            f.stop()
    table = []
    for ds in DATASETS:
        row: dict[str, Any] = {"dataset": ds}
        for connector in ("kvbridge", "nixl"):
            row[connector] = summarize(runs[connector][ds]) if connector in fleets else {"refused": refused}
        row["kvbridge"]["step_path"] = step_path_profile(work / "step-profile",
                                                         [x["window"] for x in runs["kvbridge"][ds]])
        if "nixl" in fleets:
            k, n = row["kvbridge"], row["nixl"]
            row["ratios"] = {m: (n[m] / k[m]) if k.get(m) and n.get(m) else None for m in TIME_FIGURES}
            row["ratios"]["output_throughput"] = (k["output_throughput"] / n["output_throughput"]
                                                  if k.get("output_throughput") and n.get("output_throughput")
                                                  else None)
            row["rounds_ahead"] = rounds_ahead(k, n)
        table.append(row)
    return {"prefill": p.describe(), "decode": d.describe(), "prompts": prompts, "concurrency": concurrency,
            "rounds": rounds, "startup_seconds": round(startup, 1), "warmup_seconds": warmup, "nixl_refused": refused, "table": table,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(), "work": str(work)}


__all__ = ["PER_ROUND", "ROUND_NAMES", "bench_serve", "iteration_times", "pause_sessions", "per_round", "percentile", "round_cells", "rounds_ahead",
           "step_histogram", "step_path_profile", "summarize"]

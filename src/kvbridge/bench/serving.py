"""Serving benchmark, side by side: one fleet shape behind `vllm-router`, once with KVBridgeConnector
and once with vLLM's NixlConnector, loaded by vLLM's own load generator (`vllm bench serve`).

Both fleets are started before the first run and are loaded in turns (kvbridge, NIXL, kvbridge,
NIXL, ... per dataset), so the machine's noise falls on both alike; each figure is the median
over the rounds. A shape NixlConnector refuses (`integrations.vllm.compat.nixl_verdict`: e.g. a
prefill block larger than the decode block) is reported as refused and only kvbridge runs.
Figures: TTFT p50/p99, ITL p50/p99, output tokens/s, completed and failed requests, and the
kvbridge/NIXL ratios (time: NIXL / kvbridge, so above 1 means kvbridge is faster; throughput:
kvbridge / NIXL).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape

DATASETS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "192",
                          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "16"],
}
FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput", "completed", "failed")


def _nixl_refusal(model: Path, prefill: InstanceShape, decode: InstanceShape) -> str | None:
    from kvbridge.core.layout import EngineLayout
    from kvbridge.integrations.vllm.compat import nixl_verdict
    from kvbridge.models import spec_from_hf_config
    verdict = nixl_verdict(spec_from_hf_config(str(model)), EngineLayout(tp_size=prefill.tp, block_size=prefill.block),
                           EngineLayout(tp_size=decode.tp, block_size=decode.block))
    return None if verdict.accepts else "; ".join(verdict.reasons)


def _bench_once(fleet: Fleet, model: Path, dataset: str, prompts: int, concurrency: int, seed: int,
                out: Path) -> dict[str, Any]:
    name = f"{fleet.config.connector}-{dataset}-{seed}.json"
    cmd = [str(Path(fleet.python).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url",
           fleet.endpoint, "--model", "model", "--tokenizer", str(model), *DATASETS[dataset],
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos",
           "--save-result", "--result-dir", str(out), "--result-filename", name, "--percentile-metrics", "ttft,itl",
           "--metric-percentiles", "50,99"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        return {"error": (res.stdout + res.stderr)[-600:]}
    data = json.loads((out / name).read_text())
    return {k: data.get(k) for k in FIGURES}


def bench_serve(model: Path | None = None, prefill: str = "tp=1,block=32", decode: str = "tp=2,block=32",
                prompts: int = 32, concurrency: int = 8, rounds: int = 2, python: str | None = None,
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
        fleets[connector] = Fleet(FleetConfig(model=Path(model), prefill=[p], decode=[d], log_dir=work / connector,
                                              port=free_ports(1), vllm_python=python, connector=connector))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {ds: [] for ds in DATASETS} for c in fleets}
    t0 = time.monotonic()
    try:
        for f in fleets.values():
            f.start()
        for f in fleets.values():
            f.wait_ready(1800)
        startup = time.monotonic() - t0
        for r in range(rounds):
            for ds in DATASETS:
                for connector, f in fleets.items():
                    runs[connector][ds].append(_bench_once(f, Path(model), ds, prompts, concurrency, 100 + r, work))
    finally:
        for f in fleets.values():
            f.stop()
    table = []
    for ds in DATASETS:
        row: dict[str, Any] = {"dataset": ds}
        for connector in ("kvbridge", "nixl"):
            if connector not in fleets:
                row[connector] = {"refused": refused}
                continue
            ok = [x for x in runs[connector][ds] if "error" not in x]
            row[connector] = {k: statistics.median(x[k] for x in ok) if ok else None for k in FIGURES}
            row[connector]["errors"] = [x["error"] for x in runs[connector][ds] if "error" in x]
        if "nixl" in fleets:
            k, n = row["kvbridge"], row["nixl"]
            row["ratios"] = {m: (n[m] / k[m]) if k.get(m) and n.get(m) else None for m in
                             ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")}
            row["ratios"]["output_throughput"] = (k["output_throughput"] / n["output_throughput"]
                                                  if k.get("output_throughput") and n.get("output_throughput")
                                                  else None)
        table.append(row)
    return {"prefill": p.describe(), "decode": d.describe(), "prompts": prompts, "concurrency": concurrency,
            "rounds": rounds, "startup_seconds": round(startup, 1), "nixl_refused": refused, "table": table,
            "work": str(work)}


__all__ = ["bench_serve"]

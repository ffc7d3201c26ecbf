"""Routing policies side by side on a fleet of mixed block sizes (issue 45.3): `kvbridge bench --routing`.

One fleet per policy (`kvbridge serve --router-policy ...`: two prefill instances of blocks 64 and
32, a decode instance of block 32), started in turn on this host, each given the same warm-up and
then the same workloads by `vllm bench serve`: shared prefixes (`prefix_repetition`, several
prefixes) and a multi-turn chat (each turn's prompt the conversation so far, conversations
interleaved, as a chat service sees them). Per policy and workload: the prefill instances' prefix
hit rate (vLLM's `prefix_cache_hits / prefix_cache_queries`, tokens, over both), TTFT p50/p99,
output tokens/s, failed requests, and how many answers equal a plain instance's (greedy, the same
prompts, no connector). Rounds alternate the workloads; figures are medians over rounds.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.testing.serving import metric_total

POLICIES = ("kv_aware", "cache_aware", "round_robin")
PREFILL, DECODE = ("tp=1,block=64", "tp=1,block=32"), ("tp=1,block=32",)
FIGURES = ("median_ttft_ms", "p99_ttft_ms", "output_throughput")


def prefix_workload(prompts: int, prefixes: int, seed: int) -> list[str]:
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "384",
            "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-output-len", "8", "--num-prompts", str(prompts), "--seed", str(seed)]


def chat_file(path: Path, conversations: int, turns: int, seed: int) -> Path:
    """A multi-turn chat as a timed trace (`vllm bench serve --dataset-name timed_trace`, 16-token
    chunks named by hash ids): turn t of a conversation is its first 8 + 6t chunks, so each turn's
    prompt extends the last one's; turns a second apart, the conversations' turns interleaved."""
    rng = random.Random(seed)
    first = [rng.randrange(1 << 30) for _ in range(conversations)]
    with open(path, "w") as f:
        for t in range(turns):
            for c in range(conversations):
                ids = [first[c] + k for k in range(8 + 6 * t)]
                f.write(json.dumps({"timestamp": t + c * 0.05, "input_length": 16 * len(ids), "output_length": 8,
                                    "hash_ids": ids}) + "\n")
    return path


def _hits(urls: list[str]) -> tuple[float, float]:
    return (sum(metric_total(u, "vllm:prefix_cache_hits_total") for u in urls),
            sum(metric_total(u, "vllm:prefix_cache_queries_total") for u in urls))


def _bench(vllm: str, base: str, model: Path, workload: list[str], concurrency: int, out: Path, name: str
           ) -> dict[str, Any]:
    cmd = [vllm, "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", "model", "--tokenizer",
           str(model), *workload, "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", name,
           "--percentile-metrics", "ttft", "--metric-percentiles", "50,99"]
    # PYTHONHASHSEED: a timed trace's chunks are drawn from seeds of Python's str hash
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONHASHSEED": "0"})
    if res.returncode:
        return {"error": (res.stdout + res.stderr)[-600:]}
    data = json.loads((out / name).read_text())
    return {**{k: data.get(k) for k in FIGURES}, "completed": data.get("completed"), "failed": data.get("failed", 0),
            "texts": data.get("generated_texts") or []}


def _workloads(work: Path, prompts: int, seed: int) -> dict[str, list[str]]:
    # an odd number of conversations: round robin over two prefill instances would otherwise keep
    # every conversation on one instance, by the order alone
    conversations = max(3, prompts // 4) | 1
    chat = chat_file(work / f"chat-{seed}.jsonl", conversations=conversations, turns=4, seed=seed)
    return {"shared prefixes": prefix_workload(prompts, 4, seed),
            "multi-turn chat": ["--dataset-name", "timed_trace", "--dataset-path", str(chat),
                                "--num-prompts", str(conversations * 4)]}


def bench_routing(model: Path | None = None, policies: tuple[str, ...] = POLICIES, prompts: int = 48,
                  concurrency: int = 4, rounds: int = 2, python: str | None = None,
                  work: Path | None = None) -> dict[str, Any]:
    """Each policy's fleet in turn, the same workloads and seeds for each (see the module)."""
    from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape, vllm_serve_member
    from kvbridge.integrations.vllm.fleet_processes import find_tool, stop_session, vllm_python
    from kvbridge.proofs.vllm.cluster import free_ports

    work = Path(work or tempfile.mkdtemp(prefix="kvbridge-bench-routing-")).resolve()
    if model is None:  # enough layers that a 384-token prefix costs real prefill time
        from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
        model = add_byte_tokenizer(make_tiny_llama(work / "small-llama", num_layers=6, seed=11))
    vllm = find_tool(vllm_python(python), "vllm") or "vllm"
    seeds = [100 + r for r in range(rounds)]
    loads = {s: _workloads(work, prompts, s) for s in seeds}

    # The reference: a plain instance (no connector) answers every prompt of every round.
    ref_dir = work / "plain"
    ref_dir.mkdir(parents=True, exist_ok=True)
    config = FleetConfig(model=Path(model), prefill=[], decode=[], log_dir=ref_dir)
    plain = vllm_serve_member(config, vllm, "plain", InstanceShape(tp=1, block=32), free_ports(1), ref_dir, None)
    reference: dict[tuple[int, str], list[str]] = {}
    with open(plain.log_path, "wb") as log:
        plain.proc = subprocess.Popen(plain.argv, env=plain.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    try:
        _wait(plain)
        for s in seeds:
            for w, args in loads[s].items():
                r = _bench(vllm, plain.url, Path(model), args, concurrency, ref_dir, f"{w}-{s}.json".replace(" ", "-"))
                reference[(s, w)] = r.get("texts", [])
    finally:
        stop_session(plain.proc, 20.0)

    rows: list[dict[str, Any]] = []
    for policy in policies:
        log_dir = work / policy
        fleet = Fleet(FleetConfig(model=Path(model), prefill=[InstanceShape.parse(p, "--prefill") for p in PREFILL],
                                  decode=[InstanceShape.parse(d, "--decode") for d in DECODE], log_dir=log_dir,
                                  port=free_ports(1), vllm_python=python, router_policy=policy))
        prefill_urls = [m.url for m in fleet.members if m.role == "prefill"]
        runs: dict[str, list[dict[str, Any]]] = {w: [] for w in loads[seeds[0]]}
        try:
            fleet.start()
            fleet.wait_ready(1800)
            _bench(vllm, fleet.endpoint, Path(model), prefix_workload(concurrency * 2, 2, 7), concurrency, log_dir,
                   "warmup.json")  # unmeasured: a fresh instance's first steps compile
            if policy == "kv_aware":  # the router scores an instance once it verified its identity
                _verified(fleet, len(prefill_urls), vllm, Path(model), log_dir)
            for s in seeds:
                for w, args in loads[s].items():
                    h0, q0 = _hits(prefill_urls)
                    r = _bench(vllm, fleet.endpoint, Path(model), args, concurrency, log_dir,
                               f"{w}-{s}.json".replace(" ", "-"))
                    h1, q1 = _hits(prefill_urls)
                    ref = reference.get((s, w), [])
                    texts = r.pop("texts", [])
                    r["hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else None
                    r["answers_equal"] = sum(a == b for a, b in zip(texts, ref)) if ref else None
                    r["answers"] = len(ref)
                    runs[w].append(r)
            relay = fleet.routing.stats() if fleet.routing is not None else {}
        finally:
            fleet.stop()
        for w, rs in runs.items():
            rows.append({"policy": policy, "workload": w, **_median(rs), "relay": relay if w == "shared prefixes"
                         else None})
    return {"prefill": list(PREFILL), "decode": list(DECODE), "prompts": prompts, "concurrency": concurrency,
            "rounds": rounds, "rows": rows, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "cores": os.cpu_count()}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    bad = next((r for r in runs if "error" in r), None)
    if bad is not None:
        return {"error": bad["error"]}
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs if r.get(k) is not None)
                           for k in (*FIGURES, "hit_rate") if any(r.get(k) is not None for r in runs)}
    out.update(completed=sum(r["completed"] or 0 for r in runs), failed=sum(r["failed"] or 0 for r in runs),
               answers_equal=sum(r["answers_equal"] or 0 for r in runs), answers=sum(r["answers"] for r in runs),
               per_round={k: [r.get(k) for r in runs] for k in (*FIGURES, "hit_rate")})
    return out


def _verified(fleet: Any, count: int, vllm: str, model: Path, log_dir: Path, timeout: float = 300.0) -> None:
    metrics = f"http://127.0.0.1:{fleet._prometheus}"
    end = time.monotonic() + timeout
    while metric_total(metrics, "vllm_router_pd_identity_verified") < count and time.monotonic() < end:
        _bench(vllm, fleet.endpoint, model, prefix_workload(2, 1, 5), 1, log_dir, "identity.json")
        time.sleep(2)


def _wait(member: Any, timeout: float = 1800.0) -> None:
    from kvbridge.integrations.vllm.fleet import healthy

    end = time.monotonic() + timeout
    while not healthy(member.url):
        if member.proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"the plain instance did not start: {member.cause() or member.log_tail(1)}")
        time.sleep(1)


__all__ = ["POLICIES", "bench_routing", "chat_file", "prefix_workload"]

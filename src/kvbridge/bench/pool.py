"""Shared-pool benchmarks (issue 23 point 5), measured side by side in one run.

* `bench_pool_transfer`: one engine stores N pool blocks into a Mooncake Store, an engine of
  another shape loads them through another client (another instance's path: Mooncake's
  transport) and through the writer's own (an instance reloading what it stored: in-memory when
  the objects are in its own segment); store and load GB/s (payload bytes over wall time,
  sealing and checking included) beside a contiguous `torch` copy of the same number of bytes.
* `bench_pool_serve`: a shared-prefix workload (`vllm bench serve`, prefix repetition) sent to
  instance A (TP 1, block 64), then the same prompts to instance B (TP 2, block 32, another
  process), for three setups running side by side: plain vLLM prefix caching (B recomputes what
  A computed), the shared pool (B loads it), and vLLM's own CPU offload where this vLLM build
  runs it. Per setup: B's TTFT p50/p99, output throughput, failed requests, and B's prefix hit
  rate (local and external hits over queried tokens, from vLLM's /metrics).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvbridge.core.secrets import generate_secret
from kvbridge.testing.serving import metric_total

SETUPS = ("prefix cache only", "kvbridge pool", "vLLM CPU offload")
POOL_SETUPS: dict[str, dict[str, Any]] = {"kvbridge pool": {}, "kvbridge pool, async loads": {"load_async": True}}
"""Setups that run the pool connector, with what each sets beyond the defaults (the second is for
comparing vLLM's asynchronous load path; both share one master, so its A finds A's objects stored)."""


def random_workload(input_len: int = 576, output_len: int = 8) -> list[str]:
    """Prompts of random tokens (`vllm bench serve --dataset-name random`): no two share a prefix,
    so B's hits come from the pool alone (B gets A's first round: the same seed)."""
    return ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", "0"]


def prefix_workload(prefix_len: int = 512, num_prefixes: int = 4, output_len: int = 8) -> list[str]:
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", str(num_prefixes),
            "--prefix-repetition-output-len", str(output_len)]


def bench_pool_transfer(tokens: int = 4096, rounds: int = 3, layers: int = 16, heads: int = 8,
                        head_dim: int = 128, block_tokens: int = 64, local_memcpy: bool = True) -> dict[str, Any]:
    """Store from TP 2 / block 16, load into TP 1 / block 64 (HND), through a real master.

    `local_memcpy=False` measures Mooncake's transport where it would copy in memory (the
    writer's puts into its own segment, its reloads)."""
    import hashlib

    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.spec import ModelSpec
    from kvbridge.offload.keys import make_offload_key
    from kvbridge.offload.spec import GPULoadStoreSpec
    from kvbridge.pool.master import MooncakeMaster
    from kvbridge.pool.store import MIN_SEGMENT_BYTES, StoreClient, StoreConfig
    from kvbridge.pool.tier import PoolConfig, PoolTier
    from kvbridge.proofs.verify import random_bytes
    from kvbridge.transport.cache import RankCache

    spec = ModelSpec.uniform(layers, heads, head_dim, "bfloat16", name="bench")
    n = tokens // block_tokens
    fs, fd = block_tokens // 16, block_tokens // 64  # device blocks per pool block
    src_l = EngineLayout(tp_size=2, block_size=16, num_blocks=n * fs + 1)
    dst_l = EngineLayout(tp_size=1, block_size=64, num_blocks=n * fd + 1, kv_order="HND")
    src, dst = RankCache.allocate_engine(spec, src_l, fill=None), RankCache.allocate_engine(spec, dst_l, fill=None)
    random_bytes(src, 1)
    payload = sum(dst[0].addr.region_nbytes) // dst_l.num_blocks * n * fd  # one copy of n blocks, every head once
    work = Path(tempfile.mkdtemp(prefix="kvbridge-bench-pool-"))
    master = MooncakeMaster.start(work / "master.log")
    client = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=max(64 << 20, 2 * payload),
                                     local_memcpy=local_memcpy))
    other = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=MIN_SEGMENT_BYTES,  # as a rank
                                    local_memcpy=local_memcpy))
    out: dict[str, list[float]] = {"store_s": [], "load_s": [], "reload_s": [], "copy_s": []}
    try:
        cfg = PoolConfig(model_id="bench", block_tokens=block_tokens, staging_blocks=min(n, 32), secret=generate_secret())
        writers = [PoolTier(c, client, cfg) for c in src]
        readers, rereaders = [PoolTier(c, other, cfg) for c in dst], [PoolTier(c, client, cfg) for c in dst]
        a, b = torch.empty(payload, dtype=torch.uint8), torch.empty(payload, dtype=torch.uint8)
        a.random_(0, 255)
        for r in range(rounds):
            keys = [make_offload_key(hashlib.sha256(f"{r}/{i}".encode()).digest(), 0) for i in range(n)]
            t0 = time.perf_counter()
            stored = [t.store(GPULoadStoreSpec(list(range(1, 1 + fs * n)), [fs * n], [0]), keys) for t in writers]
            t1 = time.perf_counter()
            loaded = [t.load(keys, GPULoadStoreSpec(list(range(1, 1 + fd * n)), [fd * n], [0])) for t in readers]
            t2 = time.perf_counter()
            loaded += [t.load(keys, GPULoadStoreSpec(list(range(1, 1 + fd * n)), [fd * n], [0])) for t in rereaders]
            t2r = time.perf_counter()
            why = [w for res in stored + loaded for w in res.reasons]
            b.copy_(a)
            t3 = time.perf_counter()
            if why:
                raise RuntimeError(f"a pool store or load failed during the benchmark: {why[0]}")
            client.remove([name for k in keys for name in writers[0].layout.keys(k)])  # room for the next round
            out["store_s"].append(t1 - t0)
            out["load_s"].append(t2 - t1)
            out["reload_s"].append(t2r - t2)
            out["copy_s"].append(t3 - t2r)
        for t in writers + readers + rereaders:
            t.close()
    finally:
        other.close()
        client.close()
        master.stop()
    med = {k: statistics.median(v) for k, v in out.items()}
    gbs = {k.replace("_s", "_gb_s"): payload / v / 1e9 for k, v in med.items()}
    return {"spec": spec.describe(), "store_engine": src_l.describe(), "load_engine": dst_l.describe(),
            "tokens": n * block_tokens, "block_tokens": block_tokens, "bytes": payload, "rounds": rounds, **gbs,
            "store_vs_copy": med["copy_s"] / med["store_s"], "load_vs_copy": med["copy_s"] / med["load_s"],
            "reload_vs_copy": med["copy_s"] / med["reload_s"]}


def _hits(url: str) -> dict[str, float]:
    return {k: metric_total(url, f"vllm:{k}_total") for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                        "external_prefix_cache_queries", "external_prefix_cache_hits")}


def _bench(vllm: str, url: str, model: Path, prompts: int, concurrency: int, out: Path, name: str,
           workload: list[str], seed: int = 7) -> dict[str, Any]:
    cmd = [vllm, "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", "model", "--tokenizer",
           str(model), *workload, "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--seed", str(seed), "--ignore-eos", "--save-result", "--result-dir", str(out), "--result-filename", name,
           "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        return {"error": (res.stdout + res.stderr)[-600:]}
    data = json.loads((out / name).read_text())
    return {k: data.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                                     "output_throughput", "completed", "failed")}


A_FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")


def _rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A's rounds as one row: each figure's median over the rounds, completed and failed summed."""
    failed = next((r for r in results if "error" in r), None)
    if failed is not None:
        return failed
    row: dict[str, Any] = {k: statistics.median(r[k] for r in results) for k in A_FIGURES}
    row.update(completed=sum(r["completed"] for r in results), failed=sum(r["failed"] for r in results),
               rounds=results)
    return row


def _start(members: list, deadline_s: float = 1800.0) -> str | None:
    """Launch `members` together and wait until each answers; why one did not (None: all did)."""
    from kvbridge.integrations.vllm.fleet import healthy

    for m in members:
        with open(m.log_path, "wb") as log:
            m.proc = subprocess.Popen(m.argv, env=m.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    end = time.monotonic() + deadline_s
    for m in members:
        while not healthy(m.url) and m.proc.poll() is None and time.monotonic() < end:
            time.sleep(1)
    down = next((m for m in members if not healthy(m.url)), None)
    return None if down is None else f"{down.name} did not start: {down.cause() or down.log_tail(1)[-300:]}"


def bench_pool_serve(model: Path | None = None, prompts: int = 16, concurrency: int = 4,
                     python: str | None = None, work: Path | None = None, num_prefixes: int = 4,
                     layers: int = 6, heads: int = 8, setups: tuple[str, ...] = SETUPS, rounds: int = 3,
                     warmup: int = 8, output_len: int = 8, dataset: str = "prefix_repetition") -> dict[str, Any]:
    """The setups side by side (see the module doc); returns A's and B's figures per setup.

    Every setup's instances run at once (started together; one that does not start is its
    setup's error), so that a setup's figures and its baseline's come from the same minutes of a
    shared host. Each instance first serves `warmup` prompts of its own, unmeasured (a fresh
    instance's first steps compile, seconds on a CPU host). A then serves `rounds` rounds of new
    prompts (another seed each), the setups' A instances taking turns within each round (in
    reversed order every other round); its figures are the medians over the rounds, and
    `a_vs_prefix_cache_only` compares them with the setup without the pool: what the pool's
    stores and lookups cost the instance that stores. B of each setup then gets A's first round.

    `num_prefixes == prompts` makes every prompt the first of its prefix: on B each one is a
    local miss, so the pool's effect is not averaged with local hits. `output_len` of 64 or more
    makes A store its requests' blocks while they decode, too. `dataset="random"`: prompts of
    576 random tokens instead (`num_prefixes` unused), none sharing a prefix with another."""
    if dataset not in ("prefix_repetition", "random"):
        raise ValueError(f"dataset must be 'prefix_repetition' or 'random', got {dataset!r}")
    workload = (random_workload(576, output_len) if dataset == "random"
                else prefix_workload(512, num_prefixes, output_len))
    from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, vllm_serve_member
    from kvbridge.integrations.vllm.fleet_processes import find_tool, stop_session, vllm_python
    from kvbridge.pool.master import MooncakeMaster
    from kvbridge.proofs.vllm.cluster import free_ports

    work = Path(work or tempfile.mkdtemp(prefix="kvbridge-bench-pool-serve-")).resolve()
    if model is None:  # enough compute per token that a 512-token prefix costs real prefill time
        from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
        model = add_byte_tokenizer(make_tiny_llama(work / "small-llama", num_heads=heads, num_kv_heads=4,
                                                   head_dim=64, num_layers=layers, seed=11))
    vllm = find_tool(vllm_python(python), "vllm") or "vllm"
    secret = work / "pool.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    master = MooncakeMaster.start(work / "master.log") if set(setups) & set(POOL_SETUPS) else None
    rows: dict[str, dict[str, Any]] = {s: {"setup": s} for s in setups}
    members: dict[str, tuple[Any, Any]] = {}
    used: set[int] = set()
    for setup in setups:
        log_dir = work / setup.replace(" ", "-")
        log_dir.mkdir(parents=True, exist_ok=True)
        config = FleetConfig(model=Path(model), prefill=[], decode=[], log_dir=log_dir, max_model_len=1024)
        kv = None
        if setup in POOL_SETUPS:
            kv = {"kv_connector": "KVBridgePoolConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
                      "master": master.address, "metadata_url": master.metadata_url, "secret_file": str(secret),
                      "block_tokens": 64, "segment_mib": 256, **POOL_SETUPS[setup]}}
        pa = free_ports(1, used)
        pb = free_ports(1, used | {pa})
        used |= {pa, pb}
        pair = (vllm_serve_member(config, vllm, "a", InstanceShape(tp=1, block=64), pa, log_dir, kv),
                vllm_serve_member(config, vllm, "b", InstanceShape(tp=2, block=32), pb, log_dir, kv))
        if setup == "vLLM CPU offload":
            for m in pair:
                m.argv += ["--kv-offloading-size", "1"]
        members[setup] = pair
    try:
        for setup, pair in list(members.items()):  # a setup vLLM refuses fails at once: out before the rest
            if setup == "vLLM CPU offload":
                why = _start(list(pair), deadline_s=600)
                if why:
                    rows[setup]["error"] = why
                    for m in pair:
                        stop_session(m.proc)
                    del members[setup]
        why = _start([m for s, pair in members.items() if s != "vLLM CPU offload" for m in pair])
        if why:
            raise RuntimeError(f"the pool benchmark's instances did not start: {why}")
        for i, (setup, (a, b)) in enumerate(members.items()):
            log_dir = a.log_path.parent
            for m, seed in ((a, 1000 + 2 * i), (b, 1001 + 2 * i)):
                if warmup:  # prompts of their own: B's warm-up shares no prefix with A's rounds
                    _bench(vllm, m.url, Path(model), warmup, concurrency, log_dir, f"warmup-{m.name}.json",
                           workload, seed=seed)
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in members}
        for r in range(rounds):
            order = list(members.items())
            for setup, (a, _) in (order if r % 2 == 0 else order[::-1]):
                time.sleep(2)  # the previous instance's stores and idle steps settle
                results[setup].append(_bench(vllm, a.url, Path(model), prompts, concurrency, a.log_path.parent,
                                             f"a-{r}.json", workload, seed=7 + r))
        time.sleep(3)  # A's last stores
        for setup, (a, b) in members.items():
            rows[setup]["a"] = _rounds(results[setup])
            before = _hits(b.url)
            rows[setup]["b"] = _bench(vllm, b.url, Path(model), prompts, concurrency, b.log_path.parent, "b.json",
                                      workload, seed=7)
            after = _hits(b.url)
            q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
            local = after["prefix_cache_hits"] - before["prefix_cache_hits"]
            ext = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
            rows[setup]["b_hit_rate"] = {"local": local / q if q else None, "external": ext / q if q else None}
    finally:
        for pair in members.values():
            for m in pair:
                stop_session(m.proc)
        if master is not None:
            master.stop()
    rows_out = [rows[s] for s in setups]
    base = rows.get("prefix cache only")
    base = base if base and "b" in base and "error" not in base["b"] else None
    for r in rows_out:
        if base and "b" in r and "error" not in r["b"] and r["b"].get("median_ttft_ms"):
            r["b_ttft_vs_prefix_cache_only"] = base["b"]["median_ttft_ms"] / r["b"]["median_ttft_ms"]
        if base and "a" in r and "error" not in r["a"] and "error" not in base["a"]:
            # > 1: the storing instance is slower than without the pool (time figures), or slower in tokens/s
            r["a_vs_prefix_cache_only"] = {k: (base["a"][k] / r["a"][k] if k == "output_throughput"
                                               else r["a"][k] / base["a"][k]) for k in A_FIGURES if base["a"][k]}
    return {"model": Path(model).name, "prompts": prompts, "concurrency": concurrency, "workload": workload,
            "rounds": rounds, "warmup": warmup, "side_by_side": True, "rows": rows_out, "work": str(work)}


__all__ = ["bench_pool_serve", "bench_pool_transfer"]

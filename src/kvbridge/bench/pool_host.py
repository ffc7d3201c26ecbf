"""The pool's host tier against a copy (issue 42 point 4): a store by one process, a load by another.

One engine (TP 2, block 16) stores N pool blocks into the host tier, sealing included; another
process (TP 1, block 64, HND: another shape) loads them, opening included. Each side times a
`torch` copy of the same payload bytes right after each of its rounds, in its own process, so
every ratio is measured side by side on the same core under the same load. Figures: payload
bytes over wall time, median of the rounds, at each pool block size; beside them AES-GCM alone over
the same bytes against a copy (`seal_ceiling`), the most of a copy a sealed store or load can reach
on this host.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

SHAPES = {"store": dict(tp=2, block=16, kv_order="NHD"), "load": dict(tp=1, block=64, kv_order="HND")}


def _engine(side: str, layers: int, heads: int, head_dim: int, tokens: int, block_tokens: int, host_dir: str,
            rounds: int):
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.spec import ModelSpec
    from kvbridge.pool.tier import PoolConfig, PoolTier
    from kvbridge.proofs.verify import random_bytes
    from kvbridge.transport.cache import RankCache

    spec = ModelSpec.uniform(layers, heads, head_dim, "bfloat16", name="bench")
    shape = SHAPES[side]
    n = tokens // block_tokens
    layout = EngineLayout(tp_size=shape["tp"], block_size=shape["block"], num_blocks=tokens // shape["block"] + 1,
                          kv_order=shape["kv_order"])
    caches = RankCache.allocate_engine(spec, layout, fill=None)
    random_bytes(caches, 1)
    payload = sum(caches[0].addr.region_nbytes) * shape["tp"] // layout.num_blocks * (tokens // shape["block"])
    cfg = PoolConfig(model_id="bench", block_tokens=block_tokens, staging_blocks=min(n, 32),
                     secret=b"bench-host-tier-secret-0123", host_bytes=int(payload * (rounds + 1) * 1.1) + (8 << 20),
                     host_dir=host_dir)
    tiers = [PoolTier(c, None, cfg) for c in caches]
    return tiers, payload, n, tokens // shape["block"]


def _keys(r: int, n: int):
    from kvbridge.offload.keys import make_offload_key

    return [make_offload_key(hashlib.sha256(f"host/{r}/{i}".encode()).digest(), 0) for i in range(n)]


def run_side(side: str, layers: int, heads: int, head_dim: int, tokens: int, block_tokens: int, host_dir: str,
             rounds: int) -> dict[str, Any]:
    """One side's rounds: each a store (or load) of every block, then a copy of the same bytes."""
    from kvbridge.offload.spec import GPULoadStoreSpec

    tiers, payload, n, device_blocks = _engine(side, layers, heads, head_dim, tokens, block_tokens, host_dir, rounds)
    job = GPULoadStoreSpec(list(range(1, 1 + device_blocks)), [device_blocks], [0])
    a, b = torch.empty(payload, dtype=torch.uint8), torch.empty(payload, dtype=torch.uint8)
    a.random_(0, 255)
    b.copy_(a)
    moved, copied, why = [], [], []
    for r in range(rounds):
        keys = _keys(r, n)
        t0 = time.perf_counter()
        res = [t.store(job, keys) if side == "store" else t.load(keys, job) for t in tiers]
        t1 = time.perf_counter()
        b.copy_(a)
        t2 = time.perf_counter()
        why += [w for x in res for w in x.reasons] + ([] if all(all(x.done) for x in res) else ["not every block"])
        moved.append(t1 - t0)
        copied.append(t2 - t1)
    for t in tiers:
        t.close()
    if why:
        raise RuntimeError(f"a host-tier {side} failed during the benchmark: {why[0]}")
    m, c = statistics.median(moved), statistics.median(copied)
    objects = sum(t.stats["host_objects_put" if side == "store" else "host_objects_got"] for t in tiers) // rounds
    return {"bytes": payload, f"{side}_gb_s": payload / m / 1e9, f"copy_gb_s_{side}_side": payload / c / 1e9,
            f"{side}_vs_copy": c / m, f"{side}_objects": objects}


def seal_ceiling(payload: int, objects: int, rounds: int) -> dict[str, Any]:
    """AES-GCM alone over the same payload in objects of the same size, memory to memory, on the
    threads the tier seals with (`seal.SEAL_THREADS`), beside a copy: every store and every load
    makes one such pass, so this is the most of a copy either can reach on this host."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvbridge.pool.seal import SEAL_THREADS

    size = max(1, payload // max(1, objects))
    n = payload // size
    src, dst = torch.empty(n * size, dtype=torch.uint8), torch.empty(n * (size + 16), dtype=torch.uint8)
    src.random_(0, 255)
    dst.zero_()
    copy_to = torch.empty_like(src)
    s, d = src.numpy(), dst.numpy()
    aead = AESGCM(os.urandom(32))

    def part(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            aead.encrypt_into(i.to_bytes(12, "little"), s[i * size:(i + 1) * size], b"",
                              d[i * (size + 16):(i + 1) * (size + 16)])

    threads = min(SEAL_THREADS, n)
    cuts = np.linspace(0, n, threads + 1).astype(int)
    sealed, copied = [], []
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(ex.map(part, cuts[:-1], cuts[1:]))
            t1 = time.perf_counter()
            copy_to.copy_(src)
            t2 = time.perf_counter()
            sealed.append(t1 - t0)
            copied.append(t2 - t1)
    return {"seal_object_bytes": size, "seal_threads": threads,
            "seal_only_vs_copy": statistics.median(copied) / statistics.median(sealed)}


def bench_host_transfer(tokens: int = 4096, rounds: int = 5, block_sizes: tuple[int, ...] = (64, 1024),
                        layers: int = 16, heads: int = 8, head_dim: int = 128) -> dict[str, Any]:
    """Per pool block size: store (this process) and load (another process) beside copies."""
    from kvbridge.pool.host_arena import arena_dir

    rows = []
    for block_tokens in block_sizes:
        host_dir = tempfile.mkdtemp(prefix="bench-", dir=arena_dir())
        try:
            args = [layers, heads, head_dim, tokens, block_tokens, host_dir, rounds]
            stored = run_side("store", *args)
            res = subprocess.run([sys.executable, "-m", "kvbridge.bench.pool_host", json.dumps(["load", *args])],
                                 capture_output=True, text=True, timeout=3600)
            if res.returncode:
                raise RuntimeError(f"the loading process failed: {(res.stderr or res.stdout).strip()[-400:]}")
            loaded = json.loads(res.stdout.strip().splitlines()[-1])
        finally:
            for f in os.listdir(host_dir):
                os.unlink(os.path.join(host_dir, f))
            os.rmdir(host_dir)
        ceiling = seal_ceiling(stored["bytes"], stored["store_objects"], rounds)
        rows.append({"pool_block_tokens": block_tokens, "tokens": tokens, "rounds": rounds, **stored, **loaded,
                     **ceiling})
    return {"store_engine": "TP 2, block 16, NHD", "load_engine": "TP 1, block 64, HND (another process)",
            "model": f"{layers} layers x {heads} KV heads x {head_dim}, bfloat16", "rows": rows}


if __name__ == "__main__":  # the other process of `bench_host_transfer`
    side, *rest = json.loads(sys.argv[1])
    print(json.dumps(run_side(side, *rest)))

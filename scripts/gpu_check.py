"""`make gpu-check`: kvbridge's CUDA paths on a GPU machine, one JSON line per check (issue 14 item 5).

1. proof: the transformers proof with the model and both engines' caches on the device (the
   local executor then copies there: Triton's kernel where torch ships Triton, else torch):
   greedy tokens equal and the cache bit-exact, for attention, sliding, MLA and hybrid models
   over non-divisible TP, block, layout, PP and CP changes.
2. verify: `--cases` random legal shape pairs on every axis, executed on the device, every
   destination byte compared with the CPU reference.
3. executor: Llama-3-8B geometry, 4096 tokens, TP1 -> TP2: the executor's copy beside a
   device-to-device copy of the same bytes in the same run (medians; the issue's goal is a ratio
   of at least 0.8), repeated (the plan's pieces already on the device) and first (a new plan
   object: validation and upload timed too), and the torch fallback on the same plan.
4. nixl_vram: two NIXL agents, each registering VRAM, reading the same bytes as the plan's runs
   and as one contiguous transfer (needs the `nixl` package on the machine).

`--device cpu` runs the same code on the CPU with small sizes: CI runs it that way
(tests/test_gpu_check.py) so the script cannot rot on machines without a GPU. Figures measured
on a GPU go into docs/gpu.md with the device and the date; none are claimed without a run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

PROOF_CASES = (
    ("tiny-llama-6kv", dict(tp_size=3, block_size=16), dict(tp_size=2, block_size=8, kv_order="NHD")),
    ("tiny-gemma2", dict(tp_size=1, pp_size=2), dict(tp_size=2, block_size=8)),
    ("tiny-deepseek-v3", dict(tp_size=2, pcp_size=2), dict(tp_size=4, dcp_size=4)),
    ("tiny-qwen3-next", dict(tp_size=1), dict(tp_size=2, pp_size=2)),
)


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_proof(device: str) -> list[dict[str, Any]]:
    from kvbridge.core.layout import EngineLayout
    from kvbridge.proofs.local_demo import run_demo
    out = []
    for model, p, d in PROOF_CASES:
        r = run_demo(model, prompt_len=40, new_tokens=4, seed=0, prefill=EngineLayout(num_blocks=64, **p),
                     decode=EngineLayout(num_blocks=64, **d), device=device)
        out.append({"check": "proof", "device": device, "model": model, "prefill": r.prefill, "decode": r.decode,
                    "match": r.match, "cache_equal": r.cache_equal, "ok": r.ok})
    return out


def check_executor(device: str, num_tokens: int, repeats: int) -> dict[str, Any]:
    import torch
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.plan import Request, plan_request
    from kvbridge.models import spec_from_hf_config
    from kvbridge.models.presets import PRESETS
    from kvbridge.transport.cache import RankCache
    from kvbridge.transport.local import LocalExecutor
    spec = spec_from_hf_config(PRESETS["llama-3-8b"])
    blocks = -(-num_tokens // 16) + 1
    prefill, decode = EngineLayout(tp_size=1, num_blocks=blocks), EngineLayout(tp_size=2, num_blocks=blocks)
    rng = random.Random(0)
    request = Request(tuple(tuple(rng.sample(range(blocks), blocks - 1)) for _ in spec.groups),
                      tuple(tuple(rng.sample(range(blocks), blocks - 1)) for _ in spec.groups), num_tokens)
    src = RankCache.allocate_engine(spec, prefill, device=device, fill=None)
    dst = RankCache.allocate_engine(spec, decode, device=device, fill=None)
    for c in src:
        for r in c.byte_regions():
            r.fill_(7)
    plan = plan_request(spec, prefill, decode, request)
    executor = LocalExecutor(src, dst)
    a = torch.ones(plan.nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    executor.execute(plan)
    b.copy_(a)
    ours, cold, plain = [], [], []
    everything = np.ones(len(plan), dtype=bool)
    for _ in range(repeats):
        ours.append(_timed(lambda: executor.execute(plan), device))
        fresh = plan.select(everything)  # a new plan object: validation and upload are timed too
        cold.append(_timed(lambda: executor.execute(fresh), device))
        plain.append(_timed(lambda: b.copy_(a), device))
    mine, first, base = statistics.median(ours), statistics.median(cold), statistics.median(plain)
    row = {"check": "executor", "device": device, "tokens": num_tokens, "bytes": plan.nbytes, "runs": len(plan),
           "backend": executor.backend, "executor_gbps": plan.nbytes / mine / 1e9,
           "executor_first_gbps": plan.nbytes / first / 1e9, "device_copy_gbps": plan.nbytes / base / 1e9,
           "ratio": base / mine, "ratio_first": base / first, "repeats": repeats}
    if executor.backend != "torch":  # the torch fallback on the same plan, for the record
        fallback = LocalExecutor(src, dst, backend="torch")
        row["torch_backend_gbps"] = plan.nbytes / min(_timed(lambda: fallback.execute(plan), device)
                                                      for _ in range(3)) / 1e9
    return row


def check_verify(device: str, cases: int, seed: int = 0) -> dict[str, Any]:
    """Random legal shape pairs on every axis (`kvbridge verify --all-axes`): expected bytes from
    the CPU reference, the executor on `device`, every destination byte compared."""
    from kvbridge.proofs.verify import mismatch_report, prepare_case, random_case
    from kvbridge.transport.cache import RankCache
    from kvbridge.transport.local import LocalExecutor

    def moved(caches: list, to: str) -> list:
        return [RankCache(c.spec, c.layout, c.rank, [r.to(to) for r in c.regions]) for c in caches]
    rng, failures, backends, runs = random.Random(seed), [], set(), 0
    for i in range(cases):
        spec, src, dst, request = random_case(rng, all_axes=True)
        s, d, expected, plan = prepare_case(spec, src, dst, request, seed=2 * i)
        runs += len(plan)
        on_device = moved(d, device)
        executor = LocalExecutor(moved(s, device), on_device)
        executor.execute(plan)
        backends.add(executor.backend)
        bad = mismatch_report(moved(on_device, "cpu"), expected)
        if bad:
            failures.append(f"case {i} {src.describe()} -> {dst.describe()}: {bad[0]}")
    return {"check": "verify", "device": device, "cases": cases, "runs": runs, "backends": sorted(backends),
            "failures": failures[:5], "equal": not failures}


def _timed(fn: Any, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def check_nixl_vram(device: str, nbytes: int, repeats: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from kvbridge.transport.base import Runs, XferState
    from kvbridge.transport.nixl import NixlTransport
    a, b = NixlTransport(f"gpu-check-a-{time.time_ns()}"), NixlTransport(f"gpu-check-b-{time.time_ns()}")
    try:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        a.register([dst])
        b.register([src])
        a.connect(b.name, b.metadata())
        chunk = 1 << 16  # 64 KiB runs, like a head slice of a few blocks
        offsets = np.arange(0, nbytes, chunk, dtype=np.int64)
        zeros = np.zeros(len(offsets), np.int64)
        runs = Runs(zeros, offsets, zeros, offsets, np.full(len(offsets), chunk, np.int64))
        one = np.zeros(1, np.int64)
        whole = Runs(one, one, one, one, np.array([nbytes], np.int64))

        def timed(r: Any) -> float:
            t0 = time.perf_counter()
            h = a.submit(b.name, "read", r)
            while a.poll(h) == XferState.PENDING:
                pass
            if h.state != XferState.DONE:
                raise RuntimeError(f"NIXL read failed: {h.reason}")
            return time.perf_counter() - t0
        timed(whole)
        many = [timed(runs) for _ in range(repeats)]
        single = [timed(whole) for _ in range(repeats)]
        equal = bool(torch.equal(src, dst))
    finally:
        a.close()
        b.close()
    m, s = statistics.median(many), statistics.median(single)
    return {"check": "nixl_vram", "device": device, "bytes": nbytes, "runs": len(offsets), "equal": equal,
            "runs_gbps": nbytes / m / 1e9, "contiguous_gbps": nbytes / s / 1e9, "ratio": s / m}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", type=int, default=200, help="random shape pairs for the verify check")
    parser.add_argument("--skip", action="append", default=[], choices=["proof", "verify", "executor", "nixl_vram"])
    args = parser.parse_args(argv)
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine or pass --device cpu", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    if "proof" not in args.skip:
        rows += check_proof(args.device)
    if "verify" not in args.skip:
        rows.append(check_verify(args.device, args.cases))
    if "executor" not in args.skip:
        rows.append(check_executor(args.device, args.tokens, args.repeats))
    if "nixl_vram" not in args.skip:
        try:
            rows.append(check_nixl_vram(args.device, 64 << 20 if args.device != "cpu" else 1 << 20, args.repeats))
        except ImportError as e:
            rows.append({"check": "nixl_vram", "device": args.device, "skipped": f"nixl not importable: {e}"})
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for r in rows:
            r["gpu"] = name
    for r in rows:
        print(json.dumps(r))
    failed = [r for r in rows if r.get("ok") is False or r.get("equal") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""kvbridge's connector against vLLM's own NixlConnector, side by side in one run: `bench_vllm`."""

from __future__ import annotations

import os
import time
from typing import Any

from kvbridge.proofs.vllm import cluster as vllm_cluster


def _nixl_totals(metrics: dict[str, Any]) -> tuple[float, float, float]:
    """(seconds, transfers, bytes) so far from vLLM's NIXL Prometheus histograms."""
    def hist(name: str) -> tuple[float, float]:
        h = metrics.get(name) or {}
        return float(h.get("sum", 0.0)), float(h.get("count", 0.0))
    secs, count = hist("vllm:nixl_xfer_time_seconds")
    nbytes, _ = hist("vllm:nixl_bytes_transferred")
    return secs, count, nbytes


def _nixl_request(cluster: vllm_cluster.Cluster, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One request through the NIXL pair, with the transfer figures vLLM's NIXL metrics gained meanwhile."""
    decode = cluster.instances["nixl-decode"]
    before = _nixl_totals(decode.command(op="metrics")["metrics"])
    row = cluster.pd("nixl-prefill", "nixl-decode", prompt, new_tokens)
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
    return row


def bench_vllm(model_dir: str | os.PathLike | None = None, prefill_tp: int = 1, decode_tp: int = 1,
               prompt_len: int = 256, new_tokens: int = 4, requests: int = 8, *, block_size: int = 32,
               seed: int = 0, python: str | None = None, timeout_s: float = 2400.0,
               workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The same P/D requests through KVBridgeConnector and through vLLM's NixlConnector (CPU).

    Starts a kvbridge prefill/decode pair and a NIXL pair (`kv_buffer_device: cpu`) on the same
    model and shapes, then sends each of `requests` prompts (`prompt_len` tokens) through the
    kvbridge pair and right after through the NIXL pair, so both see the same machine load.
    Reports per request and connector the decoded tokens (both must equal the kvbridge prefill
    instance's plain greedy output), the transfer time as each connector measures it (kvbridge:
    first read posted to last read done on the decode ranks; NIXL: vLLM's `nixl_xfer_time_seconds`
    histogram, transfer start to completion), the bytes moved, the decode request's wall time
    (KV load + recompute of the last prompt token + decode), and the kvbridge/NIXL ratios of the
    medians; medians skip the first request (handshakes, first-use costs).
    """
    vllm_cluster.check_block_size(block_size)
    t_start = time.monotonic()
    python = vllm_cluster.vllm_python(python)
    with vllm_cluster.workspace(workdir, "kvbridge-vllm-bench-") as (work, own_dir):
        model = vllm_cluster.model_directory(model_dir, python, work)
        prompts = [vllm_cluster.prompt_ids_for(None, prompt_len, seed + i) for i in range(max(1, requests))]
        with vllm_cluster.Cluster(model, python, work) as cluster:
            cluster.start("kvbridge-prefill", prefill_tp, block_size, "kv_producer")
            cluster.start("kvbridge-decode", decode_tp, block_size, "kv_consumer")
            cluster.start("nixl-prefill", prefill_tp, block_size, "kv_producer", connector="nixl")
            cluster.start("nixl-decode", decode_tp, block_size, "kv_consumer", connector="nixl", log_stats=True)
            cluster.wait_ready(timeout=min(timeout_s, vllm_cluster.START_TIMEOUT_S * 2))
            reference = [cluster.instances["kvbridge-prefill"].generate(p, new_tokens)["token_ids"] for p in prompts]
            kvb, nixl = [], []
            for prompt in prompts:
                kvb.append(cluster.pd("kvbridge-prefill", "kvbridge-decode", prompt, new_tokens))
                nixl.append(_nixl_request(cluster, prompt, new_tokens))

            def summary(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
                steady = rows[1:] or rows
                return {"match_reference": [r["tokens"] == ref for r, ref in zip(rows, reference)],
                        "transfer_seconds": [r.get("transfer_seconds") for r in rows],
                        "transfer_seconds_median": vllm_cluster.median_seconds([r.get("transfer_seconds") for r in steady]),
                        "decode_seconds": [r["decode_seconds"] for r in rows],
                        "decode_seconds_median": vllm_cluster.median_seconds([r["decode_seconds"] for r in steady]),
                        "bytes_moved": [r.get("bytes_moved") for r in rows],
                        "num_runs": [r.get("num_runs") for r in rows] if kind == "kvbridge" else None,
                        "startup_seconds": {n: i.ready.get("startup_seconds") for n, i in cluster.instances.items()
                                            if n.startswith(kind)}}

            out = {"engine": "vllm", "model": model, "prefill_tp": prefill_tp, "decode_tp": decode_tp,
                   "block_size": block_size, "prompt_len": prompt_len, "new_tokens": new_tokens,
                   "requests": len(prompts),
                   "tokens_reference": reference, "kvbridge": summary(kvb, "kvbridge"), "nixl": summary(nixl, "nixl"),
                   "tokens_kvbridge": [r["tokens"] for r in kvb], "tokens_nixl": [r["tokens"] for r in nixl]}
            out["same_tokens"] = out["tokens_kvbridge"] == out["tokens_nixl"] == reference

            def ratio(key: str) -> float | None:
                a, b = out["kvbridge"][key], out["nixl"][key]
                return a / b if a is not None and b else None

            out["ratio_kvbridge_to_nixl"] = {"transfer_seconds_median": ratio("transfer_seconds_median"),
                                             "decode_seconds_median": ratio("decode_seconds_median")}
            out["wall_seconds"] = time.monotonic() - t_start
    return out


__all__ = ["bench_vllm"]

"""Prefill/decode with real vLLM CPU instances, compared with one plain instance: `run_vllm_demo`.

The proxy is the function itself, NixlConnector's protocol: the prompt goes to the prefill
instance with max_tokens=1 and `{"do_remote_decode": true}`; the `kv_transfer_params` it returns
go with the same prompt to the decode instance, which loads the prompt's KV through the
connector, recomputes the last prompt token and decodes. The reference is one plain vLLM
instance (no connector), greedy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.proofs.vllm import cluster as vllm_cluster


def run_vllm_demo(model_dir: str | os.PathLike | None = None, prefill_tp: int = 1, decode_tp: int = 1,
                  prompt_ids: Sequence[int] | None = None, new_tokens: int = 8, *, prefill_block_size: int = 32,
                  decode_block_size: int = 32, prompt_len: int = 48, seed: int = 0, transport: str = "shm",
                  mode: str = "pull", reference: str = "separate", requests: int = 1, python: str | None = None,
                  timeout_s: float = 1800.0, workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Prefill on one vLLM instance, move the KV with KVBridgeConnector, decode on another.

    `reference="separate"` computes the reference on a third, plain instance (no connector),
    started together with the pair and closed before the first P/D request; `"prefill"` asks
    the prefill instance itself after the P/D requests (a plain request there touches no
    connector path; it saves one instance start). `requests` > 1 repeats the P/D request (fresh
    request ids, same prompt) to time steady-state transfers. Returns a JSON-able dict:
    tokens_reference, tokens_disaggregated, match, logprobs_max_abs_diff, transfer figures
    (bytes_moved, num_runs, transfer_seconds per decode rank and request), start-up and request
    seconds.
    """
    if reference not in ("separate", "prefill"):
        raise ConfigError(f"reference must be 'separate' or 'prefill', got {reference!r}")
    vllm_cluster.check_block_size(prefill_block_size)
    vllm_cluster.check_block_size(decode_block_size)
    t_start = time.monotonic()
    python = vllm_cluster.vllm_python(python)
    with vllm_cluster.workspace(workdir, "kvbridge-vllm-") as (work, own_dir):
        model = vllm_cluster.model_directory(model_dir, python, work)
        prompt = vllm_cluster.prompt_ids_for(prompt_ids, prompt_len, seed)
        with vllm_cluster.Cluster(model, python, work, transport=transport, mode=mode) as cluster:
            if reference == "separate":
                cluster.start("reference", 1, decode_block_size)
            cluster.start("prefill", prefill_tp, prefill_block_size, "kv_producer")
            cluster.start("decode", decode_tp, decode_block_size, "kv_consumer")
            start_timeout = min(timeout_s, vllm_cluster.START_TIMEOUT_S * 1.5)
            r_out = None
            if reference == "separate":  # first, alone with its engine: then it is closed
                cluster.wait_ready(["reference"], start_timeout)
                r_out = cluster.instances["reference"].generate(prompt, new_tokens)
                cluster.close(["reference"])
            cluster.wait_ready(["prefill", "decode"], start_timeout)
            runs = [cluster.pd("prefill", "decode", prompt, new_tokens) for _ in range(max(1, requests))]
            if r_out is None:
                r_out = cluster.instances["prefill"].generate(prompt, new_tokens)
            last = runs[-1]
            tokens_r = r_out["token_ids"]
            lp_d, lp_r = last["logprobs"], r_out["logprobs"]
            diff = max((abs(a - b) for a, b in zip(lp_d, lp_r)), default=0.0) if len(lp_d) == len(lp_r) else None
            per_request = [{k: r[k] for k in ("remote_request_id", "ok", "bytes_moved", "num_runs", "transfer_seconds",
                                              "per_rank", "prefill_released", "prefill_seconds", "decode_seconds")}
                           for r in runs]
            steady = per_request[1:] or per_request
            inst = cluster.instances
            out = {
                "engine": "vllm", "connector": "KVBridgeConnector", "transport": transport, "mode": mode,
                "model": model,
                "prefill": {"engine_id": inst["prefill"].engine_id, "tp": prefill_tp,
                            "block_size": inst["prefill"].ready.get("block_size")},
                "decode": {"engine_id": inst["decode"].engine_id, "tp": decode_tp,
                           "block_size": inst["decode"].ready.get("block_size")},
                "reference": reference, "prompt_ids": prompt, "new_tokens": new_tokens,
                "tokens_reference": tokens_r, "tokens_disaggregated": last["tokens"],
                "match": all(r["tokens"] == tokens_r for r in runs),
                "logprobs_max_abs_diff": diff, "prefill_first_token": last["prefill_first_token"],
                "bytes_moved": last["bytes_moved"], "num_runs": last["num_runs"],
                "transfer_seconds": last["transfer_seconds"],
                "transfer_seconds_median": vllm_cluster.median_seconds([r["transfer_seconds"] for r in steady]),
                "requests": per_request,
                "kv_transfer_params": {k: v for k, v in last["params"].items() if k != "remote_block_ids"},
                "startup_seconds": {name: i.ready.get("startup_seconds") for name, i in inst.items()},
                "wall_seconds": time.monotonic() - t_start, "workdir": None if own_dir else str(work),
            }
    return out


__all__ = ["run_vllm_demo"]

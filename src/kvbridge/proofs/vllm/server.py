"""One vLLM instance behind a pipe, for the demo, the benchmark and the tests.

    python -m kvbridge.proofs.vllm.server CONFIG_JSON RESPONSE_FD

Builds `vllm.LLM` from the config (model, TP, block size, `kv_transfer_config`, environment),
then answers JSON-line commands read on stdin with JSON lines written to RESPONSE_FD (vLLM
logs to stdout/stderr, which the parent sends to a log file):

    {"op": "generate", "prompt_ids": [...], "max_tokens": N, "kv_transfer_params": {...} | null}
      -> {"event": "result", "token_ids": [...], "logprobs": [...], "kv_transfer_params": {...},
          "seconds": wall seconds of the call}
    {"op": "metrics"}  -> {"event": "metrics", "metrics": {name: value}} (KV transfer metrics)
    {"op": "exit"}     -> {"event": "bye"}, then the process exits

vLLM starts its engine and workers with `spawn`, hence the `__main__` guard.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _metrics(llm) -> dict:
    out: dict = {}
    try:
        for m in llm.get_metrics():
            name = getattr(m, "name", "")
            if not any(k in name for k in ("nixl", "kv_transfer", "kv_connector")):
                continue
            if hasattr(m, "sum") and hasattr(m, "count"):
                out[name] = {"sum": m.sum, "count": m.count}
            elif hasattr(m, "value"):
                out[name] = m.value
            elif hasattr(m, "values"):
                out[name] = m.values
    except Exception as e:  # noqa: BLE001 - metrics are optional
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    def send(**msg) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    for key, value in (cfg.get("env") or {}).items():
        os.environ[key] = str(value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kwargs = dict(model=cfg["model"], skip_tokenizer_init=True, max_model_len=int(cfg.get("max_model_len", 512)),
                      enforce_eager=True, dtype=cfg.get("dtype", "float32"),
                      tensor_parallel_size=int(cfg.get("tp", 1)), seed=int(cfg.get("seed", 0)),
                      enable_prefix_caching=bool(cfg.get("prefix_caching", False)),
                      disable_log_stats=not cfg.get("log_stats", False))
        if cfg.get("block_size"):
            kwargs["block_size"] = int(cfg["block_size"])
        if cfg.get("kv_transfer_config"):
            kwargs["kv_transfer_config"] = KVTransferConfig(**cfg["kv_transfer_config"])
        llm = LLM(**kwargs)
    except BaseException as e:  # noqa: BLE001 - the parent reports it with the log tail
        send(event="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-6000:])
        raise SystemExit(1)
    vcfg = llm.llm_engine.vllm_config
    send(event="ready", startup_seconds=time.perf_counter() - t0, block_size=vcfg.cache_config.block_size,
         tp=vcfg.parallel_config.tensor_parallel_size,
         engine_id=vcfg.kv_transfer_config.engine_id if vcfg.kv_transfer_config else None)

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                params = cmd.get("kv_transfer_params")
                sp = SamplingParams(max_tokens=int(cmd["max_tokens"]), temperature=0.0, detokenize=False,
                                    logprobs=1, ignore_eos=True,
                                    extra_args={"kv_transfer_params": params} if params else None)
                t = time.perf_counter()
                res = llm.generate([{"prompt_token_ids": list(cmd["prompt_ids"])}], sp, use_tqdm=False)[0]
                seconds = time.perf_counter() - t
                comp = res.outputs[0]
                logprobs = [float(lp[tok].logprob) for tok, lp in zip(comp.token_ids, comp.logprobs or [])]
                send(event="result", token_ids=list(comp.token_ids), logprobs=logprobs,
                     kv_transfer_params=res.kv_transfer_params, seconds=seconds,
                     num_cached_tokens=getattr(res, "num_cached_tokens", None))
            elif op == "metrics":
                send(event="metrics", metrics=_metrics(llm))
            elif op == "exit":
                break
            else:
                send(event="error", error=f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001
            send(event="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-6000:])
    send(event="bye")
    out.close()
    os._exit(0)  # vLLM's own shutdown waits for workers for tens of seconds; the parent reaps the group


if __name__ == "__main__":
    main()

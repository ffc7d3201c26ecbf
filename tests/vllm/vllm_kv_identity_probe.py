"""Runs in .venv-vllm: the KV identity (`integrations.vllm.kv_identity`) of real vLLM 0.32 engine
configs built by vLLM's own `EngineArgs` (no engine started), for one model directory served
plainly, again, with an `--hf-overrides` that changes RoPE, with a KV cache dtype of fp8, and
for a second directory of the same shape with other weights. Prints JSON: per case the digest
and the fields."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvbridge.integrations.vllm.kv_identity import vllm_kv_identity
    from kvbridge.proofs.vllm.model import make_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvb-identity-"))
    a = make_tiny_llama(work / "a", seed=1)
    b = make_tiny_llama(work / "b", seed=2)  # the same shapes, other weights
    cases = {
        "plain": dict(model=str(a)),
        "plain_again": dict(model=str(a)),
        "rope_override": dict(model=str(a), hf_overrides={"rope_theta": 500000.0}),
        "fp8_cache": dict(model=str(a), kv_cache_dtype="fp8"),
        "other_weights": dict(model=str(b)),
    }
    out = {}
    for name, kw in cases.items():
        with contextlib.redirect_stdout(io.StringIO()):
            config = EngineArgs(dtype="float32", max_model_len=512, **kw).create_engine_config()
        ident = vllm_kv_identity(config)
        out[name] = {"digest": ident.digest(), "fields": dict(ident.fields)}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

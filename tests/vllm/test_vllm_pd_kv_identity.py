"""Two `vllm serve` instances of one model directory that differ only in an `--hf-overrides` that
changes RoPE are not paired over P/D (issue 43 point 1): the decode instance's handshake with the
prefill instance is refused naming the RoPE field, the request's load fails, and it is still
answered (vLLM recomputes the prompt, `kv_load_failure_policy: recompute`) with the decode
instance's own tokens.

Real `vllm serve` processes with KVBridgeConnector, requests sent as NixlConnector's proxy sends
them (prefill with max_tokens=1 and `do_remote_decode`, then decode with the returned
`kv_transfer_params`). Two instance starts: a fleet test (`make fleet-tests`); the same refusal
with vLLM's own configs is in CI (`test_vllm_kv_identity.py`).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, vllm_serve_member
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.members import running
from kvbridge.testing.serving import prompt_text

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]


def _complete(url: str, prompt: str, max_tokens: int, params: dict | None) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **({"kv_transfer_params": params} if params is not None else {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def test_a_decode_instance_with_other_rope_is_refused_at_the_handshake(vllm_env, tmp_path):
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny", seed=3))
    secret = tmp_path / "pd.key"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    config = FleetConfig(model=model, prefill=[], decode=[], log_dir=tmp_path, dtype="float32", max_model_len=1024)
    vllm = str(vllm_env.python.parent / "vllm")
    http = free_ports(2)
    side = free_ports(2, {http, http + 1})

    def kv(name: str, port: int) -> dict:
        return {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
                "kv_role": "kv_both", "engine_id": f"{name}-{os.getpid()}", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": port,
                                              "secret_file": str(secret)}}

    p = vllm_serve_member(config, vllm, "p", InstanceShape(tp=1, block=64), http, tmp_path, kv("p", side))
    d = vllm_serve_member(config, vllm, "d", InstanceShape(tp=1, block=32), http + 1, tmp_path, kv("d", side + 1))
    d.argv += ["--hf-overrides", json.dumps({"rope_theta": 500000.0})]
    with running([p, d], tmp_path, 900.0):
        text = prompt_text(9, 300)
        first = _complete(p.url, text, 1, {"do_remote_decode": True})
        params = first.get("kv_transfer_params")
        assert params and params.get("do_remote_prefill"), first
        got = _complete(d.url, text, 4, params)
        # Answered, as the decode instance computes the prompt itself (its handshake refused, the
        # load failed, vLLM recomputed): its tokens are its own answer without the prefill's params.
        # (vLLM's external-hit counter counts the tokens promised before the handshake: not a check.)
        assert got["choices"][0]["token_ids"] == _complete(d.url, text, 4, None)["choices"][0]["token_ids"], got
        end = time.monotonic() + 60
        while True:
            log = Path(d.log_path).read_text(errors="replace")
            if "KV identity differs in config.rope_theta" in log and f"request {got['id']}" in log:
                break
            assert time.monotonic() < end, "no refusal naming RoPE in the decode instance's log:\n" + log[-3000:]
            time.sleep(0.5)

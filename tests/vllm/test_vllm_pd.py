"""Two real vLLM CPU instances, KV moved by KVBridgeConnector, tokens equal to a single instance.

Each test starts a prefill and a decode vLLM 0.32 instance (subprocesses of .venv-vllm) with
`KVBridgeConnector` over the shm transport, sends a prompt through the proxy of `run_vllm_demo`
(prefill with max_tokens=1, then decode with the returned kv_transfer_params) and compares the
decoded tokens and their log-probabilities with a plain vLLM instance's greedy output.

Shapes (tiny random Llama: 2 layers, 4 query heads, 2 KV heads of 32, float32; a 70-token
prompt, so the last block is partial on every side):

* equal TP and block size, reference from a separate plain instance;
* prefill TP 1 / block 64 -> decode TP 2 / block 32 (different block sizes, decode TP larger);
* prefill TP 2 / block 32 -> decode TP 1 / block 64 (prefill TP larger, decode blocks larger:
  a pair vLLM's own NIXL connector refuses, its block-size ratio must be local/remote >= 1).

vLLM CPU runs TP 2 here once its OpenMP threads are bound by hand (`cpu_binding`): its "auto"
binding refuses TP > 1 on a one-NUMA-node host.
"""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from kvbridge.integrations.vllm.demo import run_vllm_demo

pytestmark = [
    pytest.mark.vllm,
    # Three real vLLM CPU instances per test on 2 cores: minutes each, and flaky while anything else
    # loads the machine (a run under parallel load failed here). Opt in until they are proven stable in CI.
    pytest.mark.skipif(os.environ.get("KVBRIDGE_VLLM_PD") != "1",
                       reason="real-vLLM P/D tests are opt-in: set KVBRIDGE_VLLM_PD=1 (needs `make vllm-env`)"),
]

PROMPT = [random.Random(7).randrange(256) for _ in range(70)]
NEW_TOKENS = 8
LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 2, 2, 32, 4
KV_BYTES = LAYERS * 2 * len(PROMPT) * KV_HEADS * HEAD_DIM * ITEMSIZE
_reference: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def model(vllm_env, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    res = subprocess.run([str(vllm_env.python), "-m", "kvbridge.integrations.vllm.model", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(path)


def demo(vllm_env, model, tmp_path, **kw) -> dict:
    return run_vllm_demo(model, prompt_ids=PROMPT, new_tokens=NEW_TOKENS, python=str(vllm_env.python),
                         timeout_s=900, workdir=tmp_path, **kw)


def check(result: dict, decode_tp: int) -> None:
    assert result["match"], {k: result[k] for k in ("tokens_reference", "tokens_disaggregated", "requests")}
    assert len(result["tokens_disaggregated"]) == NEW_TOKENS
    assert result["logprobs_max_abs_diff"] is not None and result["logprobs_max_abs_diff"] < 1e-4
    req = result["requests"][0]
    assert req["ok"] and len(req["per_rank"]) == decode_tp
    assert req["bytes_moved"] == KV_BYTES  # every decode rank moved exactly its heads
    assert req["prefill_released"] == ["done"]  # the prefill blocks were released after the reads
    if "tokens" in _reference:  # the same model and prompt as the plain single instance
        assert result["tokens_disaggregated"] == _reference["tokens"]


def test_equal_tp_and_blocks_match_a_plain_instance(vllm_env, model, tmp_path):
    r = demo(vllm_env, model, tmp_path, prefill_tp=1, decode_tp=1, prefill_block_size=32, decode_block_size=32,
             reference="separate")
    check(r, 1)
    assert r["logprobs_max_abs_diff"] == 0.0  # same kernels, same KV bytes
    assert r["prefill"]["block_size"] == r["decode"]["block_size"] == 32
    _reference["tokens"] = r["tokens_reference"]


def test_block_64_to_32_and_decode_tp2(vllm_env, model, tmp_path):
    r = demo(vllm_env, model, tmp_path, prefill_tp=1, decode_tp=2, prefill_block_size=64, decode_block_size=32,
             reference="prefill")
    check(r, 2)
    assert (r["prefill"]["block_size"], r["decode"]["block_size"]) == (64, 32)
    assert sorted(e["nbytes"] for e in r["requests"][0]["per_rank"]) == [KV_BYTES // 2] * 2  # one KV head each


def test_prefill_tp2_to_decode_tp1_block_32_to_64(vllm_env, model, tmp_path):
    r = demo(vllm_env, model, tmp_path, prefill_tp=2, decode_tp=1, prefill_block_size=32, decode_block_size=64,
             reference="prefill")
    check(r, 1)
    assert (r["prefill"]["tp"], r["decode"]["tp"]) == (2, 1)

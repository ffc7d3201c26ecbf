"""Two real vLLM CPU instances, KV moved by KVBridgeConnector, tokens equal to a single instance.

One plain vLLM instance (no connector, TP 1, block 64) computes the reference first: the greedy
tokens and log-probabilities of a 70-token prompt (the last block is partial on every side).
Then six KVBridgeConnector instances (subprocesses of .venv-vllm, pull; four over kvbridge's shm
transport, two over NIXL) serve every test; each test sends the prompt through one prefill instance and one decode instance as
NixlConnector's proxy does (prefill with max_tokens=1, then decode with the returned
kv_transfer_params) and requires the reference's tokens, what every decode rank moved (exactly
its KV heads of the prompt), and the prefill blocks released after the reads:

* prefill TP 1 / block 64 -> decode TP 1 / block 64: equal TP and blocks, log-probs equal to
  the bit;
* prefill TP 1 / block 64 -> decode TP 2 / block 32: different block sizes, decode TP larger;
* prefill TP 2 / block 32 -> decode TP 1 / block 64: prefill TP larger, decode blocks larger (a
  pair vLLM's own NIXL connector refuses: its block-size ratio must be local/remote >= 1);
* prefill TP 2 / block 32 -> decode TP 2 / block 32: equal TP 2 (each decode rank reads its
  own heads from one prefill rank);
* prefill TP 1 / block 64 -> decode TP 2 / block 32 over NIXL (UCX), the caches registered as DRAM
  where vLLM allocated them.

Cost (measured, docs/vllm.md): every instance start imports torch and vLLM in 3 processes (4 at
TP 2), so the seven instances are started together and reused by all tests, instead of two or
three per test. Tiny random Llama: 2 layers, 4 query heads, 2 KV heads of 32, float32.

vLLM CPU runs TP 2 here once its OpenMP threads are bound by hand (`cpu_binding`): its "auto"
binding refuses TP > 1 on a one-NUMA-node host.
"""

from __future__ import annotations

import random
import time

import pytest

from kvbridge.proofs.vllm.cluster import Cluster
from kvbridge.proofs.vllm.model import make_tiny_llama

pytestmark = pytest.mark.vllm

PROMPT = [random.Random(7).randrange(256) for _ in range(70)]
NEW_TOKENS = 8
LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 2, 2, 32, 4
KV_BYTES = LAYERS * 2 * len(PROMPT) * KV_HEADS * HEAD_DIM * ITEMSIZE
INSTANCES = {  # name: (TP, block size, role, kvbridge transport)
    "p-tp1-b64": (1, 64, "kv_producer", "shm"),
    "p-tp2-b32": (2, 32, "kv_producer", "shm"),
    "d-tp1-b64": (1, 64, "kv_consumer", "shm"),
    "d-tp2-b32": (2, 32, "kv_consumer", "shm"),
    "p-tp1-b64-nixl": (1, 64, "kv_producer", "nixl"),  # NIXL (UCX) registers the caches as DRAM
    "d-tp2-b32-nixl": (2, 32, "kv_consumer", "nixl"),
}
REFERENCE_BLOCK = 64  # the reference instance's block size: the equal-TP pair's, so its log-probs must match exactly


MODEL_SEED = 3  # weights whose greedy continuation of PROMPT changes from token to token (seed 0 repeats one token)


@pytest.fixture(scope="module")
def model(vllm_env, tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("vllm-model") / "tiny-llama", seed=MODEL_SEED))


@pytest.fixture(scope="module")
def cluster(vllm_env, model, tmp_path_factory):
    """(cluster, reference): the plain instance's output, then the P/D instances, all ready."""
    work = tmp_path_factory.mktemp("vllm-pd")
    with Cluster(model, str(vllm_env.python), work) as c:
        t0 = time.monotonic()
        c.start("reference", 1, REFERENCE_BLOCK)  # no connector
        for name, (tp, block, role, transport) in INSTANCES.items():
            c.start(name, tp, block, role, transport=transport)
        c.wait_ready(["reference"])
        reference = c.instances["reference"].generate(PROMPT, NEW_TOKENS)
        c.close(["reference"])  # before any P/D request: it must not share the CPU with them
        assert len(set(reference["token_ids"])) > 2, reference  # tokens that a wrong cache would change
        c.wait_ready(list(INSTANCES))
        print(f"\n[vllm P/D] reference {reference['token_ids']}; reference and {len(INSTANCES)} instances ready in "
              f"{time.monotonic() - t0:.0f} s; startup seconds "
              f"{ {n: round(i.ready.get('startup_seconds', 0)) for n, i in c.instances.items()} }")
        yield c, reference


def run(cluster, prefill: str, decode: str) -> dict:
    c, reference = cluster
    r = c.pd(prefill, decode, PROMPT, NEW_TOKENS)
    (p_tp, p_block, _, _), (d_tp, d_block, _, _) = INSTANCES[prefill], INSTANCES[decode]
    assert (c.instances[prefill].ready["tp"], c.instances[prefill].ready["block_size"]) == (p_tp, p_block)
    assert (c.instances[decode].ready["tp"], c.instances[decode].ready["block_size"]) == (d_tp, d_block)
    why = {k: r.get(k) for k in ("tokens", "ok", "per_rank", "prefill_released", "decode_seconds")}
    why["reference"] = reference["token_ids"]
    assert r["ok"] and len(r["per_rank"]) == d_tp, why  # every decode rank loaded its KV through kvbridge
    assert r["tokens"] == reference["token_ids"], why
    assert len(r["tokens"]) == NEW_TOKENS
    diff = max(abs(a - b) for a, b in zip(r["logprobs"], reference["logprobs"]))
    assert len(r["logprobs"]) == len(reference["logprobs"]) and diff < 1e-4, (diff, why)
    assert r["bytes_moved"] == KV_BYTES, why  # the decode ranks moved exactly the prompt's K/V heads, once
    assert sorted(e["nbytes"] for e in r["per_rank"]) == [KV_BYTES // d_tp] * d_tp, why  # each its own heads
    assert r["prefill_released"] == ["done"], why  # every prefill rank released its blocks after the reads
    r["logprobs_max_abs_diff"] = diff
    return r


def test_equal_tp_and_blocks_match_a_plain_instance(cluster):
    r = run(cluster, "p-tp1-b64", "d-tp1-b64")
    assert r["logprobs_max_abs_diff"] == 0.0  # same kernels, same block size, same KV bytes


def test_block_64_to_32_and_decode_tp2(cluster):
    run(cluster, "p-tp1-b64", "d-tp2-b32")


def test_prefill_tp2_to_decode_tp1_block_32_to_64(cluster):
    run(cluster, "p-tp2-b32", "d-tp1-b64")


def test_equal_tp2(cluster):
    run(cluster, "p-tp2-b32", "d-tp2-b32")


def test_nixl_block_64_to_32_and_decode_tp2(cluster):
    """The same path over NIXL: each sidecar's NIXL agent registers vLLM's own cache memory."""
    run(cluster, "p-tp1-b64-nixl", "d-tp2-b32-nixl")

"""A hybrid model (Mamba2 + attention) through two real vLLM CPU instances, TP 1 -> TP 2 and back.

vLLM keeps a hybrid model's caches with its hybrid allocator: one KV-cache group per layer kind
(attention blocks; one Mamba state page per request), all groups over the same bytes with a
unified, padded page. KVBridgeConnector declares `SupportsHMA`, reads the geometry from the
model's config through transformers, checks it against every tensor vLLM hands it, and moves
both kinds: the attention K/V heads and the recurrent state (conv rows and SSM state, split by
Mamba head and group as vLLM shards them). The prefill side holds back the last prompt token, so
the decode side gets the state after N-1 tokens and computes the last one itself.

The decode instance's greedy tokens must equal a plain TP-1 instance's (a wrong state, a wrong
head, or a skipped token changes them: the reference's tokens vary), and every decode rank must
have loaded through kvbridge.

Tiny random Nemotron-H, pattern "M-*M*" (Mamba, MLP, attention, Mamba, attention), float32,
4 Mamba heads of 32 in 2 groups, 2 KV heads of 32 (`make_tiny_hybrid`).
"""

from __future__ import annotations

import random
import time

import pytest

from kvbridge.proofs.vllm.cluster import Cluster
from kvbridge.proofs.vllm.model import make_tiny_hybrid

pytestmark = pytest.mark.vllm

PROMPT = [random.Random(11).randrange(256) for _ in range(70)]
NEW_TOKENS = 8
INSTANCES = {  # name: (TP, role)
    "p-tp1": (1, "kv_producer"),
    "d-tp2": (2, "kv_consumer"),
    "p-tp2": (2, "kv_producer"),
    "d-tp1": (1, "kv_consumer"),
}
MODEL_SEED = 3
# What the decode ranks must move in all: the attention K/V of the N-1 tokens the prefill side
# computed, and each Mamba layer's state once (conv: kernel-1 rows of heads*head_dim + 2*groups*
# state channels; SSM: heads x head_dim x state), float32.
ATTN_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
MAMBA_LAYERS, M_HEADS, M_HEAD_DIM, M_GROUPS, M_STATE, CONV_KERNEL = 2, 4, 32, 2, 16, 4
STATE_BYTES = 4 * ((CONV_KERNEL - 1) * (M_HEADS * M_HEAD_DIM + 2 * M_GROUPS * M_STATE) + M_HEADS * M_HEAD_DIM * M_STATE)
MOVED_BYTES = ATTN_LAYERS * 2 * (len(PROMPT) - 1) * KV_HEADS * HEAD_DIM * 4 + MAMBA_LAYERS * STATE_BYTES


@pytest.fixture(scope="module")
def cluster(vllm_env, tmp_path_factory):
    model = str(make_tiny_hybrid(tmp_path_factory.mktemp("vllm-hybrid") / "tiny-nemotron-h", seed=MODEL_SEED))
    with Cluster(model, str(vllm_env.python), tmp_path_factory.mktemp("vllm-pd-hybrid")) as c:
        t0 = time.monotonic()
        c.start("reference", 1)  # no connector; block sizes are the hybrid allocator's own
        for name, (tp, role) in INSTANCES.items():
            c.start(name, tp, None, role)
        c.wait_ready(["reference"])
        reference = c.instances["reference"].generate(PROMPT, NEW_TOKENS)
        c.close(["reference"])
        assert len(set(reference["token_ids"])) > 2, reference
        c.wait_ready(list(INSTANCES))
        print(f"\n[vllm P/D hybrid] reference {reference['token_ids']}; ready in {time.monotonic() - t0:.0f} s")
        yield c, reference


def run(cluster, prefill: str, decode: str) -> dict:
    c, reference = cluster
    r = c.pd(prefill, decode, PROMPT, NEW_TOKENS)
    d_tp = INSTANCES[decode][0]
    why = {k: r.get(k) for k in ("tokens", "ok", "per_rank", "prefill_released", "bytes_moved")}
    why["reference"] = reference["token_ids"]
    assert r["ok"] and len(r["per_rank"]) == d_tp, why
    assert all(e["nbytes"] for e in r["per_rank"]), why  # every decode rank moved its share
    assert r["bytes_moved"] == MOVED_BYTES, why  # N-1 tokens of K/V and each state once, nothing more
    assert r["tokens"] == reference["token_ids"], why
    diff = max(abs(a - b) for a, b in zip(r["logprobs"], reference["logprobs"]))
    assert diff < 1e-3, (diff, why)
    assert r["prefill_released"] == ["done"], why
    return r


def test_hybrid_prefill_tp1_to_decode_tp2(cluster):
    run(cluster, "p-tp1", "d-tp2")


def test_hybrid_prefill_tp2_to_decode_tp1(cluster):
    run(cluster, "p-tp2", "d-tp1")

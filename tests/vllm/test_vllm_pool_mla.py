"""An MLA model (DeepSeek-V2 style latents) through the shared pool, `vllm serve` instances of
different shapes (issue 29 point 3).

vLLM CPU keeps an MLA layer's cache as `[blocks, block, latent]`, every rank the whole latent. X
(TP 1) answers a 300-token prompt and stores its four 64-token pool blocks: one object per block
and layer, written by rank 0 alone. Z (TP 1, other blocks) gets the prompt as 256 external hit
tokens and answers exactly as X does from its own prefix cache. Y (TP 2) gets the same hit, each
of its ranks reading every latent object.

What vLLM CPU 0.32 itself computes bounds what can be compared (measured here, no pool load
involved): its MLA at TP 2 answers differently from TP 1 (from the first or second token on), and
at TP 1 a prompt answered with its first 256 tokens from the prefix cache differs from the same
prompt computed whole. So Z is compared with X's answer from its own prefix cache, the same
latents through the same path, and Y's tokens are not compared (its loaded bytes are, in the
transformers proof's MLA case, `tests/pool/test_pool_proof.py`). vLLM's MLA backend is chosen by
the CPU: AMX_MLA (x86 with AMX tiles) takes blocks of multiples of 32 and keeps prefix caching.
Without AMX, vLLM CPU 0.32 turns prefix caching off for MLA, so no instance could answer from
cached latents to compare with: the test skips there, saying so.
"""

from __future__ import annotations

import time

import pytest
import torch

from pool_fleet import pool_fleet

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_mla
from kvbridge.testing.serving import metric_total, prompt_text, request

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="no AMX tiles on this CPU: vLLM CPU 0.32 then serves MLA with prefix caching off, so no instance answers "
           "from cached latents to compare a pool load with")]
HITS = "vllm:external_prefix_cache_hits_total"
GOT = "vllm:kvbridge_pool_objects_got_total"
LAYERS = 2  # objects per pool block: one latent per layer
X_BLOCK, OTHER_BLOCK = 64, 32  # AMX_MLA takes multiples of 32


@pytest.fixture(scope="module")
def fleet(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-mla")
    model = add_byte_tokenizer(make_tiny_mla(work / "tiny-mla", seed=5, num_layers=LAYERS))
    shapes = (("x", InstanceShape(tp=1, block=X_BLOCK)), ("z", InstanceShape(tp=1, block=OTHER_BLOCK)),
              ("y", InstanceShape(tp=2, block=OTHER_BLOCK)))
    with pool_fleet(vllm_env, work, model, shapes, b"m" * 32, dtype="bfloat16") as members:
        yield members


def _reaches(url: str, name: str, want: float, timeout_s: float = 60.0) -> float:
    """`name` on `url` once it reaches `want` (vLLM sends connector counts at its logging interval)."""
    end = time.monotonic() + timeout_s
    while (got := metric_total(url, name)) < want and time.monotonic() < end:
        time.sleep(0.5)
    return got


def test_mla_latents_are_shared_across_shapes(fleet):
    master, x, z, y = fleet
    keys = lambda: metric_total(master.metrics_url, "master_key_count")  # noqa: E731
    # Fresh prompts until X stored one (a store is dropped while X's breaker is open, e.g. after
    # its first client start): 4 pool blocks of 64 tokens, one latent object per layer each.
    end, seed = time.monotonic() + 600, 51
    while True:
        assert time.monotonic() < end, "X never stored a prompt"
        text, seed = prompt_text(seed, 300), seed + 1000
        before = keys()
        assert request(x.url, text, 8).ok
        want = before + 4 * LAYERS
        settle = time.monotonic() + 60
        while keys() < want and time.monotonic() < settle:
            time.sleep(0.5)
        if keys() >= want:
            break
    assert keys() == want, "X stored other than one latent object per pool block and layer (rank 0 alone)"
    reference = request(x.url, text, 8)  # X from its own prefix cache: the latents Z will load
    assert reference.ok, reference.error
    hits = metric_total(z.url, HITS)
    got = request(z.url, text, 8)
    assert got.ok, got.error
    assert metric_total(z.url, HITS) - hits >= 256, "Z did not load the 256 tokens X stored"
    assert got.token_ids == reference.token_ids
    # Y (TP 2): the same hit, both ranks reading all 8 latent objects.
    hits, objects = metric_total(y.url, HITS), metric_total(y.url, GOT)
    assert request(y.url, text, 8).ok
    assert metric_total(y.url, HITS) - hits >= 256, "Y did not load the 256 tokens X stored"
    assert _reaches(y.url, GOT, objects + 2 * 4 * LAYERS) - objects == 2 * 4 * LAYERS
    for member in (z, y):
        assert metric_total(member.url, "vllm:kvbridge_pool_seal_failures_total") == 0
    # A prompt nobody stored: no hit, and Z computing it agrees with X.
    fresh = prompt_text(52, 200)
    hits = metric_total(z.url, HITS)
    assert request(z.url, fresh, 8).token_ids == request(x.url, fresh, 8).token_ids
    assert metric_total(z.url, HITS) == hits

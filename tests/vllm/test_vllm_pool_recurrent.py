"""A hybrid with recurrent state through the shared pool: LFM2 (short conv and attention) on three
`vllm serve` instances with prefix caching on, so that vLLM keeps the conv state per prefix in its
`align` mode (issue 29 point 3): X (TP 1, block 64), W (TP 2, block 64), Y (TP 2, block 32).

A writer answers a 257-token prompt. vLLM offers the conv state at each block boundary it caches
(`boundary_state_offloads`); the writer stores those ending on a pool block (token 256 among
them) with the attention blocks. Y asks for the same prompt: its lookup needs the attention
group's four blocks and the conv group's checkpoint at 256, and it loads them into its own shape
on vLLM's asynchronous path (`KVBridgePoolConnector` takes it for every model of several groups).
The prompt ends just past the checkpoint on purpose: a short conv's state (its last two inputs)
reaches only the next two positions, so Y's last position, whose logits pick the first token,
reads it directly (measured: with the state left out of the load, Y's first token differs; with a
300-token prompt it did not).

* W -> Y (TP 2, blocks 64 -> 32): Y answers with W's tokens and log-probs, to the bit;
* X -> Y (TP 1 -> 2, each rank loading its half of the 128 conv channels): vLLM CPU's LFM2 itself
  computes TP 1 and TP 2 apart (log-probs up to ~0.1 apart with no pool involved, as in
  `test_vllm_pd_hybrid.py`; the tokens after the first drift apart as the two compute on), so
  Y's first token, the one the loaded state decides, must be X's and its log-prob within that
  tolerance. The byte-exact TP 1 -> 2 move of vLLM's pages is `test_vllm_layout.py`'s.
"""

from __future__ import annotations

import pytest

from pool_fleet import greedy_logprobs, pool_fleet, stored_prompt

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_hybrid
from kvbridge.testing.serving import metric_total

pytestmark = pytest.mark.vllm
HITS = "vllm:external_prefix_cache_hits_total"
GOT = "vllm:kvbridge_pool_objects_got_total"
# Y's objects for 256 tokens: 4 pool blocks x 2 attention layers x 2 KV heads, and the checkpoint's
# 2 conv layers x 2 rows (vLLM's SD conv layout: a component per row) x 32 objects of 4 of the 128
# channels (`pool.objects.state_chunk`), each rank reading the 16 of its 64 channels
OBJECTS = 4 * 2 * 2 + 2 * 2 * 32
TP_TOLERANCE = 0.15  # vLLM CPU's LFM2, TP 1 against TP 2 (test_vllm_pd_hybrid.LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def fleet(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-recurrent")
    model = add_byte_tokenizer(make_tiny_hybrid(work / "tiny-lfm2", kind="lfm2", seed=3))
    shapes = (("x", InstanceShape(tp=1, block=64)), ("w", InstanceShape(tp=2, block=64)),
              ("y", InstanceShape(tp=2, block=32)))
    with pool_fleet(vllm_env, work, model, shapes, b"r" * 32, extra_args=("--enable-prefix-caching",)) as members:
        yield members


def _loaded(y, text: str) -> list[tuple[str, float]]:
    hits, objects = metric_total(y.url, HITS), metric_total(y.url, GOT)
    got = greedy_logprobs(y.url, text)
    assert metric_total(y.url, HITS) - hits >= 256, "Y did not load the 256 tokens both groups can supply"
    assert metric_total(y.url, GOT) - objects == OBJECTS, "Y did not read the attention blocks and the checkpoint"
    assert metric_total(y.url, "vllm:kvbridge_pool_seal_failures_total") == 0
    return got


@pytest.mark.fleet  # CI time (47 s): `make fleet-tests`; CI keeps the TP 1 -> TP 2 resume below
def test_a_conv_state_stored_at_tp2_block64_resumes_exactly_at_block32(fleet):
    master, _, w, y = fleet
    text, reference, _ = stored_prompt(master, w, 61, 257)
    assert _loaded(y, text) == reference


def test_a_conv_state_stored_at_tp1_resumes_split_over_two_ranks(fleet):
    master, x, _, y = fleet
    text, reference, _ = stored_prompt(master, x, 62, 257)
    got = _loaded(y, text)
    assert got[0][0] == reference[0][0], "Y's first token, read from the loaded state, is not X's"
    assert abs(got[0][1] - reference[0][1]) <= TP_TOLERANCE, (got[0], reference[0])

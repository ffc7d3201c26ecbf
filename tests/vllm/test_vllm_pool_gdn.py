"""A gated-delta-net hybrid through the shared pool: a tiny Qwen3-Next (GDN and gated attention,
bfloat16) on two `vllm serve` instances of different TP with prefix caching on (vLLM's `align`
mode), W (TP 2) storing and Y (TP 1) loading (issue 29 point 3).

vLLM CPU sizes the attention block so that a page holds a GDN state: 1,088 tokens here at either TP
(rounded up to a multiple of the `--block-size` given, 64 on both: given 32, TP 1 got 1,056 and
the two could share only a pool block of their least common multiple, 35,904 tokens). So the pool
block is 1,088 tokens and the prompt 1,089: Y's lookup needs the attention group's block and the
GDN group's checkpoint at 1,088, loads all of both (TP 1 reads every object W's two ranks wrote)
and computes one token from the loaded state. vLLM CPU's GDN computes TP 1 and TP 2 apart in
bfloat16 (log-probs a few hundredths apart with no pool involved), so Y's first token must be W's
and its log-prob within that tolerance.

Marked `fleet` (`make fleet-tests`): two bfloat16 instances and 1,089-token prompts are minutes on
the 2-core CI host; `test_vllm_pool_recurrent.py` (LFM2) is the suite's sample of the same path.
"""

from __future__ import annotations

import pytest

from pool_fleet import greedy_logprobs, pool_fleet, stored_prompt

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_hybrid
from kvbridge.testing.serving import metric_total

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]
BLOCK = 1088
HITS = "vllm:external_prefix_cache_hits_total"
GOT = "vllm:kvbridge_pool_objects_got_total"
TP_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def fleet(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-gdn")
    model = add_byte_tokenizer(make_tiny_hybrid(work / "tiny-qwen3-next", kind="qwen3_next", seed=3))
    shapes = (("w", InstanceShape(tp=2, block=64)), ("y", InstanceShape(tp=1, block=64)))
    with pool_fleet(vllm_env, work, model, shapes, b"g" * 32, dtype="bfloat16", block_tokens=BLOCK,
                    max_model_len=4096, extra_args=("--enable-prefix-caching",)) as members:
        yield members


def test_a_gated_delta_net_state_stored_at_tp2_resumes_at_tp1(fleet):
    master, w, y = fleet
    text, reference, stored = stored_prompt(master, w, 71, BLOCK + 1)
    hits, objects = metric_total(y.url, HITS), metric_total(y.url, GOT)
    got = greedy_logprobs(y.url, text)
    assert metric_total(y.url, HITS) - hits == BLOCK, "Y did not load the block both groups can supply"
    assert metric_total(y.url, GOT) - objects == stored, "Y (TP 1) did not read every object W's ranks stored"
    assert metric_total(y.url, "vllm:kvbridge_pool_seal_failures_total") == 0
    assert got[0][0] == reference[0][0], "Y's first token, computed from the loaded state, is not W's"
    assert abs(got[0][1] - reference[0][1]) <= TP_TOLERANCE, (got[0], reference[0])

"""The pool scheduler asks the store once per request, whatever vLLM asks it
(`vllm_pool_lookup_probe.py` drives a real `PoolScheduler`, master and vLLM `Request`s in .venv-vllm):

* a request vLLM could not schedule is asked about again at every step: it gets the first
  answer again (less its local prefix-cache hit), hit or miss, with no new round trip and no new
  count; a request that ended is looked up afresh;
* a request for its prompt's log-probs (vLLM reads no cache for it) is never looked up.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def seen(run_probe) -> dict:
    return run_probe("vllm_pool_lookup_probe.py")


def test_a_waiting_request_gets_its_first_answer_again_without_another_lookup(seen):
    assert seen["stored"] == [[128, False]] * 6  # two whole pool blocks of 64 tokens in the store
    assert seen["stored_local"] == [[64, False], [0, False]]  # less what its local prefix-cache hit holds now
    assert seen["missed"] == [[0, False]] * 6
    assert seen["counts"]["lookups"] == 2 and seen["counts"]["hit_tokens"] == 128


def test_a_request_that_ended_is_looked_up_afresh(seen):
    assert seen["after_finished"] == [[128, False]]
    assert seen["counts_after"]["lookups"] == 1 and seen["counts_after"]["hit_tokens"] == 128


def test_a_request_for_its_prompts_log_probs_is_never_looked_up(seen):
    assert seen["prompt_logprobs"] == [[0, False]] * 3
    assert seen["counts"]["queried_tokens"] == 2 * 256  # the two requests above, four blocks each

"""The shared pool's keys of real vLLM 0.32 requests separate exactly what vLLM's prefix cache separates.

`vllm_pool_identity_probe.py` runs in .venv-vllm, builds real `vllm.v1.request.Request`s (cache
salt, LoRA adapters, multimodal items, prompt embeds, and plain requests with other ids and
sampling) and prints, per case, `request_pool_keys` and vLLM's own block hashes at the same
block size (16 tokens, 64-token requests: four blocks). Here we check:

* a plain request keeps kvbridge's plain chain (`chained_block_hashes`, group 0): extras change
  nothing for requests that have none, so pools filled before stay valid for them;
* each extra separates what it should, from the block it applies to on (the chain carries it);
* nothing else (request id, sampling, priority, arrival, client) changes a key;
* against vLLM: for every pair of cases and every block, the pool keys are equal exactly when
  vLLM's block hashes are, i.e. the pool serves a block only where vLLM itself would reuse it.
"""

from __future__ import annotations

from itertools import combinations

import pytest

from kvbridge.offload.keys import chained_block_hashes, group_keys

pytestmark = pytest.mark.vllm

BT = 16
BLOCKS = 4


@pytest.fixture(scope="module")
def cases(run_probe) -> dict[str, dict]:
    out = run_probe("vllm_pool_identity_probe.py", timeout_s=600)
    assert out["vllm_version"].startswith("0.32"), out["vllm_version"]
    assert out["block_tokens"] == BT
    return out["cases"]


def _pattern(cases: dict, a: str, b: str) -> list[bool]:
    """Per block: are the pool keys of cases a and b equal?"""
    return [x == y for x, y in zip(cases[a]["pool"], cases[b]["pool"], strict=True)]


def _same_tokens(cases: dict, *names: str) -> None:
    assert len({tuple(cases[n]["tokens"]) for n in names}) == 1, names


def test_every_case_has_all_blocks(cases):
    for name, c in cases.items():
        assert len(c["tokens"]) == BT * BLOCKS, name
        assert len(c["pool"]) == len(c["vllm"]) == BLOCKS, name


def test_plain_requests_keep_the_plain_chain(cases):
    for name in ("plain", "plain_again", "mm_none", "zeros_no_embeds"):
        plain = [k.hex() for k in group_keys(chained_block_hashes(cases[name]["tokens"], BT), 0)]
        assert cases[name]["pool"] == plain, name
    _same_tokens(cases, "plain", "plain_again")
    assert cases["plain"]["pool"] == cases["plain_again"]["pool"]


def test_only_tokens_and_extras_count(cases):
    """Another request id, sampling params (with kv_transfer_params), priority, arrival, client: same keys."""
    _same_tokens(cases, "plain", "plain_other_meta")
    assert cases["plain_other_meta"]["pool"] == cases["plain"]["pool"]


def test_cache_salt_changes_the_whole_chain(cases):
    _same_tokens(cases, "plain", "salt_a", "salt_a_again", "salt_b")
    for a, b in combinations(("plain", "salt_a", "salt_b"), 2):
        assert _pattern(cases, a, b) == [False] * BLOCKS, (a, b)
    assert cases["salt_a"]["pool"] == cases["salt_a_again"]["pool"]


def test_lora_adapter_name_and_path(cases):
    _same_tokens(cases, "plain", "lora_a", "lora_a_again", "lora_b", "lora_a_moved")
    for a, b in combinations(("plain", "lora_a", "lora_b", "lora_a_moved"), 2):
        assert _pattern(cases, a, b) == [False] * BLOCKS, (a, b)
    assert cases["lora_a"]["pool"] == cases["lora_a_again"]["pool"]


def test_multimodal_items_from_their_first_block(cases):
    """The image spans tokens 20..35 (blocks 1, 2): block 0 is shared, the rest differs per item and offset."""
    _same_tokens(cases, "mm_none", "mm_a", "mm_a_again", "mm_b", "mm_a_shifted")
    for a, b in combinations(("mm_none", "mm_a", "mm_b", "mm_a_shifted"), 2):
        assert _pattern(cases, a, b) == [True, False, False, False], (a, b)
    assert cases["mm_a"]["pool"] == cases["mm_a_again"]["pool"]


def test_prompt_embeds_from_the_block_that_differs(cases):
    """Row 40 (block 2) differs: blocks 0, 1 shared; equal embeds share all; embeds never match bare 0 ids."""
    _same_tokens(cases, "embeds", "embeds_again", "embeds_row40", "zeros_no_embeds")
    assert cases["embeds"]["tokens"] == [0] * BT * BLOCKS  # vLLM: an embeds prompt has no token ids
    assert _pattern(cases, "embeds", "embeds_row40") == [True, True, False, False]
    assert cases["embeds"]["pool"] == cases["embeds_again"]["pool"]
    for name in ("embeds", "embeds_row40"):
        assert _pattern(cases, name, "zeros_no_embeds") == [False] * BLOCKS, name


def test_pool_keys_separate_exactly_what_vllm_separates(cases):
    mismatches = []
    for a, b in combinations(sorted(cases), 2):
        for i in range(BLOCKS):
            pool_eq = cases[a]["pool"][i] == cases[b]["pool"][i]
            vllm_eq = cases[a]["vllm"][i] == cases[b]["vllm"][i]
            if pool_eq != vllm_eq:
                mismatches.append(f"{a} vs {b} block {i}: pool equal {pool_eq}, vLLM equal {vllm_eq}")
    assert not mismatches, "\n".join(mismatches)

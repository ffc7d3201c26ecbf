"""A model of full and sliding-window attention through the shared pool, two `vllm serve`
instances of different shapes (X: TP 1, block 64; Y: TP 2, block 32), vLLM's hybrid allocator
keeping one KV-cache group of each kind (issue 29 point 3).

The model's odd layers attend to their last 64 tokens. X answers a 300-token prompt and, when it
finishes, stores per group the 64-token pool blocks still on its device: all four of the full
group, and of the sliding group only those its window still holds (the others are vLLM's null
block by then). Y then asks for the same prompt: its lookup needs the full group's whole prefix
and the sliding group's last window before the hit point, loads 256 tokens of both groups into
its own shape, and answers as X, which computed the prompt itself, did. A writer stores a
sliding pool block only while its window holds all of it (Y, of 32-token blocks, leaves one half
gone at its end), and a long decode on X stores the sliding group's blocks as they fill, so Y
continues from the middle of the reply.
"""

from __future__ import annotations

import time

import pytest

from pool_fleet import pool_fleet

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import metric_total, prompt_text, request, tokenize

pytestmark = pytest.mark.vllm
WINDOW = 64
HITS = "vllm:external_prefix_cache_hits_total"
HEADS = 2  # objects per pool block, layer and group: one per KV head


@pytest.fixture(scope="module")
def fleet(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-sliding")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny-sliding", seed=7, sliding_window=WINDOW))
    with pool_fleet(vllm_env, work, model, (("x", InstanceShape(tp=1, block=64)), ("y", InstanceShape(tp=2, block=32))),
                    b"k" * 32) as members:
        yield members


def test_sliding_and_full_groups_are_shared_across_shapes(fleet):
    master, x, y = fleet
    keys = lambda: metric_total(master.metrics_url, "master_key_count")  # noqa: E731
    # Full group: 4 blocks. Sliding group: at X's finish (307 tokens computed) its window holds
    # tokens 244.. only, so block 3 (192-255) is the one left to store. Fresh prompts until X
    # stored one (a store is dropped while X's breaker is open, e.g. after its first client start).
    end, seed = time.monotonic() + 600, 41
    while True:
        assert time.monotonic() < end, "X never stored a prompt"
        text, seed = prompt_text(seed, 300), seed + 1000
        before = keys()
        reference = request(x.url, text, 8)
        assert reference.ok, reference.error
        want = before + (4 + 1) * HEADS
        settle = time.monotonic() + 60
        while keys() < want and time.monotonic() < settle:
            time.sleep(0.5)
        if keys() >= want:
            break
    time.sleep(2)
    assert keys() == want, "a sliding block that had left the window was stored (or a full one missed)"
    hits = metric_total(y.url, HITS)
    got = request(y.url, text, 8)
    assert got.ok, got.error
    assert metric_total(y.url, HITS) - hits >= 256, "Y did not load the 256 tokens both groups can supply"
    assert got.token_ids == reference.token_ids
    assert metric_total(y.url, "vllm:kvbridge_pool_seal_failures_total") == 0
    # A prompt nobody stored: no hit, and Y computing it agrees with X.
    fresh = prompt_text(42, 200)
    hits = metric_total(y.url, HITS)
    assert request(y.url, fresh, 8).token_ids == request(x.url, fresh, 8).token_ids
    assert metric_total(y.url, HITS) == hits


def _settled(count, quiet_s: float = 3.0, timeout_s: float = 120.0) -> float:
    """`count()` once it has not changed for `quiet_s` (stores land on the ranks' threads after
    the answers that caused them)."""
    end = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < end, "the store's key count never settled"
        time.sleep(0.5)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_a_pool_block_the_window_left_in_part_is_never_stored(fleet):
    """Y's engine blocks are 32 tokens, half a pool block. Y answers a 300-token prompt with 8
    tokens, so at its end (307 tokens computed) its window has freed tokens 192-223, the first
    half of pool block 3 (192-255), and kept the second. Stored, block 3 would hold nothing where
    the freed half was, and a reader whose hit ends at 256 needs tokens 193-255 of it. So Y stores
    the full group's four blocks and no sliding block, and X, asking for the same prompt, gets no
    hit from it and answers as Y computed."""
    master, x, y = fleet
    keys = lambda: metric_total(master.metrics_url, "master_key_count")  # noqa: E731
    text = prompt_text(44, 300)
    before = _settled(keys)  # the stores of the test before (X's and Y's answers) have landed
    reference = request(y.url, text, 8)
    assert reference.ok, reference.error
    settle = time.monotonic() + 60
    while keys() < before + 4 * HEADS and time.monotonic() < settle:
        time.sleep(0.5)
    assert _settled(keys) == before + 4 * HEADS, "Y stored a sliding pool block its window had left in part"
    got = request(x.url, text, 8)
    assert got.ok, got.error
    assert got.token_ids == reference.token_ids


def test_a_long_decode_stores_the_window_while_it_holds_each_block(fleet):
    """X decodes 500 tokens after a 70-token prompt. At its end its window holds only the last
    block, so a block from the middle of the reply can be in the pool only if X stored it while
    the window still held it, during the decode. Y continues from the prompt and the reply's
    first 300 tokens: both groups supply the first five pool blocks (the sliding group its block
    4, tokens 256-319), Y loads them into its own shape and answers as X does."""
    _, x, y = fleet
    text = prompt_text(43, 70)
    answer = request(x.url, text, 500, timeout=600)
    assert answer.ok, answer.error
    prompt = tokenize(x.url, text) + answer.token_ids[:300]
    time.sleep(3)  # X's last stores
    reference = request(x.url, prompt, 8)
    assert reference.ok, reference.error
    hits = metric_total(y.url, HITS)
    got = request(y.url, prompt, 8)
    assert got.ok, got.error
    assert metric_total(y.url, HITS) - hits >= 5 * 64, "Y did not load the five blocks X stored while decoding"
    assert got.token_ids == reference.token_ids
    assert metric_total(y.url, "vllm:kvbridge_pool_seal_failures_total") == 0

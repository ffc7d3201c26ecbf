"""The per-group hit rules (vLLM's lookup unit tests) and their combination for a request."""

from __future__ import annotations

import pytest

from kvbridge.offload.lookup import prefix_hits, request_hits, window_hits


class Lookup:
    """A per-key lookup: listed keys hit, keys in `retry` answer None, the rest miss; counts calls."""

    def __init__(self, hits=(), retry=()):
        self.hits, self.retry, self.calls = set(hits), set(retry), 0

    def __call__(self, key):
        self.calls += 1
        return None if key in self.retry else key in self.hits


@pytest.mark.parametrize("keys, hits, retry, expected", [
    ([1, 2], [1, 2], [], 2),
    ([1, 2], [], [], 0),
    ([1, 2, 3], [1, 2], [], 2),
    ([1, 2], [2], [], 0),
    ([], [], [], 0),
    ([1, 2], [2], [1], None),
    ([1, 2], [1], [2], None),
])
def test_prefix_rule(keys, hits, retry, expected):
    assert prefix_hits(keys, Lookup(hits, retry)) == expected


def test_prefix_rule_stops_at_the_first_miss():
    look = Lookup(hits=[3], retry=[1])
    assert prefix_hits([1, 2, 3], look) is None and look.calls == 2


@pytest.mark.parametrize("keys, hits, retry, window, expected", [
    ([1, 2], [1, 2], [], 2, 2),
    ([1, 2, 3], [], [], 1, 0),
    ([1, 2, 3], [2, 3], [], 2, 3),
    ([1, 2, 3, 4], [2, 3], [], 2, 3),
    ([1, 2, 3], [1, 2], [], 3, 2),  # no full window: the hits that reach index 0
    ([1, 2, 3], [2, 3], [], 1, 3),
    ([1, 2, 3, 0, 4], [2, 3, 4], [], 2, 3),
    ([1, 2, 3, 4, 5], [1, 2, 4, 5], [], 2, 5),  # the rightmost window
    ([2, 1, 3, 4, 5], [2, 3, 4, 5], [], 4, 1),
    ([], [], [], 1, 0),
    ([1, 2], [1], [2], 2, None),
    ([1, 2, 3, 4], [1, 2, 4], [3], 2, None),
])
def test_window_rule(keys, hits, retry, window, expected):
    assert window_hits(keys, Lookup(hits, retry), window) == expected


def test_request_hits_full_and_sliding_groups():
    # Two groups, 4-token offloaded blocks, a 13-token request (keys for 3 full blocks).
    full, slide = [("f", i) for i in range(3)], [("s", i) for i in range(3)]
    # Everything stored: the sliding window (8 tokens = 2 blocks) needs blocks 1 and 2; max_hit = 13 - 1 -> 12.
    look = Lookup(hits=full + slide)
    assert request_hits([full, slide], [None, 8], 4, 13, look) == 12
    # Only the sliding group's first two blocks: the window rule gives 2 blocks, which shrinks the full group to 8.
    assert request_hits([full, slide], [None, 8], 4, 13, Lookup(hits=full + slide[:2])) == 8
    # The full group hits only block 0: one offloaded block (4 tokens) is still worth loading.
    assert request_hits([full, slide], [None, 8], 4, 13, Lookup(hits=full[:1] + slide)) == 4
    # Nothing new beyond what is computed: no load.
    assert request_hits([full, slide], [None, 8], 4, 13, Lookup(hits=full[:1] + slide), num_computed_tokens=4) == 0
    # A retry anywhere defers the whole request.
    assert request_hits([full, slide], [None, 8], 4, 13, Lookup(hits=full + slide[:2], retry=slide[2:])) is None
    # A full-attention-only model may hit every full block.
    assert request_hits([full], [None], 4, 12, Lookup(hits=full)) == 12


def test_groups_with_different_block_sizes():
    """vLLM's test_two_groups_different_block_sizes shape: groups of 12- and 16-token blocks,
    everything offloaded up to 96 tokens. A 48-token prompt hits all 48 (4 and 3 blocks); an
    85-token prompt with 48 computed hits 80: group 1 covers 5 blocks of 16, group 0 then loads
    its blocks up to token 80 (blocks 4..6)."""
    g0 = [("a", i) for i in range(8)]
    g1 = [("b", i) for i in range(6)]
    look = Lookup(hits=g0 + g1)
    assert request_hits([g0[:4], g1[:3]], [None, None], [12, 16], 48, look) == 48
    assert request_hits([g0[:7], g1[:5]], [None, None], [12, 16], 85, look, num_computed_tokens=48) == 80
    # one size for both: group 1's 5 keys read as 12-token blocks cover only 60 tokens
    assert request_hits([g0[:7], g1[:5]], [None, None], 12, 85, look, num_computed_tokens=48) == 60
    with pytest.raises(ValueError, match="one block size >= 1 per group"):
        request_hits([g0, g1], [None, None], [12], 48, look)


def test_a_recurrent_group_needs_only_the_checkpoint_at_the_hit():
    """One token's window (`group_windows`): the hit ends at the last stored checkpoint that the
    attention groups also reach; checkpoints before it are not needed."""
    from kvbridge.core.spec import Component, LayerSpec, ModelSpec
    from kvbridge.offload.lookup import group_windows

    mamba = LayerSpec("recurrent", state=(Component("conv", 2, 3), Component("ssm", 2, 4)), recurrent_type="mamba2")
    spec = ModelSpec((LayerSpec("full", 2, 4, 4), mamba, LayerSpec("sliding", 2, 4, 4, 8)), "bfloat16")
    assert group_windows(spec) == [None, 1, 8]
    full, state = [("f", i) for i in range(4)], [("r", i) for i in range(4)]
    # Checkpoints after blocks 1 and 3 (tokens 8 and 16 of 4-token blocks); a 17-token prompt: the last one.
    assert request_hits([full, state], [None, 1], 4, 17, Lookup(hits=full + [state[1], state[3]])) == 16
    # Block 3's full-attention block is missing: back to the checkpoint at 8.
    assert request_hits([full, state], [None, 1], 4, 17, Lookup(hits=full[:3] + [state[1], state[3]])) == 8
    # No checkpoint at all: no hit, however much attention is stored.
    assert request_hits([full, state], [None, 1], 4, 17, Lookup(hits=full)) == 0

"""`Request` takes what a user naturally writes, and refuses what is not block ids, in one line."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge import EngineLayout, InvalidRequest, ModelSpec, Request, plan_request


def test_flat_lists_are_the_one_group_of_a_single_group_model() -> None:
    spec = ModelSpec.uniform(2, 4, 8)
    layout = EngineLayout(tp_size=1, block_size=16, num_blocks=8)
    flat = Request([0, 1], [2, 3], 20)
    assert flat == Request(((0, 1),), ((2, 3),), 20)
    assert int(plan_request(spec, layout, layout, flat).length.sum()) == 2 * 2 * 20 * 4 * 8 * 2  # layers, K/V, tokens, heads, dim, bf16


def test_lists_numpy_ids_and_groups_normalise_to_tuples() -> None:
    req = Request([[1, 2], [3]], np.array([4, 5]), 16)
    assert req.src_block_ids == ((1, 2), (3,)) and req.dst_block_ids == ((4, 5),)
    assert all(type(i) is int for g in req.src_block_ids + req.dst_block_ids for i in g)


@pytest.mark.parametrize("ids", [[1, "a"], "abc", [[1], [True]], 5, [[1], "x"], [1.5]])
def test_non_integer_block_ids_refused(ids) -> None:
    with pytest.raises(InvalidRequest) as info:
        Request(ids, [1], 3)
    assert "\n" not in str(info.value) and "src_block_ids" in str(info.value)


@pytest.mark.parametrize("field", ["num_tokens", "num_cached_tokens"])
@pytest.mark.parametrize("value", [True, 1.0, "3", None])
def test_token_counts_must_be_integers(field, value) -> None:
    kwargs = {"num_tokens": 3, "num_cached_tokens": 0, field: value}
    with pytest.raises(InvalidRequest, match=field):
        Request([1], [1], **kwargs)

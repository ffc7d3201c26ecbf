"""A request's load is told to vLLM once: a repeat is dropped, memory stays bounded."""

import pytest

from kvbridge.connector.once import OnceEach


def test_each_key_passes_once_and_the_oldest_are_forgotten_past_the_limit():
    once = OnceEach(limit=3)
    assert [once.first(k) for k in ("a", "b", "a", "c", "b")] == [True, True, False, True, False]
    assert once.first("d") and len(once) == 3  # "a" forgotten
    assert once.first("a") and not once.first("d")
    with pytest.raises(ValueError):
        OnceEach(limit=0)

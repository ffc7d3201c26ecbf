"""Fixtures shared by test directories."""

from __future__ import annotations

import pytest

from kvbridge.testing.netns import Unavailable, veth_pair


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair: ((ns a, address a), (ns b, address b));
    skipped, with the reason, where they cannot be made (no root, no iproute2)."""
    try:
        with veth_pair() as pair:
            yield pair
    except Unavailable as e:
        pytest.skip(str(e))

"""Fixtures for the transport tests: a child process per backend (real processes, real engines on
loopback), skipped only when the backend's package cannot be imported here (with the exact error)."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.testing.peer import AgentHost, PeerProcess

BACKENDS = ("shm", "nixl", "mooncake")


def import_error(backend: str) -> str | None:
    try:
        if backend == "nixl":
            from kvbridge.transport.nixl import import_nixl
            import_nixl()
        elif backend == "mooncake":
            from kvbridge.transport.mooncake import import_mooncake
            import_mooncake()
    except ImportError as e:
        return str(e)
    return None


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    err = import_error(request.param)
    if err:
        pytest.skip(f"{request.param} cannot be imported here: {err}")
    return request.param


@pytest.fixture(scope="module")
def child(backend):
    """An agent host in a spawned child process, shared by a module's tests of one backend."""
    p = PeerProcess()
    yield p
    p.close()


@pytest.fixture
def here():
    h = AgentHost()
    yield h
    h.close_all()


_names = itertools.count()


@pytest.fixture
def names():
    """Unique agent names (agents in the shared child outlive a test)."""
    return lambda prefix: f"{prefix}-{next(_names)}"

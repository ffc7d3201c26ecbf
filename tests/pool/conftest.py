"""A real `mooncake_master` per test module (its objects are the pool under test)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mooncake.store", reason="the pool needs the Mooncake wheel (installed by `make test`)")
os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's per-call INFO lines would drown the test log

from kvbridge.pool.master import MooncakeMaster  # noqa: E402
from kvbridge.pool.store import StoreClient, StoreConfig  # noqa: E402
from pool_harness import CLIENT_TTL_S  # noqa: E402


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    # A client that dies (the killed-writer test) keeps its segment mounted, and puts into it
    # fail, until the master's client TTL (10 s by default) passes: 2 s here.
    m = MooncakeMaster.start(tmp_path_factory.mktemp("pool") / "master.log", extra=(f"-client_ttl={CLIENT_TTL_S}",))
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(master):
    c = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=0))
    yield c
    c.close()


@pytest.fixture(scope="module")
def lender(master):
    """A client that lends 64 MiB to the pool, shared by the module's engines (a close costs ~1 s)."""
    c = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=64 << 20))
    yield c
    c.close()

"""The stranger on the fleet's network (issue 42, point 2): with the master's address and a plain
Mooncake client, what can they list and read? Not the names from another host (the master's HTTP
admin server listens on loopback only), and, even where they have the names (a user of the
master's own host), no KV: every payload is encrypted under its tenant's key, and a tenant's
key opens no other tenant's objects."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.seal import SEAL_BYTES, open_into, tenant_key
from kvbridge.pool.store import reachable
from pool_harness import Engine, block_keys, config, expected_load, same

FLEET_HOST = "127.0.0.2"
"""The fleet's interface in this test: another address than the loopback one the admin server keeps to."""


@pytest.fixture(scope="module")
def fleet_master(tmp_path_factory):
    m = MooncakeMaster.start(tmp_path_factory.mktemp("outsider") / "master.log", host=FLEET_HOST)
    yield m
    m.stop()


def _plain_client(address: str):
    """What an outsider runs: Mooncake's own client, no kvbridge, no secret."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    return store


def test_an_outsider_lists_nothing_from_the_network_and_reads_no_kv(fleet_master):
    assert fleet_master.accepts()
    assert not reachable(f"{FLEET_HOST}:{fleet_master.metrics_port}"), "the admin server answers on the fleet's interface"
    src = Engine(1, 8, seed=7).attach(fleet_master, config(staging=8))
    dst = Engine(2, 4, seed=8).attach(fleet_master, config(staging=8))
    other = Engine(2, 4, seed=8).attach(fleet_master, config(staging=8))
    try:
        keys = block_keys(3, "outsider")
        for t in src.tiers:
            assert t.store(src.job(0, 3), keys, tenant=b"tenant-a").ok
        # A user of the master's own host lists every name on loopback, and gets every object.
        with urllib.request.urlopen(f"{fleet_master.metrics_url}/get_all_keys", timeout=10) as r:
            listed = [n for n in r.read().decode().split() if n.startswith("kvb")]
        layout = src.tiers[0].layout
        names = {n for k in keys for n in layout.keys(k)}
        assert names <= set(listed)
        plain = _plain_client(fleet_master.address)
        try:
            objects = {n: np.frombuffer(plain.get(n), dtype=np.uint8) for n in names}
        finally:
            plain.close()
        tkey = tenant_key(config().secret, b"tenant-a")
        for name, stored in objects.items():
            assert stored.nbytes > SEAL_BYTES
            payload = np.empty(stored.nbytes - SEAL_BYTES, dtype=np.uint8)
            assert open_into(tkey, name, stored, [payload]) == ""  # the tenant's key opens it ...
            same_bytes = float(np.mean(stored[:payload.nbytes] == payload))
            assert same_bytes < 0.05, f"{name}: {same_bytes:.0%} of the stored payload is the KV in clear"
            for key in (tenant_key(config().secret), tenant_key(config().secret, b"tenant-b"), tenant_key(b"")):
                assert open_into(key, name, stored, [np.empty_like(payload)])  # ... no other key does
        # The tenant's own load is exact; another tenant's load of the same names (never asked for
        # through vLLM: the salt is in the names too) uses nothing and leaves the device untouched.
        want = expected_load(src, src.job(0, 3), dst.caches, dst.layout, dst.job(0, 3))
        assert all(t.load(keys, dst.job(0, 3), tenant=b"tenant-a").ok for t in dst.tiers)
        assert same(dst.caches, want)
        before = other.clone()
        assert not any(t.load(keys, other.job(0, 3), tenant=b"tenant-b").ok for t in other.tiers)
        assert same(other.caches, before)
    finally:
        src.close()
        dst.close()
        other.close()

"""The pool's host tier (issue 42 point 1): engines of one host share one shared-memory arena per
group; what one process stores another of any shape loads exactly, straight out of shared memory;
what the arena does not hold comes from Mooncake and is kept on the host for its next reader;
nothing torn, forged or foreign is ever copied into a device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pool_harness import SPEC, Engine, block_keys, config, expected_load, same

from kvbridge.errors import ConfigError
from kvbridge.pool.host_arena import HostArena
from kvbridge.pool.tier import PoolConfig, PoolIndex, PoolTier

HERE = Path(__file__).resolve().parent
SECRET = b"fleet-secret-0123456789"


def host_config(host_dir: Path, secret: bytes = SECRET, host_bytes: int = 8 << 20) -> PoolConfig:
    return PoolConfig(model_id="pool-test", block_tokens=8, staging_blocks=4, secret=secret, host_bytes=host_bytes,
                      host_dir=str(host_dir))


def host_only(eng: Engine, cfg: PoolConfig) -> Engine:
    eng.tiers = [PoolTier(c, None, cfg) for c in eng.caches]
    return eng


def side(host_dir: Path, mode: str, salt: str, n: int, seed: int = 1) -> dict:
    res = subprocess.run([sys.executable, str(HERE / "host_side.py"), str(host_dir), mode, salt, str(n), str(seed)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_what_another_process_stores_in_the_host_tier_a_reader_of_another_shape_loads_exactly(tmp_path):
    n = 6
    wrote = side(tmp_path, "store", "shared", n)  # TP 2, block 4: another process
    assert wrote["done"] == [True] * n and wrote["host_objects_put"] == n * 2 * 4
    src = Engine(2, 4, seed=1)  # the writer's bytes, made again here to compute what a load must give
    dst = host_only(Engine(1, 8, seed=2, kv_order="HND"), host_config(tmp_path))
    try:
        keys = block_keys(n, "shared")
        index = PoolIndex(SPEC, None, host_config(tmp_path))
        assert index.hits(keys + block_keys(2, "never")) == [True] * n + [False] * 2
        index.close()
        expected = expected_load(src, src.job(3, n), dst.caches, dst.layout, dst.job(20, n))
        assert all(dst.load(keys, dst.job(20, n)))
        assert same(dst.caches, expected)  # every byte where it belongs, nothing else changed
        assert sum(t.stats["host_objects_got"] for t in dst.tiers) == n * 2 * 4
    finally:
        dst.close()


def test_a_block_not_held_whole_is_no_hit_and_its_load_leaves_the_device_untouched(tmp_path):
    cfg = host_config(tmp_path)
    src = host_only(Engine(2, 4, seed=1), cfg)
    dst = host_only(Engine(1, 8, seed=2), cfg)
    try:
        keys = block_keys(3, "partial")
        src.tiers[0].store(src.job(3, 3), keys)  # rank 0 only: half of every block's heads
        assert PoolIndex(SPEC, None, cfg).hits(keys) == [False] * 3
        before = dst.clone()
        res = dst.tiers[0].load(keys, dst.job(20, 3))
        assert not any(res.done) and "not in the host tier" in res.reasons[0]
        assert same(dst.caches, before)
    finally:
        src.close()
        dst.close()


def _arena_file(host_dir: Path) -> Path:
    files = [p for p in host_dir.iterdir() if p.name.startswith("arena-")]
    assert len(files) == 1, files
    return files[0]


def test_a_damaged_object_in_the_arena_is_refused_forgotten_and_stored_again(tmp_path):
    cfg = host_config(tmp_path)
    src = host_only(Engine(2, 4, seed=1), cfg)
    dst = host_only(Engine(1, 8, seed=2), cfg)
    try:
        keys = block_keys(2, "damage")
        assert all(src.store(src.job(3, 2), keys))
        arena = src.tiers[0].host.arenas[0]
        assert all(t.host.arenas[0] is arena for t in src.tiers + dst.tiers)  # one map per process
        slot = arena.present([bytes.fromhex(src.tiers[0].layout.block(keys[1]))], [[0]])[0][0]
        with open(_arena_file(tmp_path), "r+b") as f:  # anyone with the file: one byte of object 0 of block 1
            at = arena._data + slot * arena.slot_bytes + 5
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 1]))
        before = dst.clone()
        assert dst.load(keys, dst.job(20, 2)) == [False, False]  # one chunk: refused whole
        assert same(dst.caches, before)  # the device untouched
        assert PoolIndex(SPEC, None, cfg).hits(keys) == [True, False]  # the bad object is forgotten
        assert all(src.store(src.job(3, 2), keys))  # the next writer stores it again
        expected = expected_load(src, src.job(3, 2), dst.caches, dst.layout, dst.job(20, 2))
        assert all(dst.load(keys, dst.job(20, 2)))
        assert same(dst.caches, expected)
    finally:
        src.close()
        dst.close()


def test_a_full_arena_evicts_the_least_recently_used_block_whole(tmp_path):
    per_block = 2 * 4 * (8 * 8 * 2 * 2 + 64)  # layers x heads x (tokens x dims x K,V x bf16 + seal)
    cfg = host_config(tmp_path, host_bytes=max(1 << 20, 0))
    arena_blocks = (1 << 20) // per_block
    src = host_only(Engine(2, 4, seed=1, num_blocks=4 * (arena_blocks + 8)), cfg)
    try:
        keys = block_keys(arena_blocks + 2, "evict")
        for at in range(0, len(keys), 4):  # the ranks chunk by chunk, as an engine's ranks store side by side
            part = keys[at:at + 4]
            assert all(src.store(src.job(3 + at * src.factor, len(part)), part))
        hits = PoolIndex(SPEC, None, cfg).hits(keys)
        assert hits[:2] == [False, False] and all(hits[2:])  # the two oldest went, whole
    finally:
        src.close()


def test_fleets_of_other_secrets_share_no_arena(tmp_path):
    a = host_only(Engine(2, 4, seed=1), host_config(tmp_path))
    b_cfg = host_config(tmp_path, secret=b"another-secret-987654321")
    try:
        keys = block_keys(2, "secret")
        assert all(a.store(a.job(3, 2), keys))
        assert PoolIndex(SPEC, None, b_cfg).hits(keys) == [False, False]
        assert len([p for p in tmp_path.iterdir() if p.name.startswith("arena-")]) == 2
    finally:
        a.close()


def test_two_processes_storing_one_prefix_at_once_leave_whole_valid_blocks(tmp_path):
    n = 8
    procs = [subprocess.Popen([sys.executable, str(HERE / "host_side.py"), str(tmp_path), "store", "race", str(n)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    assert all(all(o["done"]) for o in outs)
    assert sum(o["host_objects_put"] for o in outs) == n * 2 * 4  # each object written once
    loaded = side(tmp_path, "load", "race", n)
    assert loaded["done"] == [True] * n and loaded["host_objects_got"] == n * 2 * 4


def test_an_arena_of_another_geometry_under_the_name_is_refused_in_one_line(tmp_path):
    path = tmp_path / "arena-x"
    HostArena(str(path), [100, 200], 1 << 20).close()
    with pytest.raises(ConfigError, match="not a host arena of 3 objects"):
        HostArena(str(path), [100, 200, 300], 1 << 20)
    path.write_bytes(b"junk" * 100)
    with pytest.raises(ConfigError, match="remove it"):
        HostArena(str(path), [100, 200], 1 << 20)


@pytest.mark.parametrize("field, value, words", [("host_bytes", 5, "host_bytes"), ("host_bytes", 1 << 50, "host_bytes"),
                                                  ("host_dir", "relative/dir", "absolute")])
def test_bad_host_settings_are_refused_in_one_line(field, value, words):
    with pytest.raises(ConfigError, match=words):
        PoolConfig(model_id="m", block_tokens=8, insecure=True, **{field: value})


def test_without_a_store_or_a_host_tier_a_tier_is_refused():
    eng = Engine(1, 8, seed=1)
    with pytest.raises(ConfigError, match="store client, a host tier"):
        PoolTier(eng.caches[0], None, config())


def test_a_load_from_the_store_is_kept_on_the_host_for_its_next_reader(master, lender, tmp_path):
    host_a, host_b = tmp_path / "a", tmp_path / "b"
    host_a.mkdir()
    host_b.mkdir()
    src = Engine(2, 4, seed=1)
    src.tiers = [PoolTier(c, lender, host_config(host_a)) for c in src.caches]
    dst = Engine(1, 8, seed=2, kv_order="HND")
    dst.tiers = [PoolTier(c, lender, host_config(host_b)) for c in dst.caches]  # "another host": its own arena
    try:
        keys = block_keys(4, "cross")
        assert all(src.store(src.job(3, 4), keys))
        assert sum(t.stats["objects_put"] for t in src.tiers) == 4 * 2 * 4  # the store got them too
        expected = expected_load(src, src.job(3, 4), dst.caches, dst.layout, dst.job(20, 4))
        assert all(dst.load(keys, dst.job(20, 4)))  # through Mooncake
        assert same(dst.caches, expected)
        got = sum(t.stats["objects_got"] for t in dst.tiers)
        assert got == 4 * 2 * 4 and sum(t.stats["host_objects_got"] for t in dst.tiers) == 0
        assert PoolIndex(SPEC, None, host_config(host_b)).hits(keys) == [True] * 4  # kept on B's host
        assert all(dst.load(keys, dst.job(20, 4)))
        assert sum(t.stats["objects_got"] for t in dst.tiers) == got  # never fetched over the network again
        assert sum(t.stats["host_objects_got"] for t in dst.tiers) == 4 * 2 * 4
        assert same(dst.caches, expected)
    finally:
        src.close()
        dst.close()


def test_with_the_store_away_the_host_tier_goes_on_and_a_client_attached_later_puts_again(master, lender, tmp_path):
    """`remote=False` (the integration's breaker open): stores and loads touch the host tier only,
    lookups answer from it, and a tier that started without a client (the master down at start)
    takes one later and puts into the store from then on."""
    cfg = host_config(tmp_path)
    src = host_only(Engine(2, 4, seed=1), cfg)  # started while the master was down
    dst = Engine(1, 8, seed=2, kv_order="HND")
    dst.tiers = [PoolTier(c, lender, cfg) for c in dst.caches]
    index = PoolIndex(SPEC, lender, cfg)
    try:
        away, later = block_keys(3, "away"), block_keys(2, "later")
        assert all(all(t.store(src.job(3, 3), away, remote=False).done) for t in src.tiers)
        assert index.hits(away + later, remote=False) == [True] * 3 + [False] * 2
        expected = expected_load(src, src.job(3, 3), dst.caches, dst.layout, dst.job(20, 3))
        assert all(dst.tiers[0].load(away, dst.job(20, 3), remote=False).done)
        assert same(dst.caches, expected)
        res = dst.tiers[0].load(later, dst.job(20, 2), remote=False)  # nowhere on the host: no store asked
        assert not any(res.done) and "no store behind it now" in res.reasons[0]
        assert dst.tiers[0].stats["missing"] == 0 and dst.tiers[0].stats["objects_got"] == 0
        assert index.hits(away) == [True] * 3 and lender.exists([n for k in away for n in index.layout.keys(k)]) == \
            [False] * 3 * 2 * 4  # nothing of it reached the store
        for t in src.tiers:
            t.attach(lender)
        assert all(src.store(src.job(3, 2), later))
        assert sum(t.stats["objects_put"] for t in src.tiers) == 2 * 2 * 4  # the store got what came after
    finally:
        index.close()
        src.close()
        dst.close()


def test_an_arena_file_of_another_user_or_not_a_file_is_refused_in_one_line(tmp_path, caplog):
    """A host_dir others can write (say /tmp) must not hand this engine an arena someone else made:
    the host tier is off (the engine goes on with the store), saying why in one line."""
    cfg = host_config(tmp_path)
    eng = host_only(Engine(1, 8, seed=1), cfg)
    path = _arena_file(tmp_path)
    eng.close()
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root (chown); the check is the same for any owner")
    os.chown(path, 4242, 4242)
    for why in ("another user's", "a FIFO"):
        caplog.clear()
        eng = host_only(Engine(1, 8, seed=1), cfg)
        try:
            assert all(a is None for t in eng.tiers for a in t.host.arenas), why
        finally:
            eng.close()
        said = [r.getMessage() for r in caplog.records if "host tier is off" in r.getMessage()]
        assert said and "not a regular file of this user's" in said[0] and "\n" not in said[0], why
        os.unlink(path)
        os.mkfifo(path)

"""Faults of a shared pool (issue 23 point 4) against a real Mooncake Store: whatever the store hands
back, a load either puts exactly the stored bytes on the device or leaves it untouched and says so."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from pool_harness import CLIENT_TTL_S, SPEC, Engine, block_keys, blocks_are, config, expected_load, same

from kvbridge.core.spec import ModelSpec
from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.seal import SEAL_BYTES
from kvbridge.pool.store import StoreClient, StoreConfig
from kvbridge.offload.spec import GPULoadStoreSpec
from kvbridge.pool.tier import PoolConfig, PoolIndex, PoolTier

HERE = Path(__file__).resolve().parent


def _writer(master, client, secret=b"fleet-secret-0123456789", staging=4):
    return Engine(2, 4, seed=1).attach(master, config(secret, staging), client)


def _pair(master, client, secret=b"fleet-secret-0123456789", staging=4):
    return (_writer(master, client, secret, staging),
            Engine(1, 8, seed=2, kv_order="HND").attach(master, config(secret, staging), client))


def test_what_one_shape_stores_another_loads_exactly_in_chunks(master, lender, client):
    src, dst = _pair(master, lender)
    try:
        keys = block_keys(10, "basic")  # 10 pool blocks through 4 staging slots: 3 chunks each way
        assert all(src.store(src.job(3, 10), keys))
        assert PoolIndex(SPEC, client, config()).hits(keys) == [True] * 10
        expected = expected_load(src, src.job(3, 10), dst.caches, dst.layout, dst.job(20, 10))
        assert all(dst.load(keys, dst.job(20, 10)))
        assert same(dst.caches, expected)  # every byte of the job where it belongs, nothing else changed
        assert sum(t.stats["objects_put"] for t in src.tiers) == 10 * 2 * 4  # each (layer, head) once
    finally:
        src.close()
        dst.close()


def _replace(client: StoreClient, key: str, payload: bytes) -> None:
    """Remove `key` and put `payload` under it, as anyone who reaches the store can."""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    client.register(buf.data_ptr(), buf.numel())
    try:
        client.remove([key])
        assert client.put([key], [[(buf.data_ptr(), buf.numel())]]) == [0]
    finally:  # memory freed while registered makes a later buffer at that address "overlapped"
        client.unregister(buf.data_ptr(), buf.numel())


def _object_bytes(client: StoreClient, key: str, size: int) -> bytes:
    buf = torch.zeros(size, dtype=torch.uint8)
    client.register(buf.data_ptr(), size)
    try:
        assert client.get([key], [[(buf.data_ptr(), size)]]) == [size]
        return bytes(buf.numpy())
    finally:
        client.unregister(buf.data_ptr(), size)


@pytest.mark.parametrize("attack", ["flipped byte", "random payload", "another key's object", "truncated",
                                    "no seal"])
def test_a_forged_or_damaged_object_is_refused_and_the_device_untouched(master, lender, client, attack):
    src, dst = _pair(master, lender, staging=8)
    try:
        keys = block_keys(3, f"forged-{attack}")
        assert all(src.store(src.job(0, 3), keys))
        layout = src.tiers[0].layout
        target, other = layout.keys(keys[1])[5], layout.keys(keys[2])[5]
        size = layout.nbytes(layout.group_objects[0][5]) + SEAL_BYTES
        good = _object_bytes(client, target, size)
        forged = {"flipped byte": good[:7] + bytes([good[7] ^ 1]) + good[8:],
                  "random payload": os.urandom(size - SEAL_BYTES) + good[-SEAL_BYTES:],
                  "another key's object": _object_bytes(client, other, size),
                  "truncated": good[:-1],
                  "no seal": good[:-SEAL_BYTES]}[attack]
        _replace(client, target, forged)
        before = dst.clone()
        done = dst.load(keys, dst.job(0, 3))
        assert done == [False] * 3  # one chunk: nothing of it reaches the device
        assert same(dst.caches, before)
        refused = sum(t.stats["seal_failures"] + t.stats["missing"] + t.stats["removed"] for t in dst.tiers)
        assert refused == (1 if attack in ("truncated", "no seal") else 2)  # a bad seal is also removed
        assert sum(t.stats["removed"] for t in dst.tiers) == 1 and client.exists([target]) == [False]
        # Garbage costs one recompute: the next writer stores the block again, the next load takes it.
        assert PoolIndex(SPEC, client, config()).hits(keys) == [True, False, True]
        assert all(src.store(src.job(0, 3), keys))
        expected = expected_load(src, src.job(0, 3), dst.caches, dst.layout, dst.job(0, 3))
        assert all(dst.load(keys, dst.job(0, 3)))
        assert same(dst.caches, expected)
    finally:
        src.close()
        dst.close()


def test_a_reader_with_another_secret_uses_nothing(master, lender):
    src = _writer(master, lender)
    dst = Engine(1, 8, seed=2).attach(master, config(b"not-the-fleet-secret"), lender)
    try:
        keys = block_keys(2, "secret")
        assert all(src.store(src.job(0, 2), keys))
        before = dst.clone()
        assert dst.load(keys, dst.job(0, 2)) == [False, False]
        assert same(dst.caches, before)
    finally:
        src.close()
        dst.close()


def test_a_restarted_fleet_hits_what_it_stored_and_a_fleet_of_another_secret_shares_nothing(master, lender, client):
    """Names are MACs under the fleet's secret: a fleet restarted with the same secret file finds its
    objects; a fleet with another secret on the same master sees none of them, refuses and removes
    nothing of them (it is not slowed: its lookups are plain misses), and stores its own beside them."""
    keys = block_keys(4, "restart-secret")
    src = _writer(master, lender)
    src.store(src.job(0, 4), keys)
    src.close()
    restarted = Engine(1, 8, seed=2, kv_order="HND").attach(master, config())  # new processes, new clients
    other_cfg = config(b"another-fleet-secret-42")
    other = Engine(1, 8, seed=6).attach(master, other_cfg, lender)
    try:
        assert PoolIndex(SPEC, client, config()).hits(keys) == [True] * 4
        expected = expected_load(src, src.job(0, 4), restarted.caches, restarted.layout, restarted.job(0, 4))
        assert all(restarted.load(keys, restarted.job(0, 4)))
        assert same(restarted.caches, expected)
        assert PoolIndex(SPEC, client, other_cfg).hits(keys) == [False] * 4
        before = other.clone()
        assert other.load(keys, other.job(0, 4)) == [False] * 4 and same(other.caches, before)
        assert sum(t.stats["seal_failures"] + t.stats["removed"] for t in other.tiers) == 0
        assert all(other.store(other.job(0, 4), keys))
        assert PoolIndex(SPEC, client, other_cfg).hits(keys) == [True] * 4
        assert PoolIndex(SPEC, client, config()).hits(keys) == [True] * 4  # the first fleet's objects untouched
    finally:
        restarted.close()
        other.close()


def test_a_block_missing_one_object_is_not_a_hit(master, lender, client):
    src = _writer(master, lender)
    try:
        keys = block_keys(4, "missing")
        assert all(src.store(src.job(0, 4), keys))
        client.remove([src.tiers[0].layout.keys(keys[2])[-1]])
        assert PoolIndex(SPEC, client, config()).hits(keys) == [True, True, False, True]
    finally:
        src.close()


def test_only_a_rank_that_stored_leaves_its_blocks_incomplete(master, lender, client):
    """Rank 1 of the writer dies before its puts: rank 0's objects are there, the blocks are not hits."""
    src = _writer(master, lender)
    try:
        keys = block_keys(3, "half")
        assert all(src.tiers[0].store(src.job(0, 3), keys).done)
        assert PoolIndex(SPEC, client, config()).hits(keys) == [False] * 3
        assert all(src.tiers[1].store(src.job(0, 3), keys).done)
        assert PoolIndex(SPEC, client, config()).hits(keys) == [True] * 3
    finally:
        src.close()


WRITER = """
import sys
sys.path.insert(0, {here!r})
from pool_harness import Engine, block_keys, config
class M: address, metadata_url = {address!r}, {url!r}
e = Engine(2, 4, seed=11, num_blocks=8192).attach(M, config(staging=2))
keys = block_keys(4000, "killed")
for i in range(0, 4000, 2):
    e.store(e.job(i * 2, 2), keys[i:i + 2])
    print(i, flush=True)
"""


def test_a_writer_killed_mid_store_never_serves_a_partial_or_broken_block(master, client):
    """SIGKILL a process (which lends its memory to the pool) in the middle of storing: every block
    either loads bit-exact or is refused with the device untouched (objects in the dead process's
    memory cannot be read); blocks it never finished are not hits."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(here=str(HERE), address=master.address,
                                                               url=master.metadata_url)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "GLOG_minloglevel": "3"})
    try:
        for _ in range(100):  # 100 chunks of 2 blocks stored, then the kill lands during a store
            assert proc.stdout.readline(), "the writer died on its own"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    keys = block_keys(4000, "killed")
    hits = PoolIndex(SPEC, client, config()).hits(keys)
    complete = [i for i, h in enumerate(hits) if h]
    assert 200 <= len(complete) < 4000, "the kill must land in the middle of the store"
    assert not any(hits[i] for i in range(max(complete) + 3, 4000))
    same_bytes = Engine(2, 4, seed=11, num_blocks=8192)  # the writer's contents, rebuilt from its seed
    dst = Engine(1, 8, seed=3, num_blocks=len(complete) + 1).attach(master, config(staging=4), client)
    try:
        src_job, dst_job = same_bytes.job_at([2 * i for i in complete]), dst.job(0, len(complete))
        expected = expected_load(same_bytes, src_job, dst.caches, dst.layout, dst_job)
        before = dst.clone()
        loaded = dst.load([keys[i] for i in complete], dst_job)
        for k, ok in enumerate(loaded):
            assert blocks_are(dst.caches, expected if ok else before, [k]), (k, ok)
    finally:
        dst.close()
    time.sleep(2 * CLIENT_TTL_S)  # the dead writer's segment unmounted, so later puts do not land in it


DEAD_WRITER = """
import sys, time
sys.path.insert(0, {here!r})
from pool_harness import Engine, block_keys, config
class M: address, metadata_url = {address!r}, {url!r}
e = Engine(2, 4, seed=11, num_blocks=64).attach(M, config(staging=4))
assert all(e.store(e.job(0, 8), block_keys(8, "dead")))
print("stored", flush=True)
time.sleep(3600)
"""


def test_a_dead_writers_objects_are_replaced_by_the_next_store_of_their_blocks(tmp_path):
    """A writer SIGKILLed after storing leaves objects the master lists (until the client's TTL,
    an hour here) that nobody can read. A reader's load is refused with its device untouched, and
    its store of the same blocks (`skip_present`, as the vLLM worker stores a recomputed prefix)
    puts them again instead of skipping them as present: the next load takes them. Before, the
    prefix was in nobody's memory once the master dropped the dead client (an outside trial).
    Objects that are readable (a writer that was only slow) are never replaced."""
    master = MooncakeMaster.start(tmp_path / "master.log", extra=("-client_ttl=3600",))
    proc = subprocess.Popen([sys.executable, "-c", DEAD_WRITER.format(here=str(HERE), address=master.address,
                                                                    url=master.metadata_url)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "GLOG_minloglevel": "3"})
    reader = None
    try:
        assert select.select([proc.stdout], [], [], 600)[0], "the writer stored nothing in 10 minutes"
        assert proc.stdout.readline().strip() == "stored", "the writer died on its own"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        keys = block_keys(8, "dead")
        reader = Engine(1, 8, seed=3, num_blocks=64, kv_order="HND").attach(master, config(staging=4))
        assert PoolIndex(SPEC, reader.clients[0], config()).hits(keys) == [True] * 8  # listed, unreadable
        before = reader.clone()
        assert reader.load(keys, reader.job(0, 8)) == [False] * 8
        assert same(reader.caches, before)
        # The reader recomputes the prefix (here: the writer's bytes, rebuilt from its seed) and stores it.
        recomputed = Engine(2, 4, seed=11, num_blocks=64).attach(master, config(staging=4), reader.clients[0])
        stats = lambda name: sum(t.stats[name] for t in recomputed.tiers)  # noqa: E731
        try:
            assert all(recomputed.store(recomputed.job(0, 8), keys, skip_present=True))
            replaced = stats("removed")
            assert replaced > 0 and stats("objects_put") == replaced
            expected = expected_load(recomputed, recomputed.job(0, 8), reader.caches, reader.layout,
                                     reader.job(0, 8))
            assert reader.load(keys, reader.job(0, 8)) == [True] * 8
            assert same(reader.caches, expected)
            # Readable objects stay as they are: after the replacement, and when a load saw them fail once.
            reader.clients[0].note_unreadable(recomputed.tiers[0].layout.keys(keys[0]))
            assert all(recomputed.store(recomputed.job(0, 8), keys, skip_present=True))
            assert stats("removed") == replaced and stats("objects_put") == replaced
        finally:
            for t in recomputed.tiers:
                t.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        if reader is not None:
            reader.close()
        master.stop()


def test_two_engines_storing_one_prefix_at_once_leave_whole_valid_objects(master, lender, client):
    """First writer wins per object; the loaded bytes of every object are one writer's, sealed."""
    a = Engine(2, 4, seed=21).attach(master, config(), lender)
    b = Engine(1, 8, seed=22).attach(master, config(), client)
    dst = Engine(2, 8, seed=23, kv_order="HND").attach(master, config(staging=16), lender)
    keys = block_keys(12, "race")
    try:
        threads = [threading.Thread(target=e.store, args=(e.job(0, 12), keys)) for e in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ea = expected_load(a, a.job(0, 12), dst.caches, dst.layout, dst.job(0, 12))
        eb = expected_load(b, b.job(0, 12), dst.caches, dst.layout, dst.job(0, 12))
        assert all(dst.load(keys, dst.job(0, 12)))
        for c, x, y in zip(dst.caches, ea, eb):
            for r, rx, ry in zip(c.byte_regions(), x.byte_regions(), y.byte_regions()):
                assert bool(((r == rx) | (r == ry)).all())
    finally:
        for e in (a, b, dst):
            e.close()


@pytest.fixture
def own_master(tmp_path):
    m = MooncakeMaster.start(tmp_path / "master.log")
    yield m
    m.stop()


def test_a_master_restart_loses_objects_not_correctness(own_master):
    src, dst = _pair(own_master, None)
    index_client = StoreClient(StoreConfig(own_master.address, own_master.metadata_url, segment_bytes=0))
    index = PoolIndex(SPEC, index_client, config())
    keys = block_keys(4, "restart")
    try:
        assert all(src.store(src.job(0, 4), keys))
        own_master.restart()
        assert not any(index.hits(keys))  # the objects went with the master (None while it was away)
        before = dst.clone()
        assert dst.load(keys, dst.job(0, 4)) == [False] * 4
        assert same(dst.caches, before)
        end = time.monotonic() + 60
        while not all(src.store(src.job(0, 4), keys)):  # clients mount their memory again by themselves
            assert time.monotonic() < end, "the clients never came back after the master restarted"
            time.sleep(0.5)
        assert index.hits(keys) == [True] * 4
        expected = expected_load(src, src.job(0, 4), dst.caches, dst.layout, dst.job(0, 4))
        assert all(dst.load(keys, dst.job(0, 4)))
        assert same(dst.caches, expected)
    finally:
        src.close()
        dst.close()
        index_client.close()


BIG = ModelSpec.uniform(2, 4, 256, "bfloat16", name="pool-big")  # 8 KiB objects (8 tokens x 256 x K,V)


def test_a_full_store_evicts_whole_objects_and_serves_only_complete_blocks(own_master):
    """Two 16 MiB segments hold about 500 of the 700 blocks (64 KiB each) stored: the store evicts;
    whatever the index still calls complete loads bit-exact, the rest are misses."""
    src = Engine(2, 4, seed=31, spec=BIG, num_blocks=1400).attach(own_master, config(staging=8), segment_bytes=16 << 20)
    keys = block_keys(700, "full")
    try:
        done = [ok for i in range(0, 700, 7) for ok in src.store(src.job(i * 2, 7), keys[i:i + 7])]
        reader = StoreClient(StoreConfig(own_master.address, own_master.metadata_url, segment_bytes=0))
        hits = PoolIndex(BIG, reader, config()).hits(keys)
        complete = [i for i, h in enumerate(hits) if h]
        assert len(complete) < 700, "the store never filled up"
        assert not any(hits[i] for i, ok in enumerate(done) if not ok)  # a block whose store failed is no hit
        assert complete, "nothing survived in the store"
        dst = Engine(1, 8, seed=32, spec=BIG, num_blocks=len(complete) + 1).attach(own_master, config(staging=8),
                                                                                  reader)
        try:
            src_job, dst_job = src.job_at([2 * i for i in complete]), dst.job(0, len(complete))
            expected = expected_load(src, src_job, dst.caches, dst.layout, dst_job)
            before = dst.clone()
            loaded = dst.load([keys[i] for i in complete], dst_job)
            # eviction may still take objects between lookup and load: such chunks are refused, not wrong
            assert sum(loaded) >= len(complete) // 2
            for k, ok in enumerate(loaded):
                assert blocks_are(dst.caches, expected if ok else before, [k]), (k, ok)
        finally:
            dst.close()
            reader.close()
    finally:
        src.close()


@pytest.mark.parametrize("vllm_staging", [False, True])
@pytest.mark.parametrize("store, load", [((1, 64, None), (2, 32, None)), ((1, 64, 16), (2, 32, 32)),
                                         ((2, 32, None), (1, 64, None))])
def test_vllm_cpu_caches_round_trip_through_the_pool(master, lender, store, load, vllm_staging):
    """vLLM CPU's cache (K transposed per head, `VllmCpuLayout`) stored by one shape and loaded by
    another: every byte as the planner's own oracle says (the connector once described it as a
    plain layout of the same fields, and only same-shape round trips worked)."""
    from kvbridge.core.plan import Request
    from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec
    from kvbridge.core.spec import LayerSpec
    from kvbridge.proofs.verify import clone_caches, expected_destination, fill_source, mismatch_report, random_bytes
    from kvbridge.transport.cache import RankCache as RC

    spec = vllm_cpu_spec(ModelSpec(tuple(LayerSpec("full", 2, 32, 32) for _ in range(2)), "float32", "tiny"))
    (tpa, ba, ka), (tpb, bb, kb) = store, load
    la, lb = vllm_cpu_layout(tpa, ba, 16, ka), vllm_cpu_layout(tpb, bb, 16, kb)
    src, dst = RC.allocate_engine(spec, la, fill=None), RC.allocate_engine(spec, lb, fill=None)
    random_bytes(src, 1)
    random_bytes(dst, 2)
    a_ids, b_ids = tuple(range(1, 1 + 256 // ba)), tuple(range(3, 3 + 256 // bb))
    fill_source(src, (a_ids,), 256)
    want = clone_caches(dst)
    expected_destination(want, Request((a_ids,), (b_ids,), 256), la)
    cfg = PoolConfig(model_id=f"vllm-cpu-{store}-{load}-{vllm_staging}", block_tokens=64, staging_blocks=8,
                     secret=b"vllm-cpu-secret-0123456789")
    keys = block_keys(4, f"vllm-cpu-{store}-{load}-{vllm_staging}")
    staging = (lambda bt, n: vllm_cpu_layout(1, bt, n)) if vllm_staging else None
    writers = [PoolTier(c, lender, cfg, staging=staging) for c in src]
    readers = [PoolTier(c, lender, cfg, staging=staging) for c in dst]
    try:
        if vllm_staging:  # a head's bytes are one run (and the seal): K transposed, then V
            assert all(len(writers[0]._views(0, o)) == 1 for o in writers[0].layout.group_objects[0])
        gpu = lambda ids: GPULoadStoreSpec(list(ids), [len(ids)], [0])  # noqa: E731
        assert all(t.store(gpu(a_ids), keys).ok for t in writers)
        assert all(t.load(keys, gpu(b_ids)).ok for t in readers)
        assert not mismatch_report(dst, want)
    finally:
        for t in writers + readers:
            t.close()


def test_many_instances_on_one_pool_each_load_what_the_others_stored(master):
    """Four engines of four shapes, each its own client (as its own process would have), store a
    prefix each, then every engine loads every other engine's prefix exactly."""
    shapes = [(1, 4, "NHD"), (2, 8, "HND"), (4, 4, "NHD"), (2, 2, "HND")]
    engines = [Engine(tp, block, seed=50 + i, kv_order=order).attach(master, config(staging=8))
               for i, (tp, block, order) in enumerate(shapes)]
    try:
        keys = [block_keys(5, f"many-{i}") for i in range(len(engines))]
        for e, k in zip(engines, keys):
            assert all(e.store(e.job(0, 5), k))
        for i, reader in enumerate(engines):
            for j, writer in enumerate(engines):
                if i == j:
                    continue
                first = 12  # blocks past what the reader stored from
                expected = expected_load(writer, writer.job(0, 5), reader.caches, reader.layout,
                                         reader.job(first, 5))
                assert all(reader.load(keys[j], reader.job(first, 5))), (i, j)
                assert same(reader.caches, expected), (i, j)
    finally:
        for e in engines:
            e.close()


def test_a_get_of_many_small_runs_is_split_below_mooncakes_lane_queue(lender, client):
    """300 objects of 34 runs each (vLLM CPU's transposed K): in one Mooncake call its TCP
    transport rejected the tasks past its lane queue and some objects failed (-800, measured
    here); the client's calls of at most MAX_RUNS runs get every one."""
    from kvbridge.pool.store import MAX_RUNS

    src = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
    out = torch.zeros(1 << 22, dtype=torch.uint8)
    lender.register(src.data_ptr(), src.numel())
    client.register(out.data_ptr(), out.numel())
    try:
        n, runs = 300, 34
        assert n * runs > 4 * MAX_RUNS
        keys = [f"lane-test/{i}" for i in range(n)]
        put = [[(src.data_ptr() + (i * runs + j) * 256, 256) for j in range(runs)] for i in range(n)]
        get = [[(out.data_ptr() + (i * runs + j) * 256, 256) for j in range(runs)] for i in range(n)]
        assert set(lender.put(keys, put)) == {0}
        assert set(client.get(keys, get)) == {runs * 256}
        assert torch.equal(out[:n * runs * 256], src[:n * runs * 256])
    finally:
        lender.unregister(src.data_ptr(), src.numel())
        client.unregister(out.data_ptr(), out.numel())


def test_vllm_cpu_full_and_sliding_groups_round_trip_with_the_windows_blocks_only(master, lender):
    """vLLM's hybrid allocator gives a full and a sliding-window group their own block tables, the
    window's slid-out blocks null: one shape stores the full group's four blocks and the sliding
    group's last, another loads them, and every byte lands where the planner's oracle puts it,
    the sliding layer's slid-out blocks untouched (each group is planned as a model of its own,
    in the engine's own layer class, against the layout's one block size for it)."""
    import msgspec

    from kvbridge.core.plan import Request
    from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec
    from kvbridge.core.spec import LayerSpec
    from kvbridge.proofs.verify import clone_caches, expected_destination, fill_source, mismatch_report, random_bytes
    from kvbridge.transport.cache import RankCache as RC

    spec = vllm_cpu_spec(ModelSpec((LayerSpec("full", 2, 32, 32), LayerSpec("sliding", 2, 32, 32, window=65)),
                                   "float32", "tiny-sliding"))  # keeps its last 64 tokens: the last pool block
    assert len(spec.groups) == 2
    la = msgspec.structs.replace(vllm_cpu_layout(1, 64, 16), group_block_sizes=(64, 64))
    lb = msgspec.structs.replace(vllm_cpu_layout(2, 32, 24), group_block_sizes=(32, 32))
    src, dst = RC.allocate_engine(spec, la, fill=None), RC.allocate_engine(spec, lb, fill=None)
    random_bytes(src, 3)
    random_bytes(dst, 4)
    a_ids, b_ids = (1, 2, 3, 4), tuple(range(5, 13))
    sa, sb = (5, 6, 7, 8), tuple(range(13, 21))  # the sliding group's own blocks
    fill_source(src, (a_ids, sa), 256)
    before, want = clone_caches(dst), clone_caches(dst)
    expected_destination(want, Request((a_ids, sa), (b_ids, sb), 256), la)
    for w, b in zip(want, before):  # the sliding layer's blocks before its window (tokens < 192) stay
        for c in range(2):
            w.logical_view(1, c, True)[list(sb[:6])] = b.logical_view(1, c, True)[list(sb[:6])]
    cfg = PoolConfig(model_id="vllm-cpu-sliding", block_tokens=64, staging_blocks=8, secret=b"vllm-cpu-secret-0123456789")
    full, sliding = block_keys(4, "vllm-cpu-sliding"), block_keys(4, "vllm-cpu-sliding", group=1)
    staging = lambda bt, n: vllm_cpu_layout(1, bt, n)  # noqa: E731
    writers = [PoolTier(c, lender, cfg, staging=staging) for c in src]
    readers = [PoolTier(c, lender, cfg, staging=staging) for c in dst]
    try:
        # Device ids per group, the sliding group's from logical block 3 (its earlier ones are null).
        store = GPULoadStoreSpec([*a_ids, sa[3]], [4, 1], [0, 3])
        load = GPULoadStoreSpec([*b_ids, *sb[6:]], [8, 2], [0, 6])
        assert all(t.store(store, [*full, sliding[3]]).ok for t in writers)
        assert all(t.load([*full, sliding[3]], load).ok for t in readers)
        assert not mismatch_report(dst, want)
    finally:
        for t in writers + readers:
            t.close()


def test_the_block_comparison_reads_only_this_pp_stages_layers() -> None:
    # `logical_view` refuses another stage's layer; looping it over every layer raised on PP > 1
    # (issue 43, noted and left)
    from kvbridge.core.layout import EngineLayout
    from kvbridge.proofs.verify import random_bytes
    from kvbridge.transport.cache import RankCache
    layout = EngineLayout(tp_size=1, pp_size=2, block_size=4, num_blocks=4)
    a, b = RankCache.allocate_engine(SPEC, layout, fill=None), RankCache.allocate_engine(SPEC, layout, fill=None)
    random_bytes(a, 1)
    random_bytes(b, 1)
    assert blocks_are(a, b, [0, 3])
    b[1].logical_view(1, 0, as_int=True)[3] += 1  # stage 1's layer, block 3
    assert blocks_are(a, b, [0]) and not blocks_are(a, b, [3])

"""What a pool object is and who writes it, for any model and engine shape (no store needed):

* every object of every block is written by exactly one rank of any engine, and the bytes a rank's
  store job writes into canonical staging are exactly the objects it puts (a recurrent group's:
  one checkpoint per pool block, each state unit its own object);
* the objects a rank reads are exactly the heads and layers it holds, and what its load job reads
  from staging lies inside them;
* a job cut into chunks moves the same device blocks to the same pool sub-blocks;
* a sealed object holds no plaintext and opens only under its name, tenant and secret.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import Component, LayerSpec, ModelSpec
from kvbridge.errors import ConfigError
from kvbridge.offload.errors import NotCanonicalizable
from kvbridge.offload.keys import make_offload_key
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec, split_groups
from kvbridge.offload.transfer import JobPlanner
from kvbridge.pool.objects import ObjectId
from kvbridge.pool.seal import SEAL_BYTES, open_into, seal_into, tenant_key
from kvbridge.pool.store import StoreConfig
from kvbridge.pool.tier import PoolConfig, job_chunks, object_layout

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = [("full",), ("sliding", "full"), ("full", "mla"), ("mla",), ("full", "recurrent"),
         ("recurrent", "sliding", "recurrent"), ("conv", "full")]


def _short_conv(channels: int) -> LayerSpec:
    """A short conv's state as vLLM's SD layout keeps it: a component per row, one unit per channel
    (objects are chunks of channels: `state_chunk`)."""
    return LayerSpec("recurrent", state=(Component("conv_r0", channels, 1), Component("conv_r1", channels, 1)),
                     recurrent_type="short_conv", conv_rows=2)


def _mamba2(heads: int, groups: int) -> LayerSpec:
    """A Mamba2-like state: conv x by head, conv B and C by group (replicated beyond them), SSM by head."""
    return LayerSpec("recurrent", state=(Component("conv_x", heads, 3), Component("conv_b", groups, 6),
                                         Component("conv_c", groups, 6), Component("ssm", heads, 12, "float32")),
                     recurrent_type="mamba2", conv_rows=3)


@st.composite
def cases(draw):
    kinds = draw(st.sampled_from(KINDS))
    heads = 1 if kinds == ("mla",) else draw(st.sampled_from([1, 2, 4, 6]))
    layers = draw(st.integers(max(2, len(kinds)), 5))
    spec = ModelSpec.uniform(layers, heads, draw(st.sampled_from([4, 8])), "bfloat16",
                             kinds=tuple("full" if k in ("recurrent", "conv") else k for k in kinds), window=8)
    if "recurrent" in kinds or "conv" in kinds:
        state = (_mamba2(heads * draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))) if "recurrent" in kinds
                 else _short_conv(draw(st.sampled_from([64, 96, 192]))))
        spec = ModelSpec(tuple(state if kinds[i % len(kinds)] in ("recurrent", "conv") else layer
                               for i, layer in enumerate(spec.layers)), spec.dtype)
    tps = [t for t in range(1, 7) if spec.is_mla or all(c.heads % t == 0 or t % c.heads == 0 for layer in spec.layers
                                                          for c in layer.components)]
    pool_block = draw(st.sampled_from([4, 8, 16]))
    block = draw(st.sampled_from([b for b in (1, 2, 4, 8, 16) if pool_block % b == 0]))
    pp = draw(st.integers(1, min(3, layers)))
    device = EngineLayout(tp_size=draw(st.sampled_from(tps)), pp_size=pp, block_size=block, num_blocks=32,
                          **dict(zip(("kv_order", "kv_placement"), draw(st.sampled_from(
                              [("NHD", "kv_first"), ("NHD", "blocks_first"), ("HND", "kv_first"),
                               ("HND", "blocks_first"), ("HND", "per_head")])))))
    return spec, device, PoolConfig(model_id="m", block_tokens=pool_block, staging_blocks=2, insecure=True)


def _covered(runs, regions: bool) -> set[tuple[int, int]]:
    """(region, byte) pairs a job's runs touch on the pool side."""
    reg, off = (runs.dst_region, runs.dst_offset) if regions else (runs.src_region, runs.src_offset)
    return {(int(r), int(o) + i) for r, o, n in zip(reg, off, runs.length) for i in range(int(n))}


def _object_bytes(layout, slot: int, objs) -> set[tuple[int, int]]:
    return {(r, o + i) for obj in objs for r, o, n in layout.pieces(slot, obj) for i in range(n)}


@SETTINGS
@given(cases())
def test_each_object_has_one_writer_and_its_store_job_writes_exactly_those_bytes(case):
    spec, device, cfg = case
    layout = object_layout(spec, cfg, 1)
    factor = layout.check_device(device)
    writers: dict[ObjectId, list[int]] = {}
    for g in range(len(spec.groups)):
        n = 1 if spec.group_layer(g).is_recurrent else factor  # a state group: one checkpoint per pool block
        job = GPULoadStoreSpec(list(range(n)), [n if i == g else 0 for i in range(len(spec.groups))],
                               [factor - 1 if n == 1 else 0] * len(spec.groups))
        for rank in range(device.world_size):
            written = layout.written_by(device, rank)[g]
            for o in written:
                writers.setdefault(o, []).append(rank)
            runs = JobPlanner(spec, device, [rank], layout.pool).plan(job, CPULoadStoreSpec([0]), store=True)
            assert _covered(runs, True) == _object_bytes(layout, 0, written)
            reads = layout.read_by(device, rank)[g]
            load = JobPlanner(spec, device, [rank], layout.pool).plan(job, CPULoadStoreSpec([0]), store=False)
            assert _covered(load, False) == _object_bytes(layout, 0, reads)
    every = {o for objs in layout.group_objects for o in objs}
    assert set(writers) == every and all(len(r) == 1 for r in writers.values())


@SETTINGS
@given(cases(), st.integers(1, 5), st.data())
def test_chunks_move_the_same_blocks_to_the_same_sub_blocks(case, capacity, data):
    spec, device, cfg = case
    layout = object_layout(spec, cfg, 1)
    factor = layout.check_device(device)
    groups = len(spec.groups)
    sizes = [data.draw(st.integers(0, 12)) for _ in range(groups)]
    first = [data.draw(st.integers(0, 20)) for _ in range(groups)]
    if factor == 1:
        first = [0] * groups
    ids = list(range(sum(sizes)))
    gpu = GPULoadStoreSpec(ids, sizes, first)
    state = spec.recurrent_groups()
    num_keys = sum(n if g in state else -(-(n + f % factor) // factor)
                   for g, (n, f) in enumerate(zip(sizes, first)) if n)
    slices = split_groups(gpu, np.arange(num_keys), factor, groups, state)
    keys = [make_offload_key(bytes([s.group, j]) * 16, s.group) for s in slices for j in range(len(s.cpu_ids))]

    def where(s, chunk_keys):  # device block -> (key, sub-block; a checkpoint: "state")
        if s.state:
            return {b: (chunk_keys[c], "state") for b, c in zip(s.device_ids.tolist(), s.cpu_ids.tolist())}
        return {b: (chunk_keys[sub // factor], sub % factor)  # cpu ids are key positions
                for b, sub in zip(s.device_ids.tolist(), s.cpu_sub_blocks(factor).tolist())}

    want = {b: w for s in slices for b, w in where(s, keys).items()}
    got = {}
    for chunk, chunk_keys in job_chunks(gpu, keys, layout, factor, capacity):
        assert len(chunk_keys) <= capacity
        for s in split_groups(chunk, np.arange(len(chunk_keys)), factor, groups, state):
            for b, w in where(s, chunk_keys).items():
                assert b not in got
                got[b] = w
    assert got == want


def _sealed(tkey: bytes, name: str, pieces: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(sum(p.nbytes for p in pieces) + SEAL_BYTES, dtype=np.uint8)
    seal_into(tkey, name, pieces, out)
    return out


@pytest.mark.parametrize("split", [[64], [10, 54], [1, 30, 33]])
def test_a_sealed_object_opens_only_as_itself_and_holds_no_plaintext(split):
    rng = np.random.default_rng(len(split))
    payload = rng.integers(0, 256, sum(split), dtype=np.uint8)
    payload[:16] = np.frombuffer(b"the tenant prompt", dtype=np.uint8)[:16]
    pieces = np.split(payload.copy(), np.cumsum(split)[:-1])
    tkey = tenant_key(b"s" * 16, b"salt-a")
    stored = _sealed(tkey, "kvb3/a", pieces)
    assert b"the tenant promp" not in stored.tobytes() and not np.array_equal(stored[:64], payload)
    out = [np.zeros_like(p) for p in pieces]
    assert open_into(tkey, "kvb3/a", stored, out) == ""
    assert np.array_equal(np.concatenate(out), payload)
    refusals = {
        "another name": open_into(tkey, "kvb3/b", stored, out),
        "another tenant": open_into(tenant_key(b"s" * 16, b"salt-b"), "kvb3/a", stored, out),
        "no tenant": open_into(tenant_key(b"s" * 16), "kvb3/a", stored, out),
        "another secret": open_into(tenant_key(b"t" * 16, b"salt-a"), "kvb3/a", stored, out),
        "truncated": open_into(tkey, "kvb3/a", stored[:-1], out),
        "shorter payload": open_into(tkey, "kvb3/a", stored[1:], [o[1:] if i == 0 else o for i, o in enumerate(out)]),
        "no seal": open_into(tkey, "kvb3/a", np.zeros_like(stored), out),
    }
    for at in (0, sum(split) - 1, sum(split) + 3, sum(split) + 20):  # payload, tag, derivation value
        bad = stored.copy()
        bad[at] ^= 1
        refusals[f"byte {at} flipped"] = open_into(tkey, "kvb3/a", bad, out)
    assert all(refusals.values()), {k: v for k, v in refusals.items() if not v}
    assert "magic" in refusals["no seal"] and "authentication" in refusals["another tenant"]


def test_nonces_are_derived_per_seal_never_repeated():
    """Every (key, nonce) encrypts one plaintext: each seal of a process takes the process's writer
    key and the next of its counts as the nonce, so the same name sealed again (another engine's
    last bits, a rewrite after eviction, or the same bytes) gets another nonce; a forked child draws
    a writer id (so a key) of its own instead of repeating its parent's counts."""
    import os

    tkey = tenant_key(b"s" * 16)
    a = np.arange(256, dtype=np.uint8)
    b = a.copy()
    b[200] ^= 1
    sa, sa2, sb = _sealed(tkey, "kvb4/x", [a]), _sealed(tkey, "kvb4/x", [a.copy()]), _sealed(tkey, "kvb4/x", [b])
    derivation = slice(256 + 16, 256 + 48)
    values = {bytes(s[derivation]) for s in (sa, sa2, sb)}
    assert len(values) == 3
    assert len({v[:16] for v in values}) == 1  # one writer id per process, counts differ
    # Two ciphertexts under one key and nonce would XOR to the plaintexts' XOR: not so here.
    assert not np.array_equal(sa[:256] ^ sb[:256], a ^ b)
    out = [np.empty(256, dtype=np.uint8)]
    assert open_into(tkey, "kvb4/x", sa2, out) == "" and np.array_equal(out[0], a)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's seal: its derivation value to the parent
        os.write(w, bytes(_sealed(tkey, "kvb4/x", [a])[derivation]))
        os._exit(0)
    os.close(w)
    child = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    assert len(child) == 32 and child[:16] != next(iter(values))[:16]


def test_a_writer_draws_a_new_key_after_its_last_nonce_and_threads_never_share_one(monkeypatch):
    """After `_ROTATE` seals the writer draws another id, so its counts start again under another
    key; threads sealing at once (the seal pool) never get the same (id, count)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.pool import seal

    monkeypatch.setattr(seal, "_ROTATE", 50)
    monkeypatch.setattr(seal, "_writer", seal._Writer())
    tkey, a = tenant_key(b"s" * 16), np.arange(64, dtype=np.uint8)
    derivation = slice(64 + 16, 64 + 48)
    with ThreadPoolExecutor(4) as pool:
        values = list(pool.map(lambda i: bytes(_sealed(tkey, f"kvb5/{i}", [a])[derivation]), range(400)))
    assert len(set(values)) == 400
    writers: dict[bytes, list[int]] = {}
    for v in values:
        writers.setdefault(v[:16], []).append(int.from_bytes(v[16:24], "little"))
    assert len(writers) >= 8 and all(max(c) < 50 for c in writers.values())
    out = [np.empty(64, dtype=np.uint8)]
    sealed = _sealed(tkey, "kvb5/x", [a])
    assert open_into(tkey, "kvb5/x", sealed, out) == "" and np.array_equal(out[0], a)


def test_engines_that_must_not_share_get_different_namespaces():
    spec = ModelSpec.uniform(2, 4, 8, "bfloat16")
    base = object_layout(spec, PoolConfig(model_id="m", block_tokens=8, insecure=True)).namespace
    assert object_layout(spec, PoolConfig(model_id="other", block_tokens=8, insecure=True)).namespace != base
    assert object_layout(spec, PoolConfig(model_id="m", block_tokens=16, insecure=True)).namespace != base
    assert object_layout(ModelSpec.uniform(2, 4, 8, "float16"), PoolConfig(model_id="m", block_tokens=8, insecure=True)).namespace != base
    assert object_layout(spec, PoolConfig(model_id="m", block_tokens=8, secret=b"another-fleet-secret")).namespace == base
    # an engine whose blocks hold bytes in an order of their own (vLLM CPU's AMX kernels) shares
    # only with engines of that order: a miss, never a misread
    amx = [object_layout(spec, PoolConfig(model_id="m", block_tokens=8, insecure=True,
                                          byte_order=f"vllm-cpu amx block {b} head 8")).namespace for b in (32, 64)]
    assert len({base, *amx}) == 3


def test_a_byte_order_is_bounded_printable_text():
    for bad in ("x" * 201, "amx\nblock 32", "amx\x00", "ämx"):
        with pytest.raises(ConfigError, match="byte_order") as e:
            PoolConfig(model_id="m", block_tokens=8, insecure=True, byte_order=bad)
        assert "\n" not in str(e.value)


def test_shapes_the_pool_cannot_serve_are_refused_in_one_line():
    spec = ModelSpec.uniform(2, 4, 8, "bfloat16")
    layout = object_layout(spec, PoolConfig(model_id="m", block_tokens=8, insecure=True))
    for device, why in ((EngineLayout(tp_size=1, block_size=16, num_blocks=4), "does not divide"),
                        (EngineLayout(tp_size=2, dcp_size=2, block_size=8, num_blocks=4), "context-parallel")):
        with pytest.raises(NotCanonicalizable, match=why) as e:
            layout.check_device(device)
        assert "\n" not in str(e.value)
    for bad, why in ((dict(model_id=""), "model id"), (dict(model_id="m", block_tokens=0), "block_tokens"),
                     (dict(model_id="m", block_tokens=8, staging_blocks=0), "staging_blocks")):
        with pytest.raises((ConfigError, NotCanonicalizable), match=why):
            object_layout(spec, PoolConfig(**{"block_tokens": 8, "insecure": True, **bad}))
    for bad, why in ((dict(segment_bytes=1 << 20), "16 MiB"), (dict(protocol="udp"), "protocol"),
                     (dict(master="nohost"), "host:port")):
        with pytest.raises(ConfigError, match=why):
            StoreConfig(**{"master": "h:1", "metadata_url": "http://h:2/metadata", **bad})


def test_state_objects_are_chunks_every_usual_tp_splits_whole():
    """A short conv of 2,048 channels is 32 objects per row, not 2,048; TP 64 would cut inside one
    object and is refused in one line."""
    from kvbridge.pool.objects import state_chunk

    assert [state_chunk(u) for u in (1, 8, 96, 128, 2048, 11)] == [1, 1, 1, 4, 64, 11]
    spec = ModelSpec((LayerSpec("full", 64, 8, 8), _short_conv(128)), "bfloat16")
    layout = object_layout(spec, PoolConfig(model_id="m", block_tokens=8, insecure=True))
    assert len(layout.group_objects[1]) == 2 * 32
    assert [len(w[1]) for w in (layout.written_by(EngineLayout(tp_size=8, block_size=8, num_blocks=4), r)
                                for r in range(8))] == [8] * 8  # 4 of each row's 32 per rank
    with pytest.raises(NotCanonicalizable, match="splits layer 1's state component 0 inside one pool object") as e:
        layout.written_by(EngineLayout(tp_size=64, block_size=8, num_blocks=4), 0)
    assert "\n" not in str(e.value)

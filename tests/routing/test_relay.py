"""The KV event relay over real ZMQ sockets on loopback (issue 45.1, 45.4): an instance's batches
come out re-chunked; a restart, a lost batch or a launcher's `forget` clears the instance at the
router; malformed and oversized input is dropped and counted, never stops the relay."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from kvbridge.routing.events import AllBlocksCleared, BlockStored, KVEventBatch, decode_batch, encode_batch
from kvbridge.routing.relay import EventRelay, RelaySource
from routing.test_rechunk import Instance, names


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def wired():
    ctx = zmq.Context()
    up, out = _port(), f"tcp://127.0.0.1:{_port()}"
    relay = EventRelay([RelaySource("prefill-0", f"tcp://127.0.0.1:{up}", out)], block_tokens=16).start()
    pub = ctx.socket(zmq.PUB)  # as vLLM's publisher does for an endpoint naming a host: it connects
    pub.connect(f"tcp://127.0.0.1:{up}")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(out)
    seq = [0]

    def send(events, at=None, raw=None):
        n = seq[0] if at is None else at
        payload = raw if raw is not None else encode_batch(KVEventBatch(ts=time.time(), events=events))
        pub.send_multipart([b"", n.to_bytes(8, "big"), payload])
        seq[0] = n + 1

    def until(pred, timeout=20.0):
        got, end = [], time.monotonic() + timeout
        while time.monotonic() < end:
            if sub.poll(100):
                got += decode_batch(sub.recv_multipart()[2]).events
                if pred(got):
                    return got
        raise AssertionError(f"relay gave {got}")

    time.sleep(0.5)  # both subscriptions joined (ZMQ's slow joiner)
    yield relay, send, until
    relay.close()
    pub.close(linger=0)
    sub.close(linger=0)
    ctx.term()


def _stored(events):
    return {h: tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size]) for e in events
            if isinstance(e, BlockStored) for i, h in enumerate(e.block_hashes)}


def test_batches_come_out_in_canonical_blocks(wired):
    relay, send, until = wired
    inst = Instance(64)
    prompt = list(range(200))
    send(inst.store(prompt))
    got = until(lambda g: len(_stored(g)) >= 12)
    assert _stored(got) == names(prompt[:192], 16)
    assert relay.stats()["prefill-0"].batches == 1


def test_a_restart_a_gap_and_forget_each_clear_the_instance(wired):
    relay, send, until = wired
    inst = Instance(32)
    send(inst.store(list(range(64))))
    until(lambda g: len(_stored(g)) == 4)
    send(Instance(32).store(list(range(100, 132))), at=0)  # a new process numbers from 0
    got = until(lambda g: any(isinstance(e, AllBlocksCleared) for e in g) and _stored(g))
    assert isinstance(got[0], AllBlocksCleared) and _stored(got) == names(list(range(100, 132)), 16)
    send(Instance(32).store(list(range(300, 332))), at=5)  # batches 1..4 lost
    got = until(lambda g: any(isinstance(e, AllBlocksCleared) for e in g) and _stored(g))
    assert isinstance(got[0], AllBlocksCleared)
    relay.forget("prefill-0")
    until(lambda g: any(isinstance(e, AllBlocksCleared) for e in g))
    s = relay.stats()["prefill-0"]
    assert (s.restarts, s.gaps) == (1, 1) and s.blocks == 0


def test_hostile_input_is_dropped_and_counted(wired):
    relay, send, until = wired
    send([], raw=b"\xc1 not msgpack")
    send([], raw=msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                                 "token_ids": [1, 2, 3], "block_size": 16, "lora_id": None,
                                                 "medium": "GPU", "lora_name": None}]]))
    send([], raw=b"\0" * (17 << 20))  # over the size bound: ZMQ drops it (and the connection) unread
    time.sleep(1.0)
    inst = Instance(16)
    send(inst.store(list(range(32))))
    until(lambda g: len(_stored(g)) == 2)
    s = relay.stats()["prefill-0"]
    assert s.bad == 2 and "BlockStored of 1 blocks of 16 tokens carries 3 token ids" in s.last_bad


def test_the_pools_blocks_are_announced_on_every_instances_stream_and_expire():
    from kvbridge.routing.events import POOL_OWNER, BlockRemoved

    ctx = zmq.Context()
    ups = [_port(), _port()]
    outs = [f"tcp://127.0.0.1:{_port()}" for _ in ups]
    relay = EventRelay([RelaySource(f"prefill-{i}", f"tcp://127.0.0.1:{u}", o) for i, (u, o) in
                        enumerate(zip(ups, outs))], block_tokens=16, pool_ttl_s=3.0).start()
    pubs, subs = [], []
    for u, o in zip(ups, outs):
        pub = ctx.socket(zmq.PUB)
        pub.connect(f"tcp://127.0.0.1:{u}")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(o)
        pubs.append(pub)
        subs.append(sub)
    time.sleep(0.5)
    try:
        pool = Instance(64)  # what instance 0's pool connector stored, as it announces it
        stored = pool.store(list(range(128)))
        for e in stored:
            e.ownership, e.medium = POOL_OWNER, "CPU"
        pubs[0].send_multipart([b"", (0).to_bytes(8, "big"), encode_batch(KVEventBatch(ts=1.0, events=stored))])
        want = names(list(range(128)), 16)
        for sub in subs:  # on both streams, as host memory
            got = []
            end = time.monotonic() + 20
            while len(_stored(got)) < len(want) and time.monotonic() < end:
                if sub.poll(100):
                    got += decode_batch(sub.recv_multipart()[2]).events
            assert _stored(got) == want
            assert all(e.medium == "CPU" and e.ownership is None for e in got if isinstance(e, BlockStored))
        for sub in subs:  # nobody stores them again: withdrawn after the TTL
            got = []
            end = time.monotonic() + 20
            while not got and time.monotonic() < end:
                if sub.poll(100):
                    got += decode_batch(sub.recv_multipart()[2]).events
            assert isinstance(got[0], BlockRemoved) and set(got[0].block_hashes) == set(want)
    finally:
        relay.close()
        for x in pubs + subs:
            x.close(linger=0)
        ctx.term()


def test_a_subscriber_that_joins_late_is_told_everything_announced(wired):
    relay, send, until = wired
    inst = Instance(32)
    send(inst.store(list(range(96))))
    until(lambda g: len(_stored(g)) == 6)
    ctx = zmq.Context.instance()
    late = ctx.socket(zmq.SUB)  # a router restarted after the instance stored
    late.setsockopt(zmq.SUBSCRIBE, b"")
    late.connect(relay._sources[0].spec.publish)
    got, end = [], time.monotonic() + 20
    while len(_stored(got)) < 6 and time.monotonic() < end:
        if late.poll(100):
            got += decode_batch(late.recv_multipart()[2]).events
    late.close(linger=0)
    assert isinstance(got[0], AllBlocksCleared) and _stored(got) == names(list(range(96)), 16)
    assert relay.stats()["prefill-0"].snapshots >= 2


def test_a_port_taken_by_another_process_is_an_error_not_a_hang():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        with pytest.raises(zmq.ZMQError):
            EventRelay([RelaySource("p", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{_port()}")], 16)
    finally:
        taken.close()

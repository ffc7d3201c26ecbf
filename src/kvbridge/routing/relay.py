"""The fleet's KV event relay: every instance's events, re-chunked, on an endpoint of its own.

Each instance publishes its KV events (vLLM's `--kv-events-config`, a ZMQ PUB that *connects*
when its endpoint names a host, as the fleet's do); the relay binds one SUB per instance on an
address of the fleet's (loopback for a fleet of one host: nothing else reads a tenant's tokens), turns its batches into canonical blocks (`rechunk.Rechunker`, one per
instance) and publishes them, in vLLM's wire format, on one PUB endpoint per instance, which the
router reads as that worker's event source (`vllm-router --pd-kv-events URL=ENDPOINT`).

It runs as one thread of the launcher (`Fleet`), so it lives and dies with the fleet. Bounds:
ZMQ drops a frame over `events.MAX_PAYLOAD` before it is read (`MAXMSGSIZE`), at most `HWM`
batches wait per socket, a batch is decoded with bounds (`events.decode_batch`), a bad one is
counted and dropped, and each instance's rechunker remembers at most `max_blocks` blocks.

The shared pool: a pool connector's events (ownership `events.POOL_OWNER`, emitted when it queues
a store) describe blocks every instance can load, so the relay keeps them in one rechunker of its
own and announces them on every instance's stream: as host memory (medium CPU, the router's host
credit) when the pool has a shared-memory tier on this host, else as an external tier (the
router's external credit). Nobody reports what a pool's store evicts, so an announcement lasts
`pool_ttl_s` unless the block is stored again; a block gone meanwhile costs one recompute.

A subscriber that joins late (the router started after the instances, or restarted by the
supervisor; a router whose connection dropped) would learn only what is stored after it joined:
each instance's stream is an XPUB, and on every subscription the relay sends that stream
`AllBlocksCleared` and then every canonical block it announces (`Rechunker.snapshot`) and the
pool's.

Restarts and losses: vLLM numbers its batches from 0 in each process. A number that goes back
means the instance restarted (its cache is empty); a gap means batches were lost (the relay no
longer knows what the instance holds). Either way the relay forgets the instance and publishes
`AllBlocksCleared` for it, so the router never credits it with blocks it may not hold: it is
relearned as the instance stores again. The launcher also calls `forget` when it restarts one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.routing.events import (MAX_PAYLOAD, POOL_OWNER, AllBlocksCleared, BadBatch, BlockRemoved, BlockStored,
                                     Event, KVEventBatch, decode_batch, encode_batch)
from kvbridge.routing.rechunk import DEFAULT_MAX_BLOCKS, Rechunker

logger = logging.getLogger(__name__)
HWM = 10_000
"""Batches that may wait on one socket (vLLM's publisher keeps 100,000)."""
SNAPSHOT_EVENTS = 2048
"""Events per batch of a snapshot (each well under the router's 16 MiB)."""
SNAPSHOT_EVERY_S = 1.0
"""At most one snapshot a second per stream: a subscriber that comes and goes cannot make the relay
resend everything in a loop."""


class RelaySource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One instance: the address the relay binds for its publisher to connect to (`tcp://HOST:PORT`),
    and the one it publishes the instance's canonical events on for the router."""

    name: str
    subscribe: str
    publish: str
    topic: str = ""


@dataclass
class SourceStats:
    batches: int = 0
    published: int = 0
    bad: int = 0
    restarts: int = 0
    gaps: int = 0
    last_seq: int = -1
    blocks: int = 0
    last_bad: str = ""
    forgotten: int = 0
    snapshots: int = 0


@dataclass
class _Source:
    spec: RelaySource
    sub: zmq.Socket
    pub: zmq.Socket
    monitor: zmq.Socket
    rechunker: Rechunker
    stats: SourceStats = field(default_factory=SourceStats)
    out_seq: int = 0
    forget: bool = False
    snapshot_due: bool = False
    snapshot_at: float = 0.0


class EventRelay:
    """Relays every source's events in `block_tokens`-token blocks (see the module)."""

    def __init__(self, sources: Sequence[RelaySource], block_tokens: int, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 pool_tier: str = "host", pool_ttl_s: float = 600.0):
        if not sources:
            raise ValueError("a KV event relay needs at least one source")
        if pool_tier not in ("host", "external"):
            raise ValueError(f"pool_tier must be host or external, got {pool_tier!r}")
        self.block_tokens, self.pool_tier, self.pool_ttl_s = block_tokens, pool_tier, pool_ttl_s
        self._pool = Rechunker(block_tokens, max_blocks)
        self._pool_live: dict[bytes, BlockStored] = {}  # announced pool blocks, to replay after a clear
        self._expired_at = 0.0
        self._ctx = zmq.Context()
        self._sources: list[_Source] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._added: list[_Source] = []  # sources added while running, for the loop to poll
        self._max_blocks = max_blocks
        try:
            for s in sources:
                self._sources.append(self._open(s, block_tokens, max_blocks))
        except BaseException:
            self.close()
            raise

    def _open(self, s: RelaySource, block_tokens: int, max_blocks: int) -> _Source:
        sub = self._ctx.socket(zmq.SUB)
        pub = self._ctx.socket(zmq.XPUB)
        try:
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD + 4096)
            sub.setsockopt(zmq.RCVHWM, HWM)
            sub.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sub.bind(s.subscribe)
            pub.setsockopt(zmq.SNDHWM, HWM)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a re-subscription too, is told
            pub.bind(s.publish)
        except BaseException:  # the monitor too: an open socket makes the context's term() wait forever
            with contextlib.suppress(zmq.ZMQError, UnboundLocalError):
                sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            pub.close(linger=0)
            raise
        return _Source(s, sub, pub, monitor, Rechunker(block_tokens, max_blocks))

    def add(self, source: RelaySource) -> None:
        """One more instance (a fleet that grows): bound now, polled from the loop's next turn."""
        opened = self._open(source, self.block_tokens, self._max_blocks)
        with self._lock:
            self._added.append(opened)

    # -- life -------------------------------------------------------------------------------------------
    def start(self) -> EventRelay:
        self._thread = threading.Thread(target=self._run, name="kvbridge-kv-relay", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
            if self._thread.is_alive():  # its sockets are its own while it runs: left to the process's end
                logger.warning("KV event relay: its thread did not stop within 30 s")
                return
        for s in self._sources + self._added:
            s.sub.disable_monitor()
            s.monitor.close(linger=0)
            s.sub.close(linger=0)
            s.pub.close(linger=0)
        self._ctx.term()

    def forget(self, name: str) -> None:
        """The instance `name` restarted (its cache is empty): cleared at the router, relearned."""
        with self._lock:
            for s in self._sources + self._added:
                if s.spec.name == name:
                    s.forget = True

    def stats(self) -> dict[str, SourceStats]:
        with self._lock:
            for s in self._sources:
                s.stats.blocks, s.stats.forgotten = len(s.rechunker), s.rechunker.forgotten
            return {s.spec.name: SourceStats(**vars(s.stats)) for s in self._sources}

    # -- the loop ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket, by_monitor, by_pub = {}, {}, {}
        for s in self._sources:
            poller.register(s.sub, zmq.POLLIN)
            poller.register(s.monitor, zmq.POLLIN)
            poller.register(s.pub, zmq.POLLIN)
            by_socket[s.sub], by_monitor[s.monitor], by_pub[s.pub] = s, s, s
        while not self._stop.is_set():
            with self._lock:
                added, self._added = self._added, []
            for s in added:
                self._sources.append(s)
                poller.register(s.sub, zmq.POLLIN)
                poller.register(s.monitor, zmq.POLLIN)
                poller.register(s.pub, zmq.POLLIN)
                by_socket[s.sub], by_monitor[s.monitor], by_pub[s.pub] = s, s, s
            for s in self._sources:
                if s.forget:
                    with self._lock:
                        self._clear(s, "restarted")
                if s.snapshot_due and time.monotonic() >= s.snapshot_at:
                    with self._lock:
                        self._snapshot(s)
            if time.monotonic() - self._expired_at > 1.0:
                self._expired_at = time.monotonic()
                with self._lock:
                    self._fan_out(self._pool.expire(self.pool_ttl_s))
            try:
                ready = dict(poller.poll(200))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            for sock in ready:
                if sock in by_monitor:
                    self._reconnect(by_monitor[sock])
                    continue
                if sock in by_pub:
                    self._joined(by_pub[sock])
                    continue
                s = by_socket[sock]
                for _ in range(64):  # a busy instance cannot starve the others
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._relay(s, frames)
                    except Exception as exc:  # never let one instance's input stop the relay
                        s.stats.bad += 1
                        s.stats.last_bad = f"{type(exc).__name__}: {str(exc)[:160]}"

    def _relay(self, s: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            raise BadBatch(f"expected [topic, seq, payload], got {len(frames)} frames")
        seq = int.from_bytes(frames[1], "big")
        batch = decode_batch(frames[2])
        with self._lock:
            last = s.stats.last_seq
            if last >= 0 and seq <= last:
                s.stats.restarts += 1
                self._clear(s, f"sequence went back from {last} to {seq}: restarted")
            elif last >= 0 and seq > last + 1:
                s.stats.gaps += 1
                self._clear(s, f"batches {last + 1}..{seq - 1} lost")
            s.stats.last_seq = seq
            s.stats.batches += 1
            pooled = [e for e in batch.events if isinstance(e, (BlockStored, BlockRemoved)) and e.ownership == POOL_OWNER]
            try:
                events = s.rechunker.apply([e for e in batch.events if not (
                    isinstance(e, (BlockStored, BlockRemoved)) and e.ownership == POOL_OWNER)])
                if pooled:
                    self._fan_out(self._pool.apply(pooled))
            except Exception:  # part of it applied, its output lost: the router would keep stale credit
                self._clear(s, "sent a batch that could not be applied")
                raise
            cleared = any(isinstance(e, AllBlocksCleared) for e in events)
        if events:
            self._publish_all(s, events)
        if cleared:  # the router drops the pool's blocks too
            with self._lock:
                self._publish_all(s, list(self._pool_live.values()))

    def _joined(self, s: _Source) -> None:
        """A subscriber (un)subscribed on the instance's stream: on a subscription, tell it all."""
        subscribed = False
        while True:
            try:
                frame = s.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            subscribed |= frame[:1] == b"\x01"
        if subscribed:
            s.snapshot_due = True  # sent by the loop, at most once a second

    def _snapshot(self, s: _Source) -> None:
        """Tell the stream's subscribers all: a clear, then every block, in batches of bounded size."""
        s.snapshot_due, s.snapshot_at = False, time.monotonic() + SNAPSHOT_EVERY_S
        s.stats.snapshots += 1
        self._publish(s, KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        self._publish_all(s, [*s.rechunker.snapshot(), *self._pool_live.values()])

    def _publish_all(self, s: _Source, events: list[Event]) -> None:
        for i in range(0, len(events), SNAPSHOT_EVENTS):
            self._publish(s, KVEventBatch(ts=time.time(), events=events[i:i + SNAPSHOT_EVENTS]))

    def _reconnect(self, s: _Source) -> None:
        """The instance's connection dropped (it exited, or sent a frame over `MAXMSGSIZE`, which ZMQ
        refuses by closing the connection): its publisher connects again by itself; batches may have
        been lost meanwhile, so the instance is forgotten."""
        while s.monitor.poll(0):
            recv_monitor_message(s.monitor)
        with self._lock:
            s.stats.last_seq = -1
            self._clear(s, "disconnected")

    def _clear(self, s: _Source, why: str) -> None:
        """Forget the instance at the router; the pool's blocks, which a clear also drops there, are
        announced to it again."""
        logger.info("KV event relay: %s %s; cleared at the router", s.spec.name, why)
        s.rechunker.clear()
        s.forget = False
        self._publish(s, KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        self._publish_all(s, list(self._pool_live.values()))

    def _fan_out(self, events: list[Event]) -> None:
        """The pool's canonical events, as the tier the pool is, on every instance's stream."""
        if not events:
            return
        owner = None if self.pool_tier == "host" else POOL_OWNER
        marked: list[Event] = []
        for e in events:
            if isinstance(e, BlockStored):
                e.ownership, e.medium = owner, "CPU"
                k = e.block_size
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):  # one per block: a clear replays what is still live
                    self._pool_live[h] = BlockStored([h], parent, e.token_ids[i * k:(i + 1) * k], k, None, "CPU",
                                                     e.lora_name, None if e.extra_keys is None else [e.extra_keys[i]],
                                                     ownership=owner)
                    parent = h
            elif isinstance(e, BlockRemoved):
                e.ownership, e.medium = owner, "CPU"
                for h in e.block_hashes:
                    self._pool_live.pop(h, None)
            marked.append(e)
        for s in self._sources:
            self._publish_all(s, marked)

    def _publish(self, s: _Source, batch: KVEventBatch) -> None:
        try:
            s.pub.send_multipart([s.spec.topic.encode(), s.out_seq.to_bytes(8, "big"), encode_batch(batch)],
                                 zmq.NOBLOCK)
        except zmq.Again:  # nobody reads fast enough: the router sees a gap (its own reconnect path)
            pass
        s.out_seq += 1
        s.stats.published += 1


__all__ = ["HWM", "EventRelay", "RelaySource", "SourceStats"]

"""One rank's client of a Mooncake Store: batched zero-copy puts and gets between registered host
memory and objects, with Mooncake's status codes turned into per-object outcomes.

Mooncake semantics this relies on (measured with its 0.3.13 wheel, docs/pool.md): an object is
visible only once its put completed; a put of an existing key leaves the object as it is and
reports success (first writer wins); a get whose buffers do not add up to the object's size
fails without writing past them; a full store evicts whole objects; a restarted master has no
objects and clients re-register by themselves. A failed call is an outcome, never an exception:
a load that cannot read recomputes, a store that cannot write is skipped.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from kvbridge.errors import ConfigError, KVBridgeError

MAX_BATCH = 4096
"""Objects per Mooncake call (larger requests are split)."""
MAX_RUNS = 2048
"""Buffer runs per Mooncake call: each is a transfer task, and Mooncake's TCP transport rejects
tasks beyond its lane queue ("queue-full"), failing the whole batch (seen with vLLM CPU's
transposed K: 34 runs per object, 64 blocks of 12 objects in one call)."""

RPC_FAIL = -900
"""Mooncake's code for a call the master did not answer (also what a dead master's calls return)."""
RPC_CODES = (RPC_FAIL, -901)
"""Codes of calls the master did not answer: -900 at once when it is gone, -901 after Mooncake's
30 s RPC timeout when it is stopped."""

MAX_UNREADABLE = 1 << 16
"""Names a client remembers as listed by the master but unreadable (oldest forgotten first)."""

MIN_SEGMENT_BYTES = 16 << 20
"""Smallest segment a Mooncake client may lend (0.3.13 refuses less with code -600)."""

Pieces = Sequence[tuple[int, int]]
"""(address, length) runs of registered memory that make one object, in order."""


class PoolUnavailable(KVBridgeError, RuntimeError):
    """The store cannot be reached or refused this client (one line: address and Mooncake's code)."""


P2P_METADATA = "P2PHANDSHAKE"
"""Mooncake's metadata by direct handshake between clients: the master needs no metadata server
(Mooncake's own HTTP one binds every interface whatever it is told, so kvbridge does not start it)."""


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the store is and what this client brings to it.

    `metadata_url` is `P2PHANDSHAKE` (default) or the http URL of a metadata server.
    `segment_bytes` is host memory this client lends to the pool (0: it only reads and writes
    others' memory); `local_buffer_bytes` is Mooncake's own staging for non-registered copies.
    `local_memcpy` lets Mooncake copy in memory when an object's replica is in this client's own
    segment instead of going through its transport (`MC_STORE_MEMCPY`, process-wide, read when a
    client is set up; on by default in Mooncake 0.3.13 too, made explicit here); `prefer_own_segment`
    asks the master to place this client's puts in its own segment while it has room (else
    anywhere, as without it), so that they and the rank's own reloads take that path: with four
    lending clients, 1.2x faster puts and 3-4x faster reloads measured here (docs/pool.md).
    """

    master: str
    metadata_url: str = P2P_METADATA
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_bytes: int = 64 << 20
    local_buffer_bytes: int = 16 << 20
    local_memcpy: bool = True
    prefer_own_segment: bool = True

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"pool protocol must be 'tcp' or 'rdma', got {self.protocol[:40]!r}")
        for name in ("segment_bytes", "local_buffer_bytes"):
            v = getattr(self, name)
            if not 0 <= v <= 1 << 44:
                raise ConfigError(f"pool {name} must be in [0, 16 TiB], got {v}")
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ConfigError(f"pool segment_bytes must be 0 (lend no memory) or at least 16 MiB (Mooncake refuses "
                              f"smaller segments), got {self.segment_bytes}")
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or not (
                self.metadata_url == P2P_METADATA or self.metadata_url.startswith(("http://", "https://"))):
            raise ConfigError(f"pool master must be host:port and metadata_url {P2P_METADATA} or an http URL, got "
                              f"{self.master[:80]!r} and {self.metadata_url[:80]!r}")


class StoreClient:
    """A `MooncakeDistributedStore` set up for one rank; `register` memory before moving it.

    Every call but the constructor releases the GIL while it waits for the master, so it may run
    on a thread beside an engine; the constructor refuses at once when the master does not accept
    connections (Mooncake would retry for 90 s), and holds the GIL while an accepting but stopped
    master does not answer: build one client per process, once, and keep it."""

    def __init__(self, config: StoreConfig):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(f"the pool needs the Mooncake wheel (`pip install 'kvbridge[mooncake]'`): {e}") from None
        self.config = config
        # Objects the master lists at their size that this client could not read: their replica
        # is in a dead or unreachable client's memory until the master drops that client (its
        # TTL). A store of this client replaces them rather than skipping them as present.
        self._unreadable: OrderedDict[str, None] = OrderedDict()
        self._unreadable_lock = threading.Lock()  # a rank's load and store threads share the client
        if not reachable(config.master):  # Mooncake would retry for 90 s before saying so
            raise PoolUnavailable(f"Mooncake Store master {config.master} does not accept connections")
        from mooncake.store import ReplicateConfig

        memcpy = "1" if config.local_memcpy else "0"
        if os.environ.get("MC_STORE_MEMCPY") != memcpy:  # set by `prepare_process` on the engine's thread
            os.environ["MC_STORE_MEMCPY"] = memcpy  # a process of kvbridge's own (tests, benches)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup({"local_hostname": config.local_hostname, "metadata_server": config.metadata_url,
                                "global_segment_size": config.segment_bytes,
                                "local_buffer_size": config.local_buffer_bytes, "protocol": config.protocol,
                                "rdma_devices": config.rdma_devices, "master_server_addr": config.master})
        if rc != 0:
            self._store.close()
            raise PoolUnavailable(f"Mooncake Store at {config.master} refused this client (setup code {rc})")
        self._put_config = ReplicateConfig()
        if config.prefer_own_segment and config.segment_bytes:
            self._put_config.preferred_segment = self._store.get_hostname()
        self._registered: list[tuple[int, int]] = []
        self.closed = False
        self._per_thread = threading.local()

    @property
    def unreachable(self) -> int:
        """Calls the master did not answer, made by the calling thread: a rank's load and store
        threads share the client, and one's failed call must not fail the other's good one. The
        client itself is kept: Mooncake's clients find a restarted master by themselves, and
        building a new one (`setup`) holds Python's GIL for as long as a stopped master does not
        answer, which would stop every thread of an engine."""
        return getattr(self._per_thread, "unreachable", 0)

    def _count_unreachable(self, n: int = 1) -> None:
        self._per_thread.unreachable = self.unreachable + n

    def register(self, address: int, nbytes: int) -> None:
        """Make `[address, address + nbytes)` usable as put source and get destination (until
        `unregister`: memory must stay registered no longer than it lives)."""
        if nbytes <= 0 or (address, nbytes) in self._registered:
            return
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise PoolUnavailable(f"Mooncake refused to register {nbytes} bytes at {address:#x} (code {rc})")
        self._registered.append((address, nbytes))

    def unregister(self, address: int, nbytes: int) -> None:
        if (address, nbytes) in self._registered and not self.closed:
            self._store.unregister_buffer(address)
            self._registered.remove((address, nbytes))

    def _check(self, pieces: Sequence[Pieces]) -> None:
        spans = sorted(self._registered)
        starts = [a for a, _ in spans]
        for runs in pieces:
            for addr, n in runs:
                i = bisect.bisect_right(starts, addr) - 1
                if i < 0 or addr + n > spans[i][0] + spans[i][1] or n < 0:
                    raise KVBridgeError(f"pool run {addr:#x}+{n} is outside this client's registered memory")

    def put(self, keys: Sequence[str], pieces: Sequence[Pieces]) -> list[int]:
        """Put each object from its runs; Mooncake's code per object (0: stored or already there)."""
        return self._batched(lambda k, a, n: self._store.batch_put_from_multi_buffers(k, a, n, self._put_config),
                             keys, pieces)

    def get(self, keys: Sequence[str], pieces: Sequence[Pieces]) -> list[int]:
        """Read each object into its runs; the object's size per object on success, < 0 on failure."""
        return self._batched(self._store.batch_get_into_multi_buffers, keys, pieces)

    def _batched(self, call, keys: Sequence[str], pieces: Sequence[Pieces]) -> list[int]:
        if len(keys) != len(pieces):
            raise KVBridgeError(f"{len(keys)} pool keys but {len(pieces)} run lists")
        self._check(pieces)
        out: list[int] = []
        start = 0
        while start < len(keys):
            stop, runs = start, 0
            while stop < len(keys) and stop - start < MAX_BATCH and (stop == start or runs + len(pieces[stop]) <= MAX_RUNS):
                runs += len(pieces[stop])
                stop += 1
            ks, ps = list(keys[start:stop]), pieces[start:stop]
            try:
                codes = call(ks, [[a for a, _ in p] for p in ps], [[n for _, n in p] for p in ps])
            except RuntimeError:  # the binding raises when the master cannot be reached at all
                codes = [RPC_FAIL] * len(ks)
            codes = [int(c) for c in codes]
            self._count_unreachable(any(c in RPC_CODES for c in codes))
            out += codes
            start = stop
        return out

    def exists(self, keys: Sequence[str]) -> list[bool | None]:
        """Per key: True, False, or None when the store could not answer."""
        out: list[bool | None] = []
        for i in range(0, len(keys), MAX_BATCH):
            try:
                codes = self._store.batch_is_exist(list(keys[i:i + MAX_BATCH]))
            except RuntimeError:
                codes = [RPC_FAIL] * len(keys[i:i + MAX_BATCH])
            answer = [True if c == 1 else False if c == 0 else None for c in codes]
            self._count_unreachable(None in answer)
            out += answer
        return out

    def sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Per key its object's size in bytes, or None when it is missing or the store did not
        answer: one call per `MAX_BATCH` keys (a dead writer's chunk is thousands of them)."""
        out: list[int | None] = []
        for i in range(0, len(keys), MAX_BATCH):
            batch = list(keys[i:i + MAX_BATCH])
            try:
                found = self._store.batch_get_replica_desc(batch)
            except RuntimeError:
                self._count_unreachable()
                found = {}
            out += [_replica_size(found.get(k)) for k in batch]
        return out

    def note_unreadable(self, keys: Sequence[str]) -> None:
        """Remember `keys` as listed by the master but unreadable here (bounded: `MAX_UNREADABLE`)."""
        with self._unreadable_lock:
            for k in keys:
                self._unreadable[k] = None
                self._unreadable.move_to_end(k)
            while len(self._unreadable) > MAX_UNREADABLE:
                self._unreadable.popitem(last=False)

    def take_unreadable(self, keys: Sequence[str]) -> list[str]:
        """Those of `keys` noted unreadable, forgotten now (the caller replaces them)."""
        if not self._unreadable:  # nearly always: every load asks, and a dead writer is rare
            return []
        with self._unreadable_lock:
            return [k for k in keys if self._unreadable.pop(k, 0) is None]

    def answers(self) -> bool:
        """Whether the master answers a call now (one existence check: the breakers' probe)."""
        return self.exists(["kvb2/probe"])[0] is not None

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove each object even if a reader holds its lease (0: removed); -900 when unreachable."""
        try:
            return [int(c) for c in self._store.batch_remove(list(keys), True)] if keys else []
        except RuntimeError:
            self._count_unreachable()
            return [RPC_FAIL] * len(keys)

    def healthy(self) -> bool:
        return not self.closed and self._store.health_check() == 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._store.close()


def prepare_process(config: StoreConfig) -> None:
    """Set what Mooncake reads from the environment when a client is set up (`MC_STORE_MEMCPY`),
    from the engine's own thread at the connector's start: glibc's `setenv` is not thread-safe,
    and clients are built later on pool threads beside the engine's."""
    os.environ["MC_STORE_MEMCPY"] = "1" if config.local_memcpy else "0"


def _replica_size(replicas) -> int | None:
    """An object's size from its replica descriptors (`batch_get_replica_desc`), None if none."""
    for r in replicas or ():
        try:
            if r.is_memory_replica():
                return int(r.get_memory_descriptor().buffer_descriptor.size)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue
    return None


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether `host:port` accepts a TCP connection within `timeout` (a master that is down
    refuses at once; one that is stopped still accepts: its calls then need a deadline)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def close_all(clients: Sequence[StoreClient]) -> None:
    """Close clients side by side: Mooncake's close waits a second or two for its own threads."""
    import threading

    threads = [threading.Thread(target=c.close) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


__all__ = ["MAX_BATCH", "P2P_METADATA", "close_all", "prepare_process", "Pieces", "PoolUnavailable", "StoreClient", "StoreConfig",
           "reachable"]

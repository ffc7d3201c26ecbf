"""The pool's host tier: one shared-memory arena per object class, mapped by every engine of a host.

Why: between two processes on one host, Mooncake 0.3.13 moves every byte through its TCP
transport (0.02-0.08 of a copy, docs/pool.md). Here a store seals objects straight into shared
memory and a load opens them straight out of it, so a block stored by one engine is a memory
copy away from every other engine of the host, whatever its shape; Mooncake stays the tier
across hosts.

Shape. An arena is one file in a private tmpfs directory (`/dev/shm/kvbridge-UID/pool`), made
once at its full size with `posix_fallocate` (a full tmpfs refuses it at once; pages written
through a map past a full tmpfs would kill the engine with SIGBUS) and mapped by each engine.
It holds `slots` pool blocks of one KV-cache group: a slot is every object of the block at its
canonical offset, each object its sealed bytes (`pool.seal`). Per slot the header keeps the
block's name (20 bytes), a generation (bumped when the slot is given to another block), an LRU
tick, a writer's lease and two bitmaps: objects present and objects being written.

Concurrency. Every change of the header is made under `flock` on the arena (released by the
kernel when a holder dies); bytes are written and read without it:
* a writer claims a block's slot (a lease: not evicted while it writes; an expired lease is
  taken over), claims the objects nobody holds or is writing, seals them in place, and publishes
  them (present) only if the slot is still its block's generation;
* a reader finds slots whose objects it needs are all present, opens them, and trusts what it
  opened only if the generation did not change meanwhile. Torn or foreign bytes cannot pass:
  each object's AEAD tag covers its name and bytes, and a reader removes an object that fails it.
So a starved writer or reader costs a miss, never wrong KV.

Eviction: the least recently used slot whose lease has expired (ticks from a counter in the
header). Names are the pool's keyed block names; the arena's file name is keyed by the secret
too, so fleets of one user with other secrets never share (or evict) each other's arenas.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import struct
import stat
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import ConfigError

MAGIC = b"KVBHOST1"
_HEAD = struct.Struct("<8sIIQQQ")  # magic, version, objects per slot, slot bytes, slots, tick
PAGE = mmap.PAGESIZE
LEASE_S = 30.0
"""How long a writer's claim keeps its slot from eviction; a writer starved past it may lose the
slot (its bytes then fail their tags: a miss). Generous, as writes take milliseconds."""
MAX_SLOTS = 1 << 22


def arena_dir() -> str:
    """This user's private directory of host arenas on tmpfs (`transport.private_dir` rules)."""
    from kvbridge.transport.private_dir import private_dir

    base = private_dir(f"/dev/shm/kvbridge-{os.geteuid()}")
    return private_dir(os.path.join(base, "pool"))


def arena_name(secret: bytes, namespace: str, group: int, object_bytes: Sequence[int]) -> str:
    """The file of one group's arena: keyed by the secret, so another fleet's is another file."""
    from kvbridge.pool.seal import mac_key

    h = hashlib.blake2b(digest_size=16, key=mac_key(secret) if secret else b"", person=b"kvbridge-host")
    h.update(f"{namespace}\0{group}\0{','.join(map(str, object_bytes))}".encode())
    return f"arena-{h.hexdigest()}"


@dataclass
class Claim:
    """A writer's hold on one block's slot: the objects (indices) it must write."""

    slot: int
    gen: int
    objects: list[int]


class HostArena:
    """One group's arena (see the module). `object_bytes`: each object's sealed size, in order."""

    def __init__(self, path: str, object_bytes: Sequence[int], capacity: int):
        self.path = path
        self.object_bytes = np.asarray(object_bytes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.object_bytes)[:-1]]).astype(np.int64)
        self.nobj = len(self.object_bytes)
        self.slot_bytes = int(self.object_bytes.sum())
        if self.nobj == 0 or self.slot_bytes == 0:
            raise ConfigError("a host arena needs objects of at least one byte")
        self.bits = (self.nobj + 7) // 8
        slots = min(MAX_SLOTS, capacity // self.slot_bytes)
        if slots < 1:
            raise ConfigError(f"host tier of {capacity} bytes holds no pool block of {self.slot_bytes} bytes")
        self._threads = threading.Lock()
        self.fd = self._open_or_create(slots)
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(self.fd)
            raise ConfigError(f"{path} is not a regular file of this user's (a host_dir other users can write?): "
                              f"the host tier will not map it")
        size = st.st_size
        # Populated at once: an engine maps its arena at start, and a page first touched in a store
        # or load would cost a fault each (a third of a copy's time, measured).
        self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        magic, _, nobj, slot_bytes, self.slots, _ = _HEAD.unpack_from(self._map, 0)
        if magic != MAGIC or nobj != self.nobj or slot_bytes != self.slot_bytes or not 0 < self.slots <= MAX_SLOTS:
            self.close()
            raise ConfigError(f"{path} is not a host arena of {self.nobj} objects in {self.slot_bytes}-byte slots: "
                              f"remove it")
        n, at = self.slots, PAGE
        self._names, at = self._array(at, (n, 3), np.uint64)
        self._gen, at = self._array(at, (n,), np.uint64)
        self._tick, at = self._array(at, (n,), np.uint64)
        self._lease, at = self._array(at, (n,), np.float64)
        self._present, at = self._array(at, (n, self.bits), np.uint8)
        self._writing, at = self._array(at, (n, self.bits), np.uint8)
        self._clock = np.frombuffer(self._map, dtype=np.uint64, count=1, offset=_HEAD.size - 8)
        self._data = _align(at)
        if self._data + n * self.slot_bytes > size:
            self.close()
            raise ConfigError(f"{path} is shorter than its header says: remove it")
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.size = size

    # -- files ----------------------------------------------------------------------------------------
    def _layout_bytes(self, slots: int) -> int:
        head = PAGE + slots * (24 + 8 + 8 + 8 + 2 * self.bits) + 64
        return _align(head) + slots * self.slot_bytes

    def _open_or_create(self, slots: int) -> int:
        """The arena's fd: an existing one as it is, or a new one made whole under a temporary
        name and linked into place (a racing creator's link fails; its file is dropped)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        tmp = f"{self.path}.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            size = self._layout_bytes(slots)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ConfigError(f"the host tier cannot reserve {size >> 20} MiB in {os.path.dirname(self.path)} "
                                  f"({e.strerror or e}): lower its size or enlarge /dev/shm") from None
            os.pwrite(fd, _HEAD.pack(MAGIC, 1, self.nobj, self.slot_bytes, slots, 0), 0)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                os.close(fd)
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            return fd
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)

    def _array(self, at: int, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, int]:
        count = int(np.prod(shape))
        arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=at).reshape(shape)
        return arr, at + count * np.dtype(dtype).itemsize

    @contextmanager
    def _locked(self):
        """Other processes (`flock`) and this process's other threads: a `flock` is per open
        file, and the tiers of one process share this arena's (`open_arena`)."""
        with self._threads:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _next_tick(self) -> int:
        self._clock[0] += 1
        return int(self._clock[0])

    # -- lookups --------------------------------------------------------------------------------------
    def _find(self, names: np.ndarray) -> np.ndarray:
        """Slot of each name (rows of 3 uint64), -1 where none; under the lock."""
        out = np.full(len(names), -1, dtype=np.int64)
        if not len(names):
            return out
        first = self._names[:, 0]
        for i, row in enumerate(names):
            hit = np.flatnonzero(first == row[0])
            for s in hit:
                if (self._names[s] == row).all():
                    out[i] = s
                    break
        return out

    def _mask(self, objects: Sequence[int]) -> np.ndarray:
        m = np.zeros(self.bits, dtype=np.uint8)
        idx = np.asarray(objects, dtype=np.int64)
        np.bitwise_or.at(m, idx >> 3, (1 << (idx & 7)).astype(np.uint8))
        return m

    def present(self, names: Sequence[bytes], objects: Sequence[Sequence[int]]) -> list[tuple[int, int] | None]:
        """Per block: (slot, generation) when every object of `objects[i]` is present, else None.
        Marks them used (LRU)."""
        rows = _rows(names)
        masks = [self._mask(o) for o in objects]
        out: list[tuple[int, int] | None] = []
        with self._locked():
            slots = self._find(rows)
            tick = self._next_tick()
            for s, m in zip(slots, masks):
                if s >= 0 and ((self._present[s] & m) == m).all():
                    self._tick[s] = tick
                    out.append((int(s), int(self._gen[s])))
                else:
                    out.append(None)
        return out

    def still(self, slot: int, gen: int) -> bool:
        """Whether `slot` still holds the block it held at generation `gen` (after reading it)."""
        return int(self._gen[slot]) == gen

    def view(self, slot: int, obj: int) -> np.ndarray:
        """Object `obj`'s sealed bytes in `slot` (the map itself: no copy)."""
        at = self._data + slot * self.slot_bytes + int(self.offsets[obj])
        return self._buf[at:at + int(self.object_bytes[obj])]

    def address(self, slot: int, obj: int) -> int:
        return self.base + self._data + slot * self.slot_bytes + int(self.offsets[obj])

    # -- writes ---------------------------------------------------------------------------------------
    def claim(self, names: Sequence[bytes], objects: Sequence[Sequence[int]]) -> list[Claim | None]:
        """Per block, the slot to write `objects[i]` into and which of them nobody holds or is
        writing (None: no slot free of a writer's lease). A block's slot is kept; a new one is a
        free slot or the least recently used whose lease expired."""
        rows = _rows(names)
        out: list[Claim | None] = []
        now = time.monotonic()
        with self._locked():
            slots = self._find(rows)
            tick = self._next_tick()
            for row, s, objs in zip(rows, slots, objects):
                if s < 0:
                    s = self._evict(now)
                    if s < 0:
                        out.append(None)
                        continue
                    self._names[s] = row
                    self._gen[s] += 1
                    self._present[s] = 0
                    self._writing[s] = 0
                elif self._lease[s] < now:
                    self._writing[s] = 0  # a writer that held objects past its lease lost them
                held = self._present[s] | self._writing[s]
                mine = [o for o in objs if not held[o >> 3] & (1 << (o & 7))]
                if mine:
                    self._writing[s] |= self._mask(mine)
                    self._lease[s] = now + LEASE_S
                self._tick[s] = tick
                out.append(Claim(int(s), int(self._gen[s]), mine))
        return out

    def _evict(self, now: float) -> int:
        free = np.flatnonzero(self._lease < now)
        if not len(free):
            return -1
        return int(free[np.argmin(self._tick[free])])

    def publish(self, claims: Sequence[Claim | None], written: Sequence[Sequence[int]] | None = None) -> int:
        """End the claims: `written[i]` (default: all of claim i's objects) become present where
        the slot is still the claim's block; the rest are released. Returns objects published."""
        done = 0
        with self._locked():
            for i, c in enumerate(claims):
                if c is None or not c.objects or int(self._gen[c.slot]) != c.gen:
                    continue
                self._writing[c.slot] &= ~self._mask(c.objects)
                ok = c.objects if written is None else written[i]
                if len(ok):
                    self._present[c.slot] |= self._mask(ok)
                    done += len(ok)
                if not self._writing[c.slot].any():
                    self._lease[c.slot] = 0.0
        return done

    def remove(self, slot: int, gen: int, objects: Sequence[int]) -> None:
        """Forget `objects` of `slot` if it is still generation `gen` (they failed their tags)."""
        with self._locked():
            if int(self._gen[slot]) == gen:
                self._present[slot] &= ~self._mask(objects)

    def close(self) -> None:
        for attr in ("_buf", "_names", "_gen", "_tick", "_lease", "_present", "_writing", "_clock"):
            if hasattr(self, attr):
                delattr(self, attr)  # views into the map go before it can close
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view: the map goes with it
                pass
            self._map = None
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _rows(names: Sequence[bytes]) -> np.ndarray:
    """20-byte block names as rows of three uint64 (zero-padded)."""
    if not names:
        return np.zeros((0, 3), dtype=np.uint64)
    raw = b"".join(n[:20].ljust(24, b"\0") for n in names)
    return np.frombuffer(raw, dtype=np.uint64).reshape(len(names), 3)


_mapped: dict[str, list] = {}  # path -> [arena, users]: one map per arena and process
_mapped_lock = threading.Lock()


def _forget_mapped() -> None:
    """In a forked child: its own maps and locks (a `flock` is per open file, so an inherited fd
    would not exclude the parent)."""
    _mapped.clear()


os.register_at_fork(after_in_child=_forget_mapped)


def open_arena(path: str, object_bytes: Sequence[int], capacity: int) -> HostArena | None:
    """The arena at `path`, mapped once per process however many tiers use it (a rank's load and
    store tiers, the scheduler's index: each map is populated at once), or None (with the reason
    logged) where this host cannot give it: the tier is a cache, so an engine without it still
    serves through Mooncake. Each caller gives it back with `release_arena`."""
    import logging

    with _mapped_lock:
        held = _mapped.get(path)
        if held is not None:
            held[1] += 1
            return held[0]
        try:
            arena = HostArena(path, object_bytes, capacity)
        except (ConfigError, OSError) as e:
            msg = str(e) if isinstance(e, ConfigError) else f"{path}: {os.strerror(e.errno or errno.EIO)}"
            logging.getLogger("kvbridge.pool").warning("the pool's host tier is off: %s", msg)
            return None
        _mapped[path] = [arena, 1]
        return arena


def release_arena(arena: HostArena) -> None:
    """One user of `arena` fewer; the last one unmaps it."""
    with _mapped_lock:
        held = _mapped.get(arena.path)
        if held is None or held[0] is not arena:
            return
        held[1] -= 1
        if held[1]:
            return
        del _mapped[arena.path]
    arena.close()


__all__ = ["Claim", "HostArena", "LEASE_S", "arena_dir", "arena_name", "open_arena", "release_arena"]

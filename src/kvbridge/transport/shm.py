"""Shared-memory transport: agents that are processes on one host.

Regions live in POSIX shared memory: files under /dev/shm, one per rank cache
(`allocate_shared`), mapped `MAP_SHARED` and wrapped as torch tensors. An agent's metadata names
each region's segment (by file name in /dev/shm, never a path) and offset; `connect` maps the
peer's segments, so a transfer is the compiled
run copier (`copy.copy_runs`) between this process's regions and its mappings of the peer's:
reads copy remote -> local, writes local -> remote. The copy runs on a worker thread (in pieces
of at most 64 MiB, so an abort waits for one piece at most); `submit` returns at once.
Notifications go through the agent's ZMQ channel after the copy finished.

Cleanup: a segment's file is unlinked when its owner calls `release_shared`, when the transport
that registered it closes (mappings stay valid until the tensors die), at interpreter exit, and
-- after a crash -- by the next `allocate_shared` on the host, which unlinks every kvbridge
segment whose owning process (its pid and PID namespace are in the file name:
`kvbridge-PID-nsINODE-TAG-HEX`) no longer exists; segments of other PID namespaces are spared.

A peer on another host, or whose process exited, fails transfers with that reason.

Peer metadata is untrusted (docs/security.md): `connect` maps only files named like a segment
kvbridge creates (`kvbridge-PID-TAG-HEX` in /dev/shm), opened with `O_NOFOLLOW`, regular, with
one link, owned by this user and of exactly the size the peer registered, and only when every
region the peer describes lies inside its segment; a name of this agent's own segments is
refused. Any other file is never opened for writing (`open_peer_segment`).
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import stat
import threading
import uuid
import weakref
from typing import Any

import msgspec
import numpy as np
import torch

from kvbridge.errors import InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache, TORCH_DTYPES
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.agent import Agent, AgentMeta, RegionInfo, host_id
from kvbridge.transport.copy import copy_addresses
from kvbridge.transport.base import Op

SHM_DIR = "/dev/shm"
_PREFIX = "kvbridge-"
_ALIGN = 4096


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedSegment:
    """One file in /dev/shm mapped read-write and shared; `tensor` is its bytes.

    `SharedSegment(n, prefix)` creates one (mode 0600, `O_EXCL`). `SharedSegment(n, path=...)`
    maps an existing one only if it is a kvbridge segment (`check_segment_name`) opened without
    following links, a regular file with one link, owned by this user, of exactly the size its
    creator gave it; anything else raises `InvalidRequest` before the file is mapped.
    """

    def __init__(self, nbytes: int, name_prefix: str = "seg", path: str | None = None):
        self.nbytes = int(nbytes)
        if path is None:
            tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name_prefix)[:41]  # with `nsINODE-`: the name's 64
            path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{_ns_tag()}-{tag}-{uuid.uuid4().hex[:12]}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self.owner = True
            self._finalizer = weakref.finalize(self, _unlink, path)
            try:
                os.ftruncate(fd, max(self.nbytes, 1))
            except OSError:
                os.close(fd)
                self._finalizer()
                raise
        else:
            fd = open_peer_segment(path, self.nbytes)
            self.owner = False
            self._finalizer = None
        try:
            self._mmap = mmap.mmap(fd, max(self.nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)[: self.nbytes]
        self.addr = self.tensor.data_ptr()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` bytes at `offset` as a uint8 tensor with a storage of its own."""
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes, offset=offset)

    def unlink(self) -> None:
        """Remove the name (no new process can map it); existing mappings stay valid."""
        if self._finalizer is not None:
            self._finalizer()


_NAME = re.compile(re.escape(_PREFIX) + r"[1-9][0-9]{0,9}-[A-Za-z0-9_.-]{0,64}-[0-9a-f]{12}")
MAX_SEGMENT_BYTES = 1 << 44
"""Bound of one peer segment (16 TiB: above any host's memory)."""
MAX_PEER_SEGMENTS = 256
MAX_PEER_REGIONS = 1 << 16


def check_segment_name(path: str) -> str:
    """`path` if it names a segment kvbridge creates (`/dev/shm/kvbridge-PID-TAG-HEX`), else
    `InvalidRequest`: no other directory, no `..`, no other file of /dev/shm."""
    if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR or not _NAME.fullmatch(os.path.basename(path)):
        raise InvalidRequest(f"shm segment {str(path)[:300]!r} refused: not a kvbridge segment name "
                             f"({SHM_DIR}/{_PREFIX}PID-TAG-HEX)")
    return path


def open_peer_segment(path: str, nbytes: int) -> int:
    """A read-write descriptor of the kvbridge segment `path` of exactly `max(nbytes, 1)` bytes,
    checked as `SharedSegment` says; `FileNotFoundError` when it is gone, else `InvalidRequest`."""
    check_segment_name(path)
    if not 0 <= nbytes <= MAX_SEGMENT_BYTES:
        raise InvalidRequest(f"shm segment {path}: size {nbytes} outside [0, {MAX_SEGMENT_BYTES}]")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InvalidRequest(f"shm segment {path} refused: {e.strerror or e} (symlinks are not followed)") from None
    try:
        st = os.fstat(fd)
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})" if st.st_uid != os.geteuid() else
               f"{st.st_nlink} links (a segment has one)" if st.st_nlink != 1 else
               f"{st.st_size} bytes, the peer registered {max(nbytes, 1)}" if st.st_size != max(nbytes, 1) else "")
        if why:
            raise InvalidRequest(f"shm segment {path} refused: {why}")
    except BaseException:
        os.close(fd)
        raise
    return fd


_SEGMENTS: dict[str, SharedSegment] = {}  # this process's own segments, by path
_SEG_LOCK = threading.Lock()


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say): a pid in a segment's
    name means a process only in the namespace that gave it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _ns_tag() -> str:
    return f"ns{pid_namespace()}"


_OWNER = re.compile(re.escape(_PREFIX) + r"([1-9][0-9]{0,9})-(?:ns([0-9]{1,20})-)?")


def segment_owner(name: str) -> tuple[int, int | None] | None:
    """(creator pid, its PID namespace's inode or None for a name without one) of a kvbridge
    segment's file name, else None."""
    m = _OWNER.match(os.path.basename(name))
    if not m or not _NAME.fullmatch(os.path.basename(name)):
        return None
    return int(m.group(1)), int(m.group(2)) if m.group(2) else None


def reap_stale_segments(pid: int | None = None) -> list[str]:
    """Unlink kvbridge segments whose creating process is gone (left behind by a crash); only those
    of process `pid` when given (a parent that saw its child die).

    Only segments named with this PID namespace are judged: a pid of another namespace (a
    container sharing /dev/shm with `--ipc=host`) says nothing here, so its segments are spared,
    as are names without a namespace (written before names carried one)."""
    removed = []
    ours = pid_namespace()
    pattern = _PREFIX + ("*" if pid is None else f"{int(pid)}-*")
    for path in glob.glob(os.path.join(SHM_DIR, pattern)):
        owner = segment_owner(path)
        if owner is None or owner[1] != ours or not ours:
            continue
        try:
            os.kill(owner[0], 0)
        except ProcessLookupError:
            _unlink(path)
            removed.append(path)
        except PermissionError:
            pass
    return removed


def allocate_shared(spec: ModelSpec, layout: EngineLayout, rank: int, name_prefix: str = "cache",
                    fill: float | None = 0.0) -> RankCache:
    """A `RankCache` whose regions live in one shared-memory segment (zero-filled)."""
    reap_stale_segments()
    nbytes = layout.addressing(spec, rank).region_nbytes
    offsets = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in nbytes])
    seg = SharedSegment(int(offsets[-1]), f"{name_prefix}-r{rank}")
    with _SEG_LOCK:
        _SEGMENTS[seg.path] = seg
    dtype = TORCH_DTYPES[spec.dtype]
    # Each region gets its own storage (storage offset 0): RankCache addresses regions with
    # as_strided, whose offset counts from the start of the storage.
    regions = [seg.view(int(o), n).view(dtype) for o, n in zip(offsets, nbytes)]
    if fill not in (None, 0, 0.0):
        for r in regions:
            r.fill_(fill)
    cache = RankCache(spec, layout, rank, regions)
    cache.shm_segment = seg  # type: ignore[attr-defined]
    return cache


def free_shared(cache: RankCache) -> None:
    """Forget a cache from `allocate_shared`: unlink its segment and drop this module's reference,
    so the mapping (and its descriptor) goes away with the last tensor that views it. Idempotent."""
    seg = getattr(cache, "shm_segment", None)
    if seg is None:
        return
    seg.unlink()
    with _SEG_LOCK:
        _SEGMENTS.pop(seg.path, None)


def shared_bytes(nbytes: int, name_prefix: str = "buf") -> torch.Tensor:
    """A flat uint8 tensor of `nbytes` in shared memory (registrable with `ShmTransport`)."""
    reap_stale_segments()
    seg = SharedSegment(nbytes, name_prefix)
    with _SEG_LOCK:
        _SEGMENTS[seg.path] = seg
    return seg.tensor


def new_segment(nbytes: int, name_prefix: str = "seg") -> SharedSegment:
    """A new kvbridge segment of this process, registered (so `segment_at` finds it) and unlinked
    at exit."""
    reap_stale_segments()
    seg = SharedSegment(nbytes, name_prefix)
    with _SEG_LOCK:
        _SEGMENTS[seg.path] = seg
    return seg


def adopt_segment(path: str, nbytes: int) -> SharedSegment:
    """Map a segment another process of this host created (a vLLM worker's cache) so that views
    of it can be registered with `ShmTransport` here. The caller names the segment; a peer never
    does (peers' metadata is checked by `_check_layout`). A segment this process already holds
    (created or adopted) is returned as it is: replacing its owner would unlink it."""
    with _SEG_LOCK:
        known = _SEGMENTS.get(path)
    if known is not None and known.nbytes == nbytes:
        return known
    seg = SharedSegment(nbytes, path=path)
    with _SEG_LOCK:
        _SEGMENTS[seg.path] = seg
    return seg


def release_shared(obj: RankCache | torch.Tensor) -> None:
    """Unlink the segment(s) behind a cache or tensor from `allocate_shared` / `shared_bytes`."""
    # A tensor is found by its first byte (a probe of one byte: a zero-length probe also matches
    # the segment that ends where this one starts, and mmap often places them so; that unlinked a
    # neighbour's segment).
    own = getattr(obj, "shm_segment", None)
    segs = [own] if own is not None else [_segment_of(t.data_ptr(), 1) for t in
                                          (obj.regions if isinstance(obj, RankCache) else [obj])]
    for seg in segs:
        if seg is not None:
            seg.unlink()
            with _SEG_LOCK:
                _SEGMENTS.pop(seg.path, None)


def segment_at(addr: int, nbytes: int) -> SharedSegment | None:
    """The kvbridge segment of this process (created or adopted here) holding `[addr, addr + nbytes)`."""
    return _segment_of(addr, nbytes)


def _segment_of(addr: int, nbytes: int) -> SharedSegment | None:
    end = addr + nbytes
    with _SEG_LOCK:
        for seg in _SEGMENTS.values():
            if seg.addr <= addr and end <= seg.addr + seg.nbytes:
                return seg
    return None


class _ShmEngine(msgspec.Struct, array_like=True):
    names: list[str]  # segment file names in SHM_DIR (names, never paths)
    sizes: list[int]
    region_segment: list[int]
    region_offset: list[int]


def _check_layout(name: str, peer: str, meta: AgentMeta, eng: _ShmEngine) -> list[str]:
    """The paths of the peer's segments; refuses shm metadata whose segments are not kvbridge's
    or whose regions leave them: every number is bounded and checked before a file is opened
    (peer metadata is untrusted)."""
    who = f"{name}: shm peer {peer!r}"
    if not 1 <= len(eng.names) <= MAX_PEER_SEGMENTS or len(eng.sizes) != len(eng.names):
        raise InvalidRequest(f"{who} lists {len(eng.names)} segments ({len(eng.sizes)} sizes); 1..{MAX_PEER_SEGMENTS}")
    if len(set(eng.names)) != len(eng.names):
        raise InvalidRequest(f"{who} lists a segment twice")
    paths = []
    for seg_name, size in zip(eng.names, eng.sizes):
        paths.append(check_segment_name(os.path.join(SHM_DIR, seg_name)))  # a "/" in the name fails here
        if not 0 <= size <= MAX_SEGMENT_BYTES:
            raise InvalidRequest(f"{who}: segment {seg_name[:300]!r} size {size} outside [0, {MAX_SEGMENT_BYTES}]")
    n = len(meta.regions)
    if not n <= MAX_PEER_REGIONS or len(eng.region_segment) != n or len(eng.region_offset) != n:
        raise InvalidRequest(f"{who} describes {n} regions with {len(eng.region_segment)} segment indices and "
                             f"{len(eng.region_offset)} offsets (at most {MAX_PEER_REGIONS}, all equal)")
    for i, (region, s, o) in enumerate(zip(meta.regions, eng.region_segment, eng.region_offset)):
        if not 0 <= s < len(eng.names) or not 0 <= o or not 0 <= region.nbytes or o + region.nbytes > eng.sizes[s]:
            raise InvalidRequest(f"{who}: region {i} ({region.nbytes} B at offset {o} of segment {s}) lies outside "
                                 "its segment")
    return paths


class ShmTransport(Agent):
    """Transport between processes of one host through shared memory (see the module docstring)."""

    backend = "shm"
    max_post_bytes = 64 << 20

    def __init__(self, name: str, **kwargs: Any):
        kwargs.setdefault("workers", 2)
        kwargs["staging_bytes"] = 0  # copies go between mapped segments: nothing to stage
        super().__init__(name, **kwargs)
        self._own: list[SharedSegment] = []
        self._region_seg: list[tuple[int, int]] = []  # (index into _own, offset)
        self._maps: dict[str, SharedSegment] = {}  # peers' segments mapped here, by path
        self._peer_paths: dict[str, list[str]] = {}

    def _engine_register(self, info: RegionInfo) -> None:
        if info.device >= 0:
            raise InvalidRequest(f"{self.name}: the shm transport moves CPU memory only (got cuda:{info.device})")
        seg = _segment_of(info.addr, info.nbytes)
        if seg is None:
            raise InvalidRequest(
                f"{self.name}: region at {info.addr:#x} ({info.nbytes} B) is not in shared memory; allocate it "
                "with kvbridge.transport.shm.allocate_shared or shared_bytes")
        if seg not in self._own:
            self._own.append(seg)
        self._region_seg.append((self._own.index(seg), info.addr - seg.addr))

    def _engine_metadata(self) -> bytes:
        return msgspec.msgpack.encode(_ShmEngine([os.path.basename(s.path) for s in self._own],
                                                 [s.nbytes for s in self._own],
                                                 [i for i, _ in self._region_seg], [o for _, o in self._region_seg]))

    def _engine_connect(self, peer: str, meta: AgentMeta) -> np.ndarray:
        if meta.host_id != host_id():
            raise InvalidRequest(f"{self.name}: shm peer {peer!r} runs on another host ({meta.host_id[:200]})")
        try:
            eng = msgspec.msgpack.decode(meta.engine, type=_ShmEngine)
        except (msgspec.DecodeError, ValueError) as e:  # (invalid UTF-8 in a name is a UnicodeDecodeError)
            raise InvalidRequest(f"{self.name}: shm metadata of peer {peer!r} refused: {e}") from None
        paths = _check_layout(self.name, peer, meta, eng)
        segs = []
        for path, size in zip(paths, eng.sizes):
            seg = self._maps.get(path) or _own_segment(path)
            if seg is not None and (seg.nbytes != size or seg in self._own):
                why = "of this agent" if seg in self._own else f"with size {size}, it has {seg.nbytes}"
                raise InvalidRequest(f"{self.name}: shm peer {peer!r} names segment {path} {why}")
            if seg is None:
                try:
                    seg = SharedSegment(size, path=path)
                except FileNotFoundError:
                    raise InvalidRequest(f"{self.name}: shm segment {path} of peer {peer!r} no longer exists "
                                         "(the peer closed or exited)") from None
            segs.append(seg)
        for path, seg in zip(paths, segs):
            self._maps[path] = seg
        self._peer_paths[peer] = paths
        return np.array([segs[s].addr + o for s, o in zip(eng.region_segment, eng.region_offset)], np.int64)

    def _engine_disconnect(self, peer: str) -> None:
        paths = self._peer_paths.pop(peer, [])
        still = {p for ps in self._peer_paths.values() for p in ps}
        for p in paths:
            if p not in still:
                self._maps.pop(p, None)  # unmapped once no tensor refers to it

    def _engine_post(self, peer: str, op: Op, local: np.ndarray, remote: np.ndarray, length: np.ndarray,
                     notify: bytes | None) -> Any:
        if op == "read":
            copy_addresses(remote, local, length, parallel=True)
        else:
            copy_addresses(local, remote, length, parallel=True)
        return True

    def _engine_check(self, token: Any) -> bool:
        return True

    def _peer_alive(self, peer) -> str:
        try:
            os.kill(peer.meta.pid, 0)
        except ProcessLookupError:
            return f"peer process {peer.meta.pid} ({peer.name!r}) exited"
        except PermissionError:
            pass
        return ""

    def figures(self) -> dict[str, int]:
        out = super().figures()
        if not self._closed:
            out["mapped"] = len({p for p in self._maps if _own_segment(p) is None})  # other processes' segments
        return out

    def _engine_close(self) -> None:
        for seg in self._own:
            seg.unlink()
        self._own.clear()
        self._maps.clear()
        self._peer_paths.clear()


def _own_segment(path: str) -> SharedSegment | None:
    with _SEG_LOCK:
        return _SEGMENTS.get(path)

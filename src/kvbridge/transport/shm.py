"""Shared-memory transport: agents that are processes on one host.

Regions live in POSIX shared memory: files under /dev/shm, one per rank cache
(`allocate_shared`), mapped `MAP_SHARED` and wrapped as torch tensors. An agent's metadata names
each region's file and offset; `connect` maps the peer's files, so a transfer is the compiled
run copier (`local.copy_runs`) between this process's regions and its mappings of the peer's:
reads copy remote -> local, writes local -> remote. The copy runs on a worker thread (in pieces
of at most 64 MiB, so an abort waits for one piece at most); `submit` returns at once.
Notifications go through the agent's ZMQ channel after the copy finished.

Cleanup: a segment's file is unlinked when its owner calls `release_shared`, when the transport
that registered it closes (mappings stay valid until the tensors die), at interpreter exit, and
-- after a crash -- by the next `allocate_shared` on the host, which unlinks every kvbridge
segment whose owning process (its pid is in the file name) no longer exists.

A peer on another host, or whose process exited, fails transfers with that reason.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
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
from kvbridge.transport.agent import Agent, AgentMeta, RegionInfo, copy_addresses, host_id
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
    """One file in /dev/shm mapped read-write and shared; `tensor` is its bytes."""

    def __init__(self, nbytes: int, name_prefix: str = "seg", path: str | None = None):
        self.nbytes = int(nbytes)
        if path is None:
            tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name_prefix)[:64]
            path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{tag}-{uuid.uuid4().hex[:12]}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.owner = True
            self._finalizer = weakref.finalize(self, _unlink, path)
            try:
                os.ftruncate(fd, max(self.nbytes, 1))
            except OSError:
                os.close(fd)
                self._finalizer()
                raise
        else:
            fd = os.open(path, os.O_RDWR)
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


_SEGMENTS: dict[str, SharedSegment] = {}  # this process's own segments, by path
_SEG_LOCK = threading.Lock()


def reap_stale_segments(pid: int | None = None) -> list[str]:
    """Unlink kvbridge segments whose owning process is gone (left behind by a crash); only those
    of process `pid` when given (a parent that saw its child die)."""
    removed = []
    pattern = _PREFIX + ("*" if pid is None else f"{int(pid)}-*")
    for path in glob.glob(os.path.join(SHM_DIR, pattern)):
        m = re.match(re.escape(_PREFIX) + r"(\d+)-", os.path.basename(path))
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
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


def release_shared(obj: RankCache | torch.Tensor) -> None:
    """Unlink the segment(s) behind a cache or tensor from `allocate_shared` / `shared_bytes`."""
    tensors = obj.regions if isinstance(obj, RankCache) else [obj]
    for t in tensors:
        seg = _segment_of(t.data_ptr(), 0)
        if seg is not None:
            seg.unlink()
            with _SEG_LOCK:
                _SEGMENTS.pop(seg.path, None)


def _segment_of(addr: int, nbytes: int) -> SharedSegment | None:
    with _SEG_LOCK:
        for seg in _SEGMENTS.values():
            if seg.addr <= addr and addr + nbytes <= seg.addr + seg.nbytes:
                return seg
    return None


class _ShmEngine(msgspec.Struct, array_like=True):
    paths: list[str]
    sizes: list[int]
    region_segment: list[int]
    region_offset: list[int]


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
        return msgspec.msgpack.encode(_ShmEngine([s.path for s in self._own], [s.nbytes for s in self._own],
                                                 [i for i, _ in self._region_seg], [o for _, o in self._region_seg]))

    def _engine_connect(self, peer: str, meta: AgentMeta) -> np.ndarray:
        if meta.host_id != host_id():
            raise InvalidRequest(f"{self.name}: shm peer {peer!r} runs on another host ({meta.host_id})")
        eng = msgspec.msgpack.decode(meta.engine, type=_ShmEngine)
        segs = []
        for path, size in zip(eng.paths, eng.sizes):
            seg = self._maps.get(path) or _own_segment(path)
            if seg is None:
                try:
                    seg = SharedSegment(size, path=path)
                except FileNotFoundError:
                    raise InvalidRequest(f"{self.name}: shm segment {path} of peer {peer!r} no longer exists "
                                         "(the peer closed or exited)") from None
            self._maps[path] = seg
            segs.append(seg)
        self._peer_paths[peer] = list(eng.paths)
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

"""What every engine transport shares: regions, metadata, peers, handles, the worker threads and
the notification/control channel. A backend (`shm`, `nixl`, `mooncake`) only says how to register
memory, describe and reach itself, and post and check one batch of (local address, remote
address, length) descriptors. The two ways a transfer moves are mixins in their own modules:
`direct.DirectPath` (one descriptor per run) and `staging.StagedPath` (small runs packed into
staging slots, typed control messages).

**Submission.** `submit` validates every run against the local and the peer's regions (so a bad
plan raises `InvalidRequest` before anything moves), then hands the transfer to a worker thread
and returns a handle at once. The worker checks its deadline (`timeout_s`) and the abort flag
between engine steps, so every transfer ends DONE or FAILED with a reason; nothing waits without
a deadline.

**Peers that are gone.** The service thread checks every second whether a connected peer's
process is known to be gone (`_peer_alive`: the shm backend sees the pid; network engines
cannot tell) and then, once no transfer to it is pending, disconnects it: its mapped memory and
its channel socket are released (a dead peer's segment would otherwise stay mapped here, its
memory never returned). A later `submit` to it returns a handle that already failed with the
reason; `connect` makes it reachable again.

**Notifications** reach the peer after every byte of the transfer has landed: the direct path
sends them after the engine reported completion (NIXL attaches them to the transfer itself); a
staged write has the destination queue its own copy after its last scatter.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from kvbridge.errors import InvalidRequest
from kvbridge.transport.base import Handle, Op, Runs, TransferFailed, XferState
from kvbridge.transport.copy import copy_addresses
from kvbridge.transport.direct import DirectPath
from kvbridge.transport.staging import SlotPool, StagedPath, _Passive, decode_control
from kvbridge.transport.peer_meta import check_agent_meta
from kvbridge.transport.notify import CONTROL, NOTIFY, Channel, PeerUnreachable

META_VERSION = 1


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    addr: int
    nbytes: int
    device: int = -1  # -1: CPU memory; otherwise the CUDA device ordinal


class AgentMeta(msgspec.Struct, frozen=True):
    """What `metadata()` carries (msgpack): enough for a peer to reach this agent."""

    version: int
    backend: str
    name: str
    host_id: str
    pid: int
    notify: str
    regions: list[RegionInfo]
    staging: RegionInfo | None
    slot_bytes: int
    engine: bytes


_meta_decoder = msgspec.msgpack.Decoder(AgentMeta)

_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's open agents
_GONE_CHECK_SECONDS = 1.0  # how often the service thread looks for peers whose process is gone


def resource_figures() -> dict[str, int]:
    """What this process's open transport agents hold: `agents`, registered `regions`, connected
    `peers`, and `mapped` peer memory segments (shm). Leak checks compare these before and after."""
    out = {"agents": 0, "regions": 0, "peers": 0, "mapped": 0}
    for agent in list(_LIVE):
        for key, value in agent.figures().items():
            out[key] = out.get(key, 0) + value
    return out


def host_id() -> str:
    """Identifies this host (and boot), so a shared-memory peer can tell it is local."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


@dataclass
class _Peer:
    name: str
    meta: AgentMeta
    addrs: np.ndarray  # base address of each remote region as this process's engine addresses it
    sizes: np.ndarray
    raw: bytes


@dataclass
class _Job:
    handle: Handle
    deadline: float
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    state: XferState = XferState.PENDING
    reason: str = ""


class Agent(DirectPath, StagedPath):
    """Base class of the engine transports (see the module docstring). Not used directly."""

    backend = "?"
    supports_staging = False
    attaches_notify = False
    max_post_bytes = 1 << 62  # the direct path posts at most this many bytes per engine call
    desc_bytes = 1 << 20  # descriptor size for staged windows
    service_period_ms = 20  # longest wait of the service thread between rounds
    serve_order = "fifo"  # how the passive side of staged transfers shares its slots (see `_pump`)

    def __init__(self, name: str, *, host: str = "127.0.0.1", timeout_s: float = 30.0, workers: int = 4,
                 staging_bytes: int = 64 << 20, slot_bytes: int = 16 << 20, stage_below: int = 256 << 10,
                 depth: int = 3):
        if not name or "\0" in name:
            raise InvalidRequest(f"agent name must be a non-empty string, got {name!r}")
        self.name = name
        self.host = host
        self.timeout_s = float(timeout_s)
        self.slot_bytes = int(slot_bytes)
        self.stage_below = int(stage_below) if self.supports_staging else 0
        self.depth = max(1, int(depth))
        self._staging_bytes = int(staging_bytes) if self.supports_staging else 0
        self._tensors: list[torch.Tensor] = []
        self._regions: list[RegionInfo] = []
        self._addrs = np.zeros(0, np.int64)
        self._sizes = np.zeros(0, np.int64)
        self._staging: torch.Tensor | None = None
        self._staging_info: RegionInfo | None = None
        self._pool = SlotPool(0)
        self._peers: dict[str, _Peer] = {}
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False
        self._notes: collections.deque[tuple[str, bytes]] = collections.deque()
        self._passive: dict[tuple[str, int], _Passive] = {}
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # peer -> why it was dropped
        self._inbox_map: dict[tuple[str, int], _Job] = {}  # staged transfers this agent initiated
        self._channel = Channel(name, host)
        self._pool_exec = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"kvb-{self.backend}-{name}")
        self._stop = threading.Event()
        self._service = threading.Thread(target=self._serve, name=f"kvb-service-{name}", daemon=True)
        self._service.start()
        _LIVE.add(self)

    # ---- engine hooks (backends override) -------------------------------------------------
    def _engine_register(self, info: RegionInfo) -> None:
        raise NotImplementedError

    def _engine_metadata(self) -> bytes:
        return b""

    def _engine_connect(self, peer: str, meta: AgentMeta) -> np.ndarray:
        """Reach the peer's engine; returns the base address of each remote region to use."""
        raise NotImplementedError

    def _engine_disconnect(self, peer: str) -> None:
        pass

    def _engine_post(self, peer: str, op: Op, local: np.ndarray, remote: np.ndarray, length: np.ndarray,
                     notify: bytes | None) -> Any:
        raise NotImplementedError

    def _engine_check(self, token: Any) -> bool:
        """True when done, False while in progress; raises `TransferFailed` with the reason."""
        raise NotImplementedError

    def _engine_release(self, token: Any) -> None:
        """Free a posted batch; when it returns the engine no longer touches its memory."""

    def _engine_notify(self, peer: str, message: bytes) -> None:
        self._channel.send(peer, NOTIFY, message)

    def authenticate(self, secret: bytes | None, replay_window: float = 300.0) -> bool:
        """HMAC this agent's channel (`transport.notify`); True when its notifications are all
        authenticated (False where the engine carries them itself: NIXL's notifications)."""
        self._channel.authenticate(secret, replay_window)
        return bool(secret) and not self.attaches_notify

    def _engine_notifications(self) -> list[tuple[str, bytes]]:
        return []

    def _engine_close(self) -> None:
        pass

    def _engine_progress(self) -> None:
        """Called by the service thread every `service_period_ms` (engines without a progress thread)."""

    def _peer_alive(self, peer: _Peer) -> str:
        """An empty string, or why the peer is known to be gone."""
        return ""

    # ---- Transport protocol ---------------------------------------------------------------
    def register(self, regions: list[torch.Tensor]) -> None:
        """Register regions (flat contiguous tensors); indices continue across calls."""
        self._check_open()
        infos = []
        for t in regions:
            if not isinstance(t, torch.Tensor) or not t.is_contiguous():
                raise InvalidRequest(f"{self.name}: regions must be contiguous torch tensors")
            if t.device.type not in ("cpu", "cuda"):
                raise InvalidRequest(f"{self.name}: cannot register {t.device} memory")
            dev = -1 if t.device.type == "cpu" else (t.device.index or 0)
            infos.append(RegionInfo(t.data_ptr(), t.numel() * t.element_size(), dev))
        with self._lock:
            for t, info in zip(regions, infos):
                self._engine_register(info)
                self._tensors.append(t)
                self._regions.append(info)
            self._addrs = np.array([r.addr for r in self._regions], np.int64)
            self._sizes = np.array([r.nbytes for r in self._regions], np.int64)
            if self._staging is None and self._staging_bytes >= self.slot_bytes:
                self._staging = torch.empty(self._staging_bytes, dtype=torch.uint8)
                self._staging_info = RegionInfo(self._staging.data_ptr(), self._staging_bytes, -1)
                self._engine_register(self._staging_info)
                self._pool = SlotPool(self._staging_bytes // self.slot_bytes)

    def metadata(self) -> bytes:
        self._check_open()
        return msgspec.msgpack.encode(AgentMeta(
            META_VERSION, self.backend, self.name, host_id(), os.getpid(), self._channel.endpoint,
            list(self._regions), self._staging_info, self.slot_bytes, self._engine_metadata()))

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        try:
            meta = _meta_decoder.decode(metadata)
        except (msgspec.DecodeError, ValueError) as e:  # (invalid UTF-8 in a string is a UnicodeDecodeError)
            raise InvalidRequest(f"{self.name}: metadata for peer {peer!r} is not kvbridge agent metadata: {e}")
        check_agent_meta(self.name, peer, meta)  # untrusted: bounded before any engine call
        if meta.version != META_VERSION:
            raise InvalidRequest(f"{self.name}: peer {peer!r} speaks metadata version {meta.version}, "
                                 f"this agent {META_VERSION}")
        if meta.backend != self.backend:
            raise InvalidRequest(f"{self.name}: peer {peer!r} is a {meta.backend!r} agent, this one {self.backend!r}")
        if meta.name != peer:
            raise InvalidRequest(f"{self.name}: metadata is for agent {meta.name!r}, not {peer!r}")
        if peer == self.name:
            raise InvalidRequest(f"{self.name}: an agent cannot connect to itself")
        with self._lock:
            old = self._peers.get(peer)
            if old is not None and old.raw == metadata:
                return
            self._gone.pop(peer, None)
            if old is not None:
                self._disconnect_locked(peer, "peer reconnected with new metadata")
            addrs = self._engine_connect(peer, meta)
            self._channel.connect(peer, meta.notify)
            self._peers[peer] = _Peer(peer, meta, np.asarray(addrs, np.int64),
                                      np.array([r.nbytes for r in meta.regions], np.int64), metadata)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._disconnect_locked(peer, f"peer {peer!r} was disconnected")

    def _disconnect_locked(self, peer: str, reason: str) -> None:
        if peer not in self._peers:
            return
        jobs = [j for j in self._jobs.values() if j.handle.peer == peer and j.state == XferState.PENDING]
        for j in jobs:
            j.reason = j.reason or reason
            j.cancel.set()
        for j in jobs:
            j.finished.wait(self.timeout_s)
        del self._peers[peer]
        self._channel.disconnect(peer)
        self._engine_disconnect(peer)

    def submit(self, peer: str, op: Op, runs: Runs, notify: bytes | None = None) -> Handle:
        self._check_open()
        if op not in ("read", "write"):
            raise InvalidRequest(f"{self.name}: op must be 'read' or 'write', got {op!r}")
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                gone = self._gone.get(peer)
                if gone is None:
                    raise InvalidRequest(f"{self.name}: unknown peer {peer!r}; connect it first")
                return Handle(next(self._ids), peer, op, int(np.sum(runs.length)), XferState.FAILED,
                              f"{op} {'from' if op == 'read' else 'to'} {peer!r}: {gone} (disconnected)")
            local, remote, length = self._descriptors(p, runs)
            staged = (self._staging is not None and p.meta.staging is not None and len(length) > 0
                      and int(length.sum()) < self.stage_below * len(length)
                      and all(r.device < 0 for r in self._regions) and all(r.device < 0 for r in p.meta.regions))
            handle = Handle(next(self._ids), peer, op, int(length.sum()))
            job = _Job(handle, time.monotonic() + self.timeout_s)
            self._jobs[handle.id] = job
        target = self._run_staged if staged else self._run_direct
        self._pool_exec.submit(self._run_job, job, target, p, op, runs, local, remote, length, notify)
        return handle

    def poll(self, handle: Handle) -> XferState:
        job = self._jobs.get(handle.id)
        if job is None:
            return handle.state
        if job.state == XferState.PENDING and time.monotonic() > job.deadline + 1.0:
            # The worker is stuck inside an engine call past the deadline: report it now.
            job.reason = job.reason or f"timed out after {self.timeout_s:g} s"
            job.cancel.set()
            job.state = XferState.FAILED
        handle.state, handle.reason = job.state, job.reason
        if job.state != XferState.PENDING and job.finished.is_set():
            self._jobs.pop(handle.id, None)
        return handle.state

    def wait(self, handle: Handle, timeout: float) -> XferState:
        """Sleeps on the transfer's completion instead of polling: a thread waking every 0.2 ms
        beside a posting thread cost it a fifth of its speed (NIXL, 2 cores)."""
        job = self._jobs.get(handle.id)
        if job is not None:  # no longer than until `poll` reports a worker stuck past its deadline
            job.finished.wait(max(0.0, min(timeout, job.deadline + 1.5 - time.monotonic())))
        return self.poll(handle)

    def abort(self, handle: Handle) -> None:
        job = self._jobs.get(handle.id)
        if job is None:
            return
        if job.state == XferState.PENDING:
            job.reason = job.reason or "aborted"
        job.cancel.set()
        job.finished.wait(self.timeout_s)
        self.poll(handle)

    def send_notification(self, peer: str, message: bytes) -> None:
        self._check_open()
        if peer not in self._peers:
            if peer in self._gone:
                raise PeerUnreachable(f"{self.name}: peer {peer!r} was disconnected: {self._gone[peer]}")
            raise InvalidRequest(f"{self.name}: unknown peer {peer!r}; connect it first")
        # A peer known to be gone fails now, not when the service thread next drops it: a
        # notification socket may accept bytes for a dead process (seen under load with shm).
        why = self._peer_alive(self._peers[peer]) if peer in self._peers else ""
        if why:
            raise PeerUnreachable(f"{self.name}: notification to {peer!r} failed: {why}")
        try:
            self._engine_notify(peer, bytes(message))
        except (PeerUnreachable, TransferFailed):
            raise
        except Exception as e:  # engine errors (e.g. NIXL's disconnect error) as one type
            raise PeerUnreachable(f"{self.name}: notification to {peer!r} failed: {type(e).__name__}: {e}") from e

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._notes:
            out.append(self._notes.popleft())
        if not self._closed:
            out.extend(self._engine_notifications())
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs.values())
        for j in jobs:
            j.reason = j.reason or "transport closed"
            j.cancel.set()
        for j in jobs:
            j.finished.wait(self.timeout_s)
        self._stop.set()
        self._service.join(timeout=5)
        self._pool_exec.shutdown(wait=True, cancel_futures=True)
        for peer in list(self._peers):
            self._engine_disconnect(peer)
        self._peers.clear()
        self._engine_close()
        self._channel.close()
        self._tensors.clear()
        self._staging = None
        _LIVE.discard(self)

    def figures(self) -> dict[str, int]:
        """What this agent holds (see `resource_figures`); a closed agent holds nothing."""
        if self._closed:
            return {"agents": 0, "regions": 0, "peers": 0, "mapped": 0}
        return {"agents": 1, "regions": len(self._regions), "peers": len(self._peers), "mapped": 0}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest(f"{self.backend} agent {self.name!r} is closed")

    # ---- staging: passive side (service thread) -------------------------------------------
    def _serve(self) -> None:
        next_check = time.monotonic() + _GONE_CHECK_SECONDS
        while not self._stop.is_set():
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _GONE_CHECK_SECONDS
                try:
                    self._drop_gone_peers()
                except Exception:  # noqa: BLE001 - the service must go on
                    pass
            try:
                msgs = self._channel.recv(self.service_period_ms)
            except Exception:
                if self._stop.is_set():
                    return
                time.sleep(0.01)
                continue
            for sender, kind, payload in msgs:
                if kind == NOTIFY:
                    self._notes.append((sender, payload))
                elif kind == CONTROL:
                    try:
                        self._on_ctl(sender, decode_control(payload))
                    except Exception:  # a malformed message must not stop the service
                        continue
            try:
                self._pump()
            except Exception:  # noqa: BLE001 - the service must go on
                pass
            try:
                self._engine_progress()
            except Exception:  # noqa: BLE001 - the service must go on
                pass

    def _drop_gone_peers(self) -> None:
        """Disconnect peers whose process is gone, once no transfer to them is pending (service thread)."""
        for name, p in list(self._peers.items()):
            why = self._peer_alive(p)
            if not why:
                continue
            with self._lock:
                if self._closed or self._peers.get(name) is not p:
                    continue
                if any(j.handle.peer == name and not j.finished.is_set() for j in self._jobs.values()):
                    continue  # its transfers fail on their own (they check `_peer_alive`); next round
                self._gone[name] = why
                while len(self._gone) > 4096:
                    self._gone.popitem(last=False)
                self._disconnect_locked(name, why)
            for key, job in list(self._passive.items()):
                if key[0] == name:
                    self._drop_passive(job)


__all__ = ["Agent", "AgentMeta", "META_VERSION", "RegionInfo", "TransferFailed", "copy_addresses",
           "host_id", "resource_figures"]

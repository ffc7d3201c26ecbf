"""The staging path: small runs packed into slots of a registered staging buffer.

Length: about 540 lines, one protocol: its typed messages and both of its sides (the initiator
in a worker thread, the passive side in the service thread) read together.

**Staging path** (engines with `supports_staging`, CPU memory): when the runs are small (mean
below `stage_below`, e.g. a head slice of one block per layer under heterogeneous TP), moving
them one descriptor each costs most of the engine's bandwidth. Instead the runs are laid back to
back in a *stream* cut into windows of `slot_bytes`; the source gathers each window into a slot
of its registered staging buffer with the compiled run copier, the engine moves the window as a
few large descriptors into a slot of the destination's staging buffer, and the destination
scatters it into its regions. Windows are pipelined (`depth` in flight). The passive side (the
source of a read, the destination of a write) does its part in its *service thread*, driven by
control messages on the channel (`notify.py`):

    read  (initiator = destination)           write (initiator = source)
    I -> P  begin_gather(runs)                I -> P  begin_scatter(runs, notify)
    P -> I  ready(w, slot)   per window       P -> I  slot(w, slot)     per window
    I: engine READ P.slot -> I.slot           I: gather w; engine WRITE I.slot -> P.slot
    I -> P  release(w, slot); I scatters      I -> P  scatter(w, slot); P scatters
    I -> P  end                               P -> I  done (then P queues the notification)

A passive side never holds more than half its slots for one transfer, drops a transfer whose
initiator stays silent for `timeout_s`, and on `cancel` frees its slots and answers `cancelled`
only after it stopped touching memory for that transfer.

Staging copies run in a compiled serial loop that releases the GIL (`copy_addresses`): OpenMP
threads of a parallel loop spin after it ends, which starved the engine's threads on small hosts.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Union

import msgspec
import numpy as np
from msgspec import Meta

from kvbridge.transport.backoff import Backoff
from kvbridge.transport.base import Op, TransferFailed
from kvbridge.transport.copy import copy_addresses
from kvbridge.transport.notify import CONTROL, PeerUnreachable

if TYPE_CHECKING:
    from kvbridge.transport.agent import _Job, _Peer

# -------------------------------------------------------------------------------------------------
# Control messages: one tagged struct each (siblings, never subclasses of one another: handlers
# dispatch with isinstance),
# every number a peer sends bounded by the schema
# -------------------------------------------------------------------------------------------------
MAX_STAGED_RUNS = 1 << 24
"""Pieces one staged transfer may describe (16 Mi: far above a 1M-token request's head slices)."""

XferId = Annotated[int, Meta(ge=0, lt=1 << 62)]
Index = Annotated[int, Meta(ge=0, lt=1 << 31)]
Int64s = Annotated[bytes, Meta(max_length=8 * MAX_STAGED_RUNS)]


class _Runs(msgspec.Struct, frozen=True, array_like=True):
    """Fields of the two `Begin*` messages (an untagged base: handlers dispatch on the exact type)."""

    xfer: XferId
    offset: Int64s
    length: Int64s
    bounds: Int64s
    notify: Annotated[bytes, Meta(max_length=1 << 20)] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, length, bounds) as int64 arrays; raises ValueError on a ragged buffer."""
        if len(self.offset) % 8 or len(self.length) % 8 or len(self.bounds) % 8:
            raise ValueError("staged run arrays are not whole int64s")
        return (np.frombuffer(self.offset, np.int64), np.frombuffer(self.length, np.int64),
                np.frombuffer(self.bounds, np.int64))


class _Window(msgspec.Struct, frozen=True, array_like=True):
    """Fields of the per-window messages."""

    xfer: XferId
    window: Index
    slot: Index


class _Xfer(msgspec.Struct, frozen=True, array_like=True):
    """Fields of the messages about a whole transfer."""

    xfer: XferId


class BeginGather(_Runs, frozen=True, tag="begin_gather"):
    """Initiator of a read -> passive side: gather these runs (its own addresses) window by window."""


class BeginScatter(_Runs, frozen=True, tag="begin_scatter"):
    """Initiator of a write -> passive side: scatter windows into these runs, then notify."""


class Ready(_Window, frozen=True, tag="ready"):
    """Passive -> initiator of a read: window `window` is gathered in slot `slot`."""


class Slot(_Window, frozen=True, tag="slot"):
    """Passive -> initiator of a write: write window `window` into slot `slot`."""


class Release(_Window, frozen=True, tag="release"):
    """Initiator of a read -> passive: slot `slot` (window `window`) was read; reuse it."""


class Scatter(_Window, frozen=True, tag="scatter"):
    """Initiator of a write -> passive: window `window` landed in slot `slot`; scatter it."""


class End(_Xfer, frozen=True, tag="end"):
    """Initiator -> passive: the read is over."""


class Cancel(_Xfer, frozen=True, tag="cancel"):
    """Initiator -> passive: stop; answer `Cancelled` once no memory is touched for it."""


class Cancelled(_Xfer, frozen=True, tag="cancelled"):
    """Passive -> initiator: the transfer no longer touches memory here."""


class Done(_Xfer, frozen=True, tag="done"):
    """Passive -> initiator of a write: every window is scattered (the notification is queued)."""


class Error(msgspec.Struct, frozen=True, tag="error", array_like=True):
    """Either side: the transfer is refused or failed, with the reason."""

    xfer: XferId
    reason: Annotated[str, Meta(max_length=4096)]


Control = Union[BeginGather, BeginScatter, Ready, Slot, Release, Scatter, End, Cancel, Cancelled, Done, Error]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


def decode_control(payload: bytes) -> Control:
    """A control message from a peer, typed and bounded (msgspec.ValidationError otherwise)."""
    return _decoder.decode(payload)


def _granted(msg: Ready | Slot, windows: int, p: _Peer) -> tuple[int, int]:
    """(window, remote slot) of a grant, checked against this transfer and the peer's staging buffer."""
    slots = p.meta.staging.nbytes // max(1, p.meta.slot_bytes) if p.meta.staging is not None else 0
    if msg.window >= windows or msg.slot >= slots:
        raise TransferFailed(f"peer {p.name!r} granted window {msg.window} of {windows} in slot {msg.slot} "
                             f"of {slots}")
    return msg.window, msg.slot


# -------------------------------------------------------------------------------------------------
# Windows and slots
# -------------------------------------------------------------------------------------------------
def stream_windows(length: np.ndarray, slot_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lay runs back to back and cut the stream at multiples of `slot_bytes`.

    Returns (run index, byte offset inside the run, length, window) of every piece, pieces in
    stream order; a window's pieces are contiguous in its slot starting at offset 0.
    """
    end = np.cumsum(length, dtype=np.int64)
    start = end - length
    first = start // slot_bytes
    last = (end - 1) // slot_bytes
    count = last - first + 1
    run = np.repeat(np.arange(len(length), dtype=np.int64), count)
    k = np.arange(len(run), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    window = first[run] + k
    p_start = np.maximum(start[run], window * slot_bytes)
    p_end = np.minimum(end[run], (window + 1) * slot_bytes)
    return run, p_start - start[run], p_end - p_start, window


def _window_bounds(window: np.ndarray) -> np.ndarray:
    """Index of the first piece of each window, plus the end."""
    nwin = int(window[-1]) + 1 if len(window) else 0
    return np.searchsorted(window, np.arange(nwin + 1, dtype=np.int64)).astype(np.int64)


def _slot_offsets(length: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Offset of each piece inside its window's slot (pieces packed from 0)."""
    end = np.cumsum(length, dtype=np.int64)
    start = end - length
    first_of_window = np.repeat(start[bounds[:-1]], np.diff(bounds))
    return start - first_of_window


class SlotPool:
    """Fixed slots of a staging buffer, handed out without blocking."""

    def __init__(self, count: int):
        self._free = collections.deque(range(count))
        self._lock = threading.Lock()
        self.count = count

    def try_acquire(self) -> int | None:
        with self._lock:
            return self._free.popleft() if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass
class _Passive:
    """A staged transfer this agent serves for a peer (its service thread's state)."""

    peer: str
    xfer: int
    kind: str  # "gather" or "scatter"
    addr: np.ndarray
    length: np.ndarray
    bounds: np.ndarray
    slot_off: np.ndarray
    notify: bytes | None
    next_window: int = 0
    held: dict[int, int] = field(default_factory=dict)  # window -> slot
    done: int = 0
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def windows(self) -> int:
        return len(self.bounds) - 1


class StagedPath:
    """Mixin of `Agent`: the staging initiator and the passive side (run by the service thread)."""

    def _ctl(self, peer: str, msg: Control) -> None:
        self._channel.send(peer, CONTROL, _encoder.encode(msg))

    def _next_ctl(self, job: _Job, p: _Peer, timeout: float = 0.0005) -> Control | None:
        try:
            msg = job.inbox.get(timeout=timeout)
        except queue.Empty:
            self._check_job(job, p)
            return None
        if isinstance(msg, Error):
            raise TransferFailed(f"peer {p.name!r} refused: {msg.reason}")
        return msg

    def _run_staged(self, job: _Job, p: _Peer, op: Op, local, remote, length, notify) -> None:
        run, within, plen, window = stream_windows(length, self.slot_bytes)
        bounds = _window_bounds(window)
        slot_off = _slot_offsets(plen, bounds)
        laddr, raddr = local[run] + within, remote[run] + within
        nwin = len(bounds) - 1
        wbytes = np.add.reduceat(plen, bounds[:-1]) if nwin else np.zeros(0, np.int64)
        xfer = job.handle.id
        rstage, rslot_bytes = self._remote_staging_addr(p), p.meta.slot_bytes
        if rslot_bytes < self.slot_bytes:
            raise TransferFailed(f"peer {p.name!r} has staging slots of {rslot_bytes} B, need {self.slot_bytes}")
        lstage = self._staging_info.addr
        held: list[int] = []  # local slots in use
        inflight: collections.deque = collections.deque()
        begun = False

        def post(w: int, lslot: int, rslot: int) -> Any:
            n = int(wbytes[w])
            cut = np.arange(0, n, self.desc_bytes, dtype=np.int64)
            ln = np.minimum(self.desc_bytes, n - cut)
            return self._engine_post(p.name, op, lstage + lslot * self.slot_bytes + cut,
                                     rstage + rslot * rslot_bytes + cut, ln, None)

        def window_copy(w: int, lslot: int, gather: bool) -> None:
            s = slice(int(bounds[w]), int(bounds[w + 1]))
            slot_addr = lstage + lslot * self.slot_bytes + slot_off[s]
            if gather:
                copy_addresses(laddr[s], slot_addr, plen[s])
            else:
                copy_addresses(slot_addr, laddr[s], plen[s])

        self._inboxes_add(p.name, xfer, job)
        try:
            begin = BeginGather if op == "read" else BeginScatter
            self._ctl(p.name, begin(xfer, raddr.astype(np.int64).tobytes(), plen.astype(np.int64).tobytes(),
                                    bounds.tobytes(), notify if op == "write" else None))
            begun = True
            if op == "read":
                self._staged_read(job, p, nwin, held, inflight, post, window_copy)
                self._ctl(p.name, End(xfer))
                if notify is not None:
                    self._notify_within(job, p, notify)
            else:
                self._staged_write(job, p, nwin, held, inflight, post, window_copy)
        except BaseException:
            for _, lslot, _, token in inflight:
                try:
                    self._engine_release(token)
                except Exception:
                    pass
            inflight.clear()
            if begun:
                self._cancel_remote(job, p, xfer)
            raise
        finally:
            for s in held:
                self._pool.release(s)
            held.clear()
            self._inboxes_remove(p.name, xfer)

    def _remote_staging_addr(self, p: _Peer) -> int:
        """The peer's staging buffer as this process's engine addresses it."""
        return p.meta.staging.addr

    def _staged_read(self, job, p, nwin, held, inflight, post, window_copy) -> None:
        pending: collections.deque = collections.deque()  # (window, remote slot) gathered on the peer
        scattered = 0
        backoff, idle = Backoff(), 0.0  # while reads run, wait on the inbox (a message ends the wait)
        while scattered < nwin:
            msg = self._next_ctl(job, p, idle if (pending or inflight) else 0.002)
            moved = msg is not None
            while msg is not None:
                if isinstance(msg, Ready):
                    pending.append(_granted(msg, nwin, p))
                msg = self._next_ctl(job, p, 0)
            while pending and len(inflight) < self.depth:
                lslot = self._pool.try_acquire()
                if lslot is None:
                    break
                held.append(lslot)
                w, rslot = pending.popleft()
                inflight.append((w, lslot, rslot, post(w, lslot, rslot)))
                moved = True
            landed = self._landed(job, p, inflight)
            if landed is not None:
                w, lslot, rslot = landed
                self._ctl(p.name, Release(job.handle.id, w, rslot))
                window_copy(w, lslot, gather=False)
                held.remove(lslot)
                self._pool.release(lslot)
                scattered += 1
                moved = True
            idle = backoff.after(moved)

    def _landed(self, job: _Job, p: _Peer, inflight: collections.deque) -> tuple[int, int, int] | None:
        """(window, local slot, remote slot) of the oldest engine transfer once it completed, else None
        (after checking the job's deadline and abort flag while it runs)."""
        if not inflight:
            return None
        w, lslot, rslot, token = inflight[0]
        if not self._engine_check(token):
            self._check_job(job, p)
            return None
        inflight.popleft()
        self._engine_release(token)
        return w, lslot, rslot

    def _staged_write(self, job, p, nwin, held, inflight, post, window_copy) -> None:
        grants: dict[int, int] = {}
        gathered: collections.deque = collections.deque()  # (window, local slot), in window order
        next_gather = written = 0
        done = False
        backoff, idle = Backoff(), 0.0  # while writes run, wait on the inbox (a message ends the wait)
        while not done:
            msg = self._next_ctl(job, p, idle if (gathered or inflight or next_gather < nwin) else 0.002)
            moved = msg is not None
            while msg is not None:
                if isinstance(msg, Slot):
                    w, rslot = _granted(msg, nwin, p)
                    grants[w] = rslot
                elif isinstance(msg, Done):
                    done = True
                msg = self._next_ctl(job, p, 0)
            if done:
                break
            while next_gather < nwin and len(gathered) + len(inflight) < self.depth:
                lslot = self._pool.try_acquire()
                if lslot is None:
                    break
                held.append(lslot)
                window_copy(next_gather, lslot, gather=True)
                gathered.append((next_gather, lslot))
                next_gather += 1
                moved = True
            while gathered and gathered[0][0] in grants and len(inflight) < self.depth:
                w, lslot = gathered.popleft()
                rslot = grants.pop(w)
                inflight.append((w, lslot, rslot, post(w, lslot, rslot)))
                moved = True
            landed = self._landed(job, p, inflight)
            if landed is not None:
                w, lslot, rslot = landed
                held.remove(lslot)
                self._pool.release(lslot)
                self._ctl(p.name, Scatter(job.handle.id, w, rslot))
                written += 1
                moved = True
            idle = backoff.after(moved)

    def _cancel_remote(self, job: _Job, p: _Peer, xfer: int) -> None:
        """Tell the passive side to stop and wait (briefly) until it no longer touches memory."""
        try:
            self._ctl(p.name, Cancel(xfer))
        except PeerUnreachable:
            return
        end = time.monotonic() + min(5.0, self.timeout_s)
        while time.monotonic() < end:
            try:
                msg = job.inbox.get(timeout=0.01)
            except queue.Empty:
                if self._peer_alive(p):
                    return
                continue
            if isinstance(msg, (Cancelled, Error, Done)):
                return

    def _inboxes_add(self, peer: str, xfer: int, job: _Job) -> None:
        with self._lock:
            self._inbox_map[(peer, xfer)] = job

    def _inboxes_remove(self, peer: str, xfer: int) -> None:
        with self._lock:
            self._inbox_map.pop((peer, xfer), None)


    # ---- passive side (service thread) ----------------------------------------------------
    def _on_ctl(self, sender: str, msg: Control) -> None:
        key = (sender, msg.xfer)
        if isinstance(msg, (Ready, Slot, Done, Cancelled, Error)):
            job = self._inbox_map.get(key)
            if job is not None:
                job.inbox.put(msg)
            return
        if isinstance(msg, (BeginGather, BeginScatter)):
            self._begin_passive(sender, msg)
            return
        job = self._passive.get(key)
        if job is None:
            if isinstance(msg, Cancel):
                self._reply(sender, Cancelled(msg.xfer))
            return
        job.last_seen = time.monotonic()
        if isinstance(msg, Release) and job.kind == "gather":
            slot = job.held.pop(msg.window, None)
            if slot is not None:
                self._pool.release(slot)
        elif isinstance(msg, Scatter) and job.kind == "scatter":
            if job.held.get(msg.window) != msg.slot:
                self._fail_passive(job, f"scatter of window {msg.window} into slot {msg.slot} was never granted")
                return
            self._window_copy(job, msg.window, msg.slot, gather=False)
            self._pool.release(job.held.pop(msg.window))
            job.done += 1
            if job.done == job.windows:
                del self._passive[key]
                if job.notify is not None:
                    self._notes.append((sender, job.notify))  # after every byte landed
                self._reply(sender, Done(msg.xfer))
        elif isinstance(msg, (End, Cancel)):
            self._drop_passive(job)
            if isinstance(msg, Cancel):
                self._reply(sender, Cancelled(msg.xfer))

    def _begin_passive(self, sender: str, msg: BeginGather | BeginScatter) -> None:
        p = self._peers.get(sender)
        if p is None or self._staging is None:
            self._reply(sender, Error(msg.xfer, f"{self.name} has no staging or does not know {sender!r}"))
            return
        offset, length, bounds = msg.arrays()
        # Addresses are this agent's own; check them against its regions before touching memory.
        order = np.argsort(self._addrs)
        idx = np.searchsorted(self._addrs[order], offset, side="right") - 1
        region = order[np.maximum(idx, 0)]
        ok = (len(offset) == len(length) and len(bounds) >= 1 and (idx >= 0).all()
              and (offset + length <= self._addrs[region] + self._sizes[region]).all() and (length > 0).all())
        if ok and len(bounds) > 1:
            wb = np.add.reduceat(length, bounds[:-1]) if len(length) else np.zeros(0, np.int64)
            ok = bool((wb <= self.slot_bytes).all()) and bounds[-1] == len(length)
        if not ok:
            self._reply(sender, Error(msg.xfer, f"{self.name}: staged runs fall outside its regions"))
            return
        kind = "gather" if isinstance(msg, BeginGather) else "scatter"
        job = _Passive(sender, msg.xfer, kind, offset, length, bounds, _slot_offsets(length, bounds), msg.notify)
        if job.windows == 0:
            if kind == "scatter":
                if msg.notify is not None:
                    self._notes.append((sender, msg.notify))
                self._reply(sender, Done(msg.xfer))
            return
        self._passive[(sender, msg.xfer)] = job

    def _window_copy(self, job: _Passive, w: int, slot: int, gather: bool) -> None:
        s = slice(int(job.bounds[w]), int(job.bounds[w + 1]))
        slot_addr = self._staging_info.addr + slot * self.slot_bytes + job.slot_off[s]
        if gather:
            copy_addresses(job.addr[s], slot_addr, job.length[s])
        else:
            copy_addresses(slot_addr, job.addr[s], job.length[s])

    def _pump(self) -> None:
        """Give free slots to waiting passive transfers, oldest first, at most half the pool each.

        Oldest first (`fifo`, the default), a transfer gets slots only once every older one has
        had its last window handed out, so the oldest request is done first; `fair` hands slots
        out round robin instead. Measured (Mooncake pull, TP1 -> TP2, 128 MiB, 2 cores, 3 A/B
        pairs): oldest first 1.07-1.33 GB/s, round robin 0.93-1.08 GB/s, close to the noise.
        """
        if not self._passive:
            return
        limit = max(1, self._pool.count // 2)
        now = time.monotonic()
        progress = True
        while progress and self._pool.free:
            progress = False
            blocked = False  # an older transfer still has windows to hand out
            for key, job in list(self._passive.items()):
                if now - job.last_seen > self.timeout_s:
                    self._drop_passive(job)
                    continue
                if job.next_window >= job.windows:
                    continue
                if blocked:
                    break
                blocked = self.serve_order == "fifo"
                if len(job.held) >= limit:
                    continue
                slot = self._pool.try_acquire()
                if slot is None:
                    return
                w = job.next_window
                job.held[w] = slot
                job.next_window += 1
                if job.kind == "gather":
                    self._window_copy(job, w, slot, gather=True)
                    ok = self._reply(job.peer, Ready(job.xfer, w, slot))
                else:
                    ok = self._reply(job.peer, Slot(job.xfer, w, slot))
                if not ok:
                    self._drop_passive(job)
                progress = True

    def _reply(self, peer: str, msg: Control) -> bool:
        try:
            self._ctl(peer, msg)
            return True
        except PeerUnreachable:
            return False

    def _drop_passive(self, job: _Passive) -> None:
        self._passive.pop((job.peer, job.xfer), None)
        for slot in job.held.values():
            self._pool.release(slot)
        job.held.clear()

    def _fail_passive(self, job: _Passive, reason: str) -> None:
        self._drop_passive(job)
        self._reply(job.peer, Error(job.xfer, reason[:4096]))

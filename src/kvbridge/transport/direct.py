"""The direct path: every run one engine descriptor (address = region base + offset).

The planner already merged every run that is contiguous on both sides, so the descriptors are
maximal. Runs are validated against the local and the peer's regions before anything moves;
the worker thread checks the transfer's deadline and abort flag between engine steps, so every
transfer ends DONE or FAILED with a reason. Notifications go after the engine reported
completion (NIXL attaches them to the transfer itself).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.base import Op, Runs, TransferFailed, XferState
from kvbridge.transport.notify import NoLiveConnection, PeerUnreachable

if TYPE_CHECKING:
    from kvbridge.transport.agent import _Job, _Peer


class DirectPath:
    """Mixin of `Agent`: validation, the job wrapper, deadline checks and the direct path."""

    def _descriptors(self, p: _Peer, runs: Runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Absolute local and remote addresses of every run, bounds-checked; zero-length runs dropped."""
        lr, lo, rr, ro, ln = (np.asarray(a, np.int64) for a in
                              (runs.local_region, runs.local_offset, runs.remote_region, runs.remote_offset,
                               runs.length))
        if not (len(lr) == len(lo) == len(rr) == len(ro) == len(ln)):
            raise InvalidRequest(f"{self.name}: run arrays differ in length")
        keep = ln != 0
        if not keep.all():
            lr, lo, rr, ro, ln = lr[keep], lo[keep], rr[keep], ro[keep], ln[keep]
        nl, nr = len(self._addrs), len(p.addrs)
        bad = (lr < 0) | (lr >= nl) | (rr < 0) | (rr >= nr) | (ln < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidRequest(f"{self.name}: run {i} names local region {int(lr[i])} of {nl} and remote region "
                                 f"{int(rr[i])} of {nr} on {p.name!r} (length {int(ln[i])})")
        bad = (lo < 0) | (lo + ln > self._sizes[lr]) | (ro < 0) | (ro + ln > p.sizes[rr])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidRequest(
                f"{self.name}: run {i} ({int(ln[i])} B, local region {int(lr[i])} @ {int(lo[i])}, remote region "
                f"{int(rr[i])} @ {int(ro[i])} on {p.name!r}) falls outside the registered regions")
        return self._addrs[lr] + lo, p.addrs[rr] + ro, ln

    def _run_job(self, job: _Job, target, p: _Peer, op: Op, runs: Runs, local, remote, length, notify) -> None:
        try:
            target(job, p, op, local, remote, length, notify)
            if job.state == XferState.PENDING:
                job.state = XferState.DONE
        except Exception as e:  # every failure ends in the handle, with its reason
            if job.state == XferState.PENDING:
                reason = job.reason or (str(e) if isinstance(e, (TransferFailed, PeerUnreachable))
                                        else f"{type(e).__name__}: {e}")
                job.reason = f"{op} {job.handle.nbytes} B {'from' if op == 'read' else 'to'} {p.name!r}: {reason}"
                job.state = XferState.FAILED
        finally:
            job.finished.set()

    def _check_job(self, job: _Job, p: _Peer) -> None:
        if job.cancel.is_set():
            raise TransferFailed(job.reason or "aborted")
        if time.monotonic() > job.deadline:
            job.reason = f"timed out after {self.timeout_s:g} s"
            raise TransferFailed(job.reason)
        gone = self._peer_alive(p)
        if gone:
            raise TransferFailed(gone)

    def _notify_within(self, job: _Job, p: _Peer, notify: bytes) -> None:
        """Send the transfer's notification before the job's deadline. A peer whose connection
        has not completed may only be starved (a loaded host: its I/O thread has not run), so the
        send is tried again until the deadline, an abort or the peer's known death; the 2 s of one
        try turned a slow peer into a failed transfer whose bytes had landed."""
        while True:
            self._check_job(job, p)
            try:
                return self._engine_notify(p.name, notify)
            except NoLiveConnection:
                continue

    def _wait_token(self, job: _Job, p: _Peer, token: Any) -> None:
        backoff = Backoff()
        try:
            while not self._engine_check(token):
                self._check_job(job, p)
                backoff.pause()
        finally:
            self._engine_release(token)

    def _run_direct(self, job: _Job, p: _Peer, op: Op, local, remote, length, notify) -> None:
        if len(length):
            ends = np.cumsum(length)
            cuts = np.searchsorted(ends, np.arange(self.max_post_bytes, int(ends[-1]), self.max_post_bytes),
                                   side="right")
            pieces = np.split(np.arange(len(length)), cuts) if len(cuts) else [np.arange(len(length))]
            pieces = [s for s in pieces if len(s)]
            attach = notify if (self.attaches_notify and len(pieces) == 1) else None
            for sel in pieces:
                self._check_job(job, p)
                self._wait_token(job, p, self._engine_post(p.name, op, local[sel], remote[sel], length[sel], attach))
            if attach is not None:
                return
        if notify is not None:
            self._notify_within(job, p, notify)

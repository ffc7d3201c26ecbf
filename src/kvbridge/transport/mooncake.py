"""Mooncake transport: the Mooncake Transfer Engine in P2P-handshake mode (TCP; RDMA where present).

One `TransferEngine` per transport, initialized as `initialize(host, "P2PHANDSHAKE", protocol,
device)`; the peer's session name is `"host:<get_rpc_port()>"` and travels in the metadata.
Regions are registered with `register_memory(addr, len)`.

**Non-blocking posts.** The binding's `batch_transfer_sync_*` waits by polling the batch status
in a loop without pausing, so every call in flight keeps a core busy: on a 2-core host the
waiting threads starved the engine's own TCP threads (staged windows moved at 0.4 GB/s where
the engine alone moves 1.5). So each descriptor is submitted as its own batch with
`batch_transfer_async_read|write` and polled with `transfer_check_status` (which reports on a
batch's first descriptor only, hence one descriptor per batch), at most `max_inflight` per
transfer at a time (one submission of thousands of descriptors fails after "TCP lane queue-full"
warnings and leaves the engine failing). Every status is checked: a failed or timed-out
descriptor fails the transfer with its index. On failure or abort nothing more is submitted
and the descriptors in flight are waited for, so after `abort` returns nothing touches memory.
The engine bounds a descriptor with its own TCP deadlines (`MC_TCP_PROGRESS_TIMEOUT_SEC`,
`MC_TCP_STATUS_TIMEOUT_SEC`, 30 s by default, read process-wide): unless they are set, the first
transport of a process sets them to its `timeout_s` (rounded up), so a transfer into a cut link
ends inside the engine when kvbridge gives up on it, instead of holding a worker (and `abort`,
and `close`) for up to 30 s more.

Mooncake's Python binding has no notification the CPU build can deliver, so notifications go
through the agent's ZMQ channel (`notify.py`), sent after the transfer completed.

Small runs take the staging path of `agent.py`: windows of `slot_bytes` gathered into a
registered staging buffer, moved as one descriptor each.

Needs the Debian packages libibverbs1 and librdmacm1 to import, even without RDMA hardware.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.transport.agent import Agent, AgentMeta, RegionInfo, TransferFailed
from kvbridge.transport.base import Op
from kvbridge.transport.peer_meta import check_endpoint


def import_mooncake():
    """The `mooncake.engine` module; raises ImportError with the underlying reason."""
    try:
        return importlib.import_module("mooncake.engine")
    except Exception as e:
        raise ImportError(f"Mooncake is not importable (pip install 'kvbridge[mooncake]'; apt-get install "
                          f"libibverbs1 librdmacm1): {type(e).__name__}: {e}") from e


@dataclass
class _Posted:
    """One posted transfer: its descriptors, the next one to submit, and the batches in flight."""

    op: Op
    session: str
    local: list[int]
    remote: list[int]
    length: list[int]
    next: int = 0
    live: list[tuple[int, int]] = field(default_factory=list)  # (batch id, descriptor index)

    def stop(self) -> None:
        """Submit nothing more; what is in flight is still waited for (`_engine_release`)."""
        self.next = len(self.length)


class MooncakeTransport(Agent):
    """Transport over the Mooncake Transfer Engine (see the module docstring)."""

    backend = "mooncake"
    supports_staging = True

    def __init__(self, name: str, *, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                 max_inflight: int = 64, **kwargs: Any):
        mod = import_mooncake()
        if not 1 <= max_inflight <= 256:
            raise InvalidRequest(f"Mooncake max_inflight must be in [1, 256], got {max_inflight}")
        self.max_inflight = int(max_inflight)
        deadline = str(max(1, math.ceil(float(kwargs.get("timeout_s", 30.0)))))
        for var in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):  # process-wide: every engine
            os.environ.setdefault(var, deadline)  # of the process reads them when it moves bytes
        self._engine = mod.TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise InvalidRequest(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                                 f"{device!r}) returned {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._sessions: dict[str, str] = {}
        super().__init__(name, host=host, **kwargs)
        self.desc_bytes = self.slot_bytes  # one descriptor per staged window

    def _engine_register(self, info: RegionInfo) -> None:
        if info.device >= 0:
            raise InvalidRequest(f"{self.name}: this Mooncake build registers CPU memory only (got cuda:{info.device})")
        rc = self._engine.register_memory(info.addr, info.nbytes)
        if rc != 0:
            raise InvalidRequest(f"{self.name}: Mooncake register_memory({info.addr:#x}, {info.nbytes}) returned {rc}")
        self._registered.append(info.addr)

    def _engine_metadata(self) -> bytes:
        return self.session.encode()

    def _engine_connect(self, peer: str, meta: AgentMeta) -> np.ndarray:
        session = meta.engine.decode("ascii", errors="replace")
        check_endpoint(f"tcp://{session}", f"{self.name}: Mooncake session of peer {peer!r}")  # untrusted: host:port
        self._sessions[peer] = session
        return np.array([r.addr for r in meta.regions], np.int64)

    def _engine_disconnect(self, peer: str) -> None:
        self._sessions.pop(peer, None)

    def _engine_post(self, peer: str, op: Op, local: np.ndarray, remote: np.ndarray, length: np.ndarray,
                     notify: bytes | None) -> Any:
        token = _Posted(op, self._sessions[peer], local.tolist(), remote.tolist(), length.tolist())
        self._submit_more(token)
        return token

    def _submit_more(self, token: _Posted) -> None:
        call = self._engine.batch_transfer_async_read if token.op == "read" else self._engine.batch_transfer_async_write
        while token.next < len(token.length) and len(token.live) < self.max_inflight:
            i = token.next
            batch = call(token.session, [token.local[i]], [token.remote[i]], [token.length[i]])
            if batch <= 0:
                token.stop()
                raise TransferFailed(f"Mooncake batch_transfer_async_{token.op} to {token.session} returned {batch} "
                                     f"(descriptor {i} of {len(token.length)}, {token.length[i]} B)")
            token.live.append((batch, i))
            token.next += 1

    def _engine_check(self, token: Any) -> bool:
        still = []
        failure = ""
        for batch, i in token.live:
            rc = self._engine.transfer_check_status(batch)
            if rc == 0:
                still.append((batch, i))
            elif rc < 0 and not failure:
                what = "failed" if rc == -1 else "timed out" if rc == -2 else f"returned {rc}"
                failure = (f"Mooncake {token.op} of descriptor {i} of {len(token.length)} ({token.length[i]} B) "
                           f"with {token.session} {what}")
        token.live = still
        if failure:
            token.stop()
            raise TransferFailed(failure)
        self._submit_more(token)
        return not token.live and token.next == len(token.length)

    def _engine_release(self, token: Any) -> None:
        token.stop()
        end = time.monotonic() + self.timeout_s + 5.0
        while token.live and time.monotonic() < end:
            token.live = [(b, i) for b, i in token.live if self._engine.transfer_check_status(b) == 0]
            if token.live:
                time.sleep(0.001)

    def _engine_close(self) -> None:
        for addr in self._registered:
            try:
                self._engine.unregister_memory(addr)
            except Exception:
                pass
        self._registered.clear()
        self._sessions.clear()
        self._engine = None

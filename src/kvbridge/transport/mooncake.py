"""Mooncake transport: the Mooncake Transfer Engine in P2P-handshake mode (TCP; RDMA where present).

One `TransferEngine` per transport, initialized as `initialize(host, "P2PHANDSHAKE", protocol,
device)`; the peer's session name is `"host:<get_rpc_port()>"` and travels in the metadata.
Regions are registered with `register_memory(addr, len)`. A batch of runs is cut into engine
batches of at most `batch_size` descriptors (64 by default: one call with thousands of
descriptors fails with -1 after "TCP lane queue-full" warnings and leaves the engine failing),
each run as `batch_transfer_sync_read|write` on a small thread pool (the calls release the GIL),
and every return code is checked: a nonzero one fails the transfer with that code. Pending
batches of a failed or aborted transfer are cancelled; running ones are waited for, so after
`abort` returns nothing touches memory. The engine bounds a running batch with its own TCP
deadlines (`MC_TCP_PROGRESS_TIMEOUT_SEC`, `MC_TCP_STATUS_TIMEOUT_SEC`, 30 s by default, read
process-wide): unless they are set, the first transport of a process sets them to its `timeout_s`
(rounded up), so a transfer into a cut link ends inside the engine when kvbridge gives up on it,
instead of holding a worker (and `abort`, and `close`) for up to 30 s more.

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.transport.agent import Agent, AgentMeta, RegionInfo, TransferFailed
from kvbridge.transport.base import Op


def import_mooncake():
    """The `mooncake.engine` module; raises ImportError with the underlying reason."""
    try:
        return importlib.import_module("mooncake.engine")
    except Exception as e:
        raise ImportError(f"Mooncake is not importable (pip install 'kvbridge[mooncake]'; apt-get install "
                          f"libibverbs1 librdmacm1): {type(e).__name__}: {e}") from e


class MooncakeTransport(Agent):
    """Transport over the Mooncake Transfer Engine (see the module docstring)."""

    backend = "mooncake"
    supports_staging = True

    def __init__(self, name: str, *, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                 batch_size: int = 64, threads: int = 4, **kwargs: Any):
        mod = import_mooncake()
        if not 1 <= batch_size <= 256:
            raise InvalidRequest(f"Mooncake batch_size must be in [1, 256], got {batch_size}")
        self.batch_size = int(batch_size)
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
        self._batches = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"kvb-mooncake-{name}")
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
        self._sessions[peer] = meta.engine.decode()
        return np.array([r.addr for r in meta.regions], np.int64)

    def _engine_disconnect(self, peer: str) -> None:
        self._sessions.pop(peer, None)

    def _engine_post(self, peer: str, op: Op, local: np.ndarray, remote: np.ndarray, length: np.ndarray,
                     notify: bytes | None) -> Any:
        session = self._sessions[peer]
        call = self._engine.batch_transfer_sync_read if op == "read" else self._engine.batch_transfer_sync_write
        futures: list[tuple[Future, int, int]] = []
        for i in range(0, len(length), self.batch_size):
            s = slice(i, i + self.batch_size)
            args = (session, local[s].tolist(), remote[s].tolist(), length[s].tolist())
            futures.append((self._batches.submit(call, *args), i, int(length[s].sum())))
        return (op, session, futures, len(length))

    def _engine_check(self, token: Any) -> bool:
        op, session, futures, total = token
        done = True
        for f, first, nbytes in futures:
            if not f.done():
                done = False
                continue
            if f.cancelled():
                raise TransferFailed("Mooncake batch was cancelled")
            exc = f.exception()
            if exc is not None:
                raise TransferFailed(f"Mooncake batch_transfer_sync_{op} raised {type(exc).__name__}: {exc}")
            rc = f.result()
            if rc != 0:
                raise TransferFailed(
                    f"Mooncake batch_transfer_sync_{op} to {session} returned {rc} (descriptors {first}.."
                    f"{min(first + self.batch_size, total) - 1} of {total}, {nbytes} B)")
        return done

    def _engine_release(self, token: Any) -> None:
        futures = token[2]
        for f, _, _ in futures:
            f.cancel()
        for f, _, _ in futures:
            if not f.cancelled():
                try:
                    f.result()
                except Exception:
                    pass

    def _engine_close(self) -> None:
        self._batches.shutdown(wait=True, cancel_futures=True)
        for addr in self._registered:
            try:
                self._engine.unregister_memory(addr)
            except Exception:
                pass
        self._registered.clear()
        self._sessions.clear()
        self._engine = None

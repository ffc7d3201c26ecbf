"""The transport protocol: one vocabulary for every engine (NIXL's): register, describe,
connect, transfer, notify, poll.

A transport moves the runs of a plan between *registered regions* of two agents. It knows
nothing about models or layouts: a run is (local region, local offset, remote region, remote
offset, length). `read` pulls remote bytes into local regions (NIXL style: the decode side is
local); `write` pushes local bytes into remote regions (Mooncake style: the prefill side is
local). Every submission returns a handle whose state is polled; failures are terminal and
carry a reason; nothing blocks without a deadline.
"""

from __future__ import annotations

import enum
from typing import Literal, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from kvbridge.errors import KVBridgeError

Op = Literal["read", "write"]


class TransferFailed(KVBridgeError, RuntimeError):
    """An engine reported a transfer failure; the message is the reason a handle carries."""


class XferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Runs(msgspec.Struct, frozen=True):
    """Runs between this agent's regions and one peer's regions (int64 arrays of equal length)."""

    local_region: np.ndarray
    local_offset: np.ndarray
    remote_region: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


class Handle(msgspec.Struct):
    """A submitted transfer; `reason` is set when it failed."""

    id: int
    peer: str
    op: str
    nbytes: int
    state: XferState = XferState.PENDING
    reason: str = ""


@runtime_checkable
class Transport(Protocol):
    """What every engine backend provides. Implementations: `shm`, `nixl`, `mooncake`."""

    backend: str  # which engine: "shm", "nixl" or "mooncake"
    name: str  # this agent's name, unique among the peers it talks to

    def register(self, regions: list[torch.Tensor]) -> None:
        """Register this agent's memory regions (flat, contiguous tensors), in region-index order."""

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to `connect` to reach this agent's registered regions."""

    def connect(self, peer: str, metadata: bytes) -> None:
        """Make `peer` reachable; idempotent for identical metadata."""

    def disconnect(self, peer: str) -> None:
        """Forget `peer`; transfers still posted to it fail."""

    def submit(self, peer: str, op: Op, runs: Runs, notify: bytes | None = None) -> Handle:
        """Post the runs; `notify` is delivered to the peer once every byte has landed."""

    def poll(self, handle: Handle) -> XferState:
        """Advance and return the handle's state (never blocks)."""

    def wait(self, handle: Handle, timeout: float) -> XferState:
        """Block until the handle is DONE or FAILED, or `timeout` seconds passed; its state then."""

    def abort(self, handle: Handle) -> None:
        """Stop a posted transfer; afterwards it neither reads nor writes memory."""

    def send_notification(self, peer: str, message: bytes) -> None:
        """A small out-of-band message to `peer` (completion, release, heartbeat)."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Messages received since the last call, with the sender's name."""

    def close(self) -> None:
        """Release registered memory and connections; idempotent."""

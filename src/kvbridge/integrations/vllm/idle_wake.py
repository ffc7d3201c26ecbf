"""Pace an engine's idle steps, and end the pause the moment one of its transfers ends.

Why: a vLLM engine that waits only for transfers (a decode request's KV on its way, a prefill
request's blocks held until their reader is done) keeps stepping, and every step runs the
scheduler and each worker. Paced at a fixed 2 ms, the decode instance of a 2-core host stepped
~450 times a second while its requests waited for KV, its two workers used 56 of 75 CPU-seconds,
and the prefill instance it waited for (a separate process session, so a separate scheduler
autogroup, where a sidecar's nice value does not reach) sat runnable but unscheduled for 25-35 s
of every 38 s: its sidecar could not lease the very requests the decode engine waited for
(issue 31, measured with /proc/PID/schedstat; 15 leases held over 5 s in one run, up to 81 s).

So an idle step waits up to `IDLE_WAIT_MAX_S` (never less than `IDLE_WAIT_MIN_S`, the old pace),
and each of the engine's sidecars pokes it when it hands its worker a transfer's end (`Received`,
`Released`): the step that reads the result runs at once, not at the end of the pause. The poke is
an empty datagram on an abstract UNIX socket named by a digest of the engine id (Linux; nothing
on the filesystem). It carries nothing and is read only to be discarded: a process of the host
that sends to it can end a pause early, which is the old pace at worst. Where the socket cannot
be bound (another platform, a name in use), the step falls back to the fixed minimum pace.
"""

from __future__ import annotations

import hashlib
import os
import select
import socket
import time
from collections.abc import Mapping

IDLE_WAIT_MIN_S = 0.002
IDLE_WAIT_MAX_S = 0.025
"""The longest an idle step waits without a poke (`KVBRIDGE_VLLM_IDLE_WAIT_S` sets another): a new
request that arrives meanwhile (vLLM's input queue is not the connector's to watch) is scheduled
at most this much later."""
ENV = "KVBRIDGE_VLLM_IDLE_WAIT_S"


def idle_wait_max_s(environ: Mapping[str, str] | None = None) -> float:
    """`IDLE_WAIT_MAX_S`, or the environment's value, read when a connector starts (never at
    import: a bad value must be one line naming it, not a connector module that fails to load);
    `environ`: another environment's (a fleet's launcher checks its members' before they start)."""
    from kvbridge.errors import ConfigError

    text = (os.environ if environ is None else environ).get(ENV)
    if text is None:
        return IDLE_WAIT_MAX_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not IDLE_WAIT_MIN_S <= value <= 1.0:
        raise ConfigError(f"{ENV} must be seconds in [{IDLE_WAIT_MIN_S}, 1], got {text[:40]!r}")
    return value
_MAX_DRAIN = 1024


def wake_address(engine_id: str) -> bytes:
    """The abstract socket address of `engine_id`'s scheduler (any engine id, a bounded name)."""
    return b"\0kvbridge-idle-" + hashlib.sha256(engine_id.encode()).hexdigest()[:32].encode()


class IdleWait:
    """The scheduler's side: `wait` pauses an idle step until poked or `IDLE_WAIT_MAX_S`."""

    def __init__(self, engine_id: str):
        self._sock: socket.socket | None = None
        self.max_s = idle_wait_max_s()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if hasattr(socket, "AF_UNIX") else None
        if sock is None:
            return
        try:
            sock.bind(wake_address(engine_id))
            sock.setblocking(False)
        except OSError:  # not Linux (no abstract names), or the name is taken: the fixed pace
            sock.close()
            return
        self._sock = sock

    @property
    def wakeable(self) -> bool:
        return self._sock is not None

    def wait(self, min_s: float = IDLE_WAIT_MIN_S, max_s: float | None = None) -> bool:
        """Pause at least `min_s` and at most `max_s` (default `self.max_s`); True when a poke
        ended the pause early."""
        max_s = self.max_s if max_s is None else max_s
        time.sleep(min_s)
        if self._sock is None:
            return False
        if self._drain():
            return True
        left = max_s - min_s
        if left > 0 and select.select([self._sock], [], [], left)[0]:
            self._drain()
            return True
        return False

    def _drain(self) -> bool:
        got = False
        for _ in range(_MAX_DRAIN):  # bounded: a flood costs one pass, never a spin
            try:
                self._sock.recv(1)
            except OSError:  # empty (BlockingIOError) or closed: nothing more to read now
                break
            got = True
        return got

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class IdleWaker:
    """A sidecar's side: `poke` the scheduler of `engine_id` (never blocks, never raises)."""

    def __init__(self, engine_id: str):
        self._address = wake_address(engine_id)
        self._sock: socket.socket | None = None
        if hasattr(socket, "AF_UNIX"):
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            except OSError:
                self._sock = None

    def poke(self) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(b"", self._address)
        except OSError:  # no scheduler bound (yet, or another process layout), or its queue is full
            pass

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


__all__ = ["IDLE_WAIT_MAX_S", "IDLE_WAIT_MIN_S", "idle_wait_max_s", "IdleWait", "IdleWaker", "wake_address"]

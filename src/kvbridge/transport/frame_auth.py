"""HMAC-SHA256 authentication with replay refusal for one socket's frames.

Why here (transport, not connector): the connector's side channel and every transport agent's
notification channel (`transport.notify`) carry frames that cause actions (a handshake, a
release, a staged copy), so both sign and check them with the same rule, and the lower layer
owns it.

The rule: each frame travels with an `auth` part = session id (16 random bytes per socket) |
counter (u64, +1 per frame) | timestamp (f64 wall clock) | HMAC-SHA256(secret, direction |
session | counter | timestamp | frame). The receiver checks the MAC first (constant work per
byte, before any parsing), then refuses a counter not above the last one it accepted from that
session (a replay or a reorder) and a timestamp outside `replay_window` (a replay to a receiver
that forgot the session). The direction label keeps one direction's frames from being reflected
back as the other's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict

from kvbridge.errors import KVBridgeError

_AUTH = struct.Struct(">16sQd")
AUTH_BYTES = _AUTH.size + 32
MAX_SESSIONS = 65536


class FrameAuthError(KVBridgeError, ValueError):
    """A frame refused by authentication (no MAC, bad MAC, replay)."""


class FrameAuth:
    """Signing (`sign`) and checking (`verify`) of one socket's frames; see the module docstring."""

    def __init__(self, secret: bytes, outgoing: bytes, incoming: bytes, replay_window: float = 300.0,
                 error: type[Exception] = FrameAuthError):
        self.secret, self.outgoing, self.incoming = secret, outgoing, incoming
        self.replay_window = replay_window
        self.error = error
        self.session = os.urandom(16)
        self.counter = 0
        self._last: OrderedDict[bytes, int] = OrderedDict()  # peer session -> last counter accepted

    def _mac(self, direction: bytes, header: bytes, frame: bytes) -> bytes:
        return hmac.new(self.secret, direction + header + frame, hashlib.sha256).digest()

    def sign(self, frame: bytes) -> bytes:
        self.counter += 1
        header = _AUTH.pack(self.session, self.counter, time.time())
        return header + self._mac(self.outgoing, header, frame)

    def verify(self, frame: bytes, auth: bytes) -> None:
        """Raise `self.error` unless `auth` is a fresh, valid MAC of `frame`."""
        if len(auth) != AUTH_BYTES:
            raise self.error(f"malformed authentication part ({len(auth)} bytes, expected {AUTH_BYTES})")
        header, mac = auth[:_AUTH.size], auth[_AUTH.size:]
        if not hmac.compare_digest(mac, self._mac(self.incoming, header, frame)):
            raise self.error("bad HMAC: the peer does not share this channel's secret, or the frame was altered")
        session, counter, stamp = _AUTH.unpack(header)
        skew = abs(time.time() - stamp)
        if not skew <= self.replay_window:
            raise self.error(f"replayed or stale frame refused: timestamp {skew:.0f} s away from this "
                             f"host's clock (window {self.replay_window:.0f} s)")
        last = self._last.get(session)
        if last is not None and counter <= last:
            raise self.error(f"replayed frame refused: counter {counter} of session {session.hex()[:8]} "
                             f"is not above the last accepted ({last})")
        self._last[session] = counter
        self._last.move_to_end(session)
        while len(self._last) > MAX_SESSIONS:
            self._last.popitem(last=False)


__all__ = ["AUTH_BYTES", "FrameAuth", "FrameAuthError", "MAX_SESSIONS"]

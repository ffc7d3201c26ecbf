"""A small per-agent message channel over ZMQ: notifications and transport control messages.

Each agent binds one PULL socket (`tcp://HOST:*`, loopback by default) and opens one PUSH socket
per connected peer. A message is three frames: sender name, kind (one byte), payload. Sends
never block longer than `send_timeout_ms`: PUSH sockets use `ZMQ_IMMEDIATE`, so a message to a
peer with no live connection (dead, never started, unreachable) is refused instead of queued,
and the sender learns it as a `PeerUnreachable` error within the timeout. Delivery is in order
per (sender, receiver) pair.

Authentication (`authenticate(secret)`, which the connector calls with its side-channel
secret): every message then carries a fourth frame, an HMAC over sender, receiver, kind and payload with
replay refusal (`transport.frame_auth`), and `recv` drops (and counts in `refused`) any message
without a fresh valid MAC, before its payload is looked at. Without it, anyone who can reach the
PULL port can inject notifications and staging control messages under any sender name.
Frames above `MAX_MESSAGE_BYTES` are dropped by ZMQ before they are buffered.

Threading: sends may come from any thread (one lock per channel); `recv` is meant for a single
consumer thread (the agent's service thread).

Backends without built-in notifications (shared memory, Mooncake) deliver `Transport`
notifications here, sent only after the transfer's bytes have landed; every backend with a
staging path sends its control messages here.
"""

from __future__ import annotations

import threading

import zmq

from kvbridge.errors import KVBridgeError
from kvbridge.transport.frame_auth import FrameAuth, FrameAuthError
from kvbridge.transport.descriptors import sized

NOTIFY = 0
"""A user notification (`Transport.send_notification`, or a transfer's `notify`)."""
CONTROL = 1
"""A transport-internal control message (staging protocol)."""


MAX_MESSAGE_BYTES = 64 << 20
"""Bound of one channel message (a staged window's descriptors are at most a few MiB)."""
_DIRECTION = b"kvbridge-ch1"
MAX_BATCH = 4096


class PeerUnreachable(KVBridgeError, ConnectionError):
    """A message could not be handed to a live connection to the peer in time."""


class NoLiveConnection(PeerUnreachable):
    """No connection to the peer completed within the send timeout: the peer may be gone, or only
    starved (its ZMQ I/O thread has not run yet), so a caller with a deadline may try again."""


class Channel:
    """One agent's endpoint: `endpoint` is what peers connect to."""

    def __init__(self, name: str, host: str = "127.0.0.1", send_timeout_ms: int = 2000):
        self.name = name
        self._name_bytes = name.encode()
        self._send_timeout_ms = send_timeout_ms
        self._ctx = sized(zmq.Context())  # one PUSH per peer agent: as many as the descriptors allow
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._closed = False
        self._auth: FrameAuth | None = None
        self.refused = 0
        """Messages dropped: malformed, or failing authentication."""

    def authenticate(self, secret: bytes | None, replay_window: float = 300.0) -> None:
        """Sign every message from now on and accept only signed ones (None: neither)."""
        with self._lock:
            self._auth = FrameAuth(secret, _DIRECTION, _DIRECTION, replay_window) if secret else None

    def connect(self, peer: str, endpoint: str) -> None:
        with self._lock:
            old = self._push.pop(peer, None)
            if old is not None:
                old.close(0)
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(endpoint)
            self._push[peer] = s

    def disconnect(self, peer: str) -> None:
        with self._lock:
            s = self._push.pop(peer, None)
            if s is not None:
                s.close(0)

    def send(self, peer: str, kind: int, payload: bytes) -> None:
        """Hand one message to the connection to `peer`; raises `PeerUnreachable` on failure."""
        with self._lock:
            s = self._push.get(peer)
            if s is None:
                raise PeerUnreachable(f"{self.name}: no channel to peer {peer!r} (not connected)")
            try:
                parts = [self._name_bytes, bytes([kind]), payload]
                if self._auth is not None:
                    parts.append(self._auth.sign(b"%d:%s>%s\0" % (kind, self._name_bytes, peer.encode()) + payload))
                s.send_multipart(parts, copy=len(payload) < 65536)
            except zmq.Again:
                raise NoLiveConnection(
                    f"{self.name}: peer {peer!r} accepted no message within {self._send_timeout_ms} ms "
                    "(no live connection: the peer process is gone, unreachable or starved)") from None
            except zmq.ZMQError as e:
                raise PeerUnreachable(f"{self.name}: sending to peer {peer!r} failed: {e}") from None

    def recv(self, timeout_ms: int) -> list[tuple[str, int, bytes]]:
        """Every message waiting (after at most `timeout_ms` for the first): (sender, kind, payload)."""
        out: list[tuple[str, int, bytes]] = []
        if self._closed or not self._poller.poll(timeout_ms):
            return out
        for _ in range(MAX_BATCH):  # a flood cannot keep one call from returning
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if self._accept(frames):
                out.append((frames[0].decode(errors="replace"), frames[1][0], frames[2]))
            else:
                self.refused += 1
        return out

    def _accept(self, frames: list[bytes]) -> bool:
        auth = self._auth
        if auth is None:
            return len(frames) == 3 and len(frames[1]) == 1
        if len(frames) != 4 or len(frames[1]) != 1:
            return False
        try:
            auth.verify(b"%d:%s>%s\0" % (frames[1][0], frames[0], self._name_bytes) + frames[2], frames[3])
        except FrameAuthError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self._push.values():
                s.close(0)
            self._push.clear()
            self._pull.close(0)
            self._ctx.term()

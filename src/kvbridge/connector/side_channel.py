"""The side channel: ZMQ ROUTER on each prefill rank, one DEALER per (decode rank, prefill rank).

Why these socket types: a prefill rank serves any number of decode ranks it does not know in
advance and must answer each one (ROUTER addresses replies by the peer's routing id); a decode
rank talks to a few known prefill ranks and must be able to send at any time without waiting
for a reply (DEALER, unlike REQ, has no lock-step). This is Mooncake's pairing; NIXL uses a
REQ socket for its one-shot handshake only.

Every operation is bounded:

* no receive ever blocks without a timeout: callers give `timeout` seconds and get back what
  arrived by then (possibly nothing);
* sends never block: a full queue or an unreachable peer returns False instead of waiting;
* frames above `max_frame_bytes` are dropped by ZMQ itself (`zmq.MAXMSGSIZE` closes the
  offending connection before the bytes are buffered) and refused again by `messages.decode`;
* a malformed frame (wrong number of parts, bad msgpack, schema violation, other version) is
  delivered as a `Received` with `error` set, never raised, so a hostile peer cannot stop the
  loop that serves the others.

Liveness: each DEALER runs a ZMQ socket monitor and TCP keepalives (`_keepalive`: answered by
the peer's kernel, so a host that vanishes without closing TCP is noticed, and a live process
that is starved of CPU is not mistaken for a dead one); `SideChannelClient.lost` becomes true
when the connection to its server drops after it was up, which is how a decode rank learns that
a prefill rank died without waiting for a timeout.

Authentication (optional, `ConnectorConfig.secret`): each frame travels as two ZMQ parts,
`[frame, auth]`, where `auth` = session id (16 random bytes per socket) | counter (u64, +1 per
frame) | timestamp (f64 wall clock) | HMAC-SHA256(secret, direction | session | counter |
timestamp | frame). The receiver refuses a frame without a valid MAC, a counter not above the
last one it accepted from that session (a replay or a reorder), and a timestamp outside
`replay_window` (a replay to a receiver that forgot the session). The direction label keeps a
server's frames from being reflected back to it as a client's. A receiver without a secret
refuses two-part frames naming the cause (the peer has a secret, we do not).

Addresses are `host:port`, `[ipv6]:port` or `tcp://...`; port 0 binds an ephemeral port.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.connector.messages import MAX_FRAME_BYTES, FrameTooLarge, Message, ProtocolError, decode, encode
from kvbridge.errors import KVBridgeError
from kvbridge.transport.descriptors import sized
from kvbridge.transport.frame_auth import AUTH_BYTES, FrameAuth as _FrameAuth


class SideChannelError(KVBridgeError, RuntimeError):
    """A side-channel endpoint could not be set up, or a bounded wait ran out."""


class AuthenticationError(ProtocolError):
    """A frame refused by side-channel authentication (no MAC, bad MAC, replay, unexpected MAC)."""


class FrameAuth(_FrameAuth):
    """`transport.frame_auth.FrameAuth` raising this module's `AuthenticationError`."""

    def __init__(self, secret: bytes, outgoing: bytes, incoming: bytes, replay_window: float = 300.0):
        super().__init__(secret, outgoing, incoming, replay_window, AuthenticationError)


def _auth(secret: bytes | None, outgoing: bytes, incoming: bytes, replay_window: float) -> FrameAuth | None:
    return FrameAuth(secret, outgoing, incoming, replay_window) if secret else None


class Received(NamedTuple):
    """One frame: the decoded message or the reason it was refused; `peer` is the ROUTER-side id."""

    peer: bytes
    msg: Message | None
    error: ProtocolError | None = None
    nbytes: int = 0


def parse_address(address: str) -> tuple[str, int]:
    """`(host, port)` of `host:port`, `[v6]:port` or `tcp://host:port`; names the problem if bad."""
    text = address.strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise SideChannelError(f"bad side-channel address {address!r}: expected [IPv6]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise SideChannelError(f"bad side-channel address {address!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT)")
    if not host:
        raise SideChannelError(f"bad side-channel address {address!r}: no host")
    try:
        number = int(port)
    except ValueError:
        raise SideChannelError(f"bad side-channel address {address!r}: port {port!r} is not a number") from None
    if not 0 <= number < 65536:
        raise SideChannelError(f"bad side-channel address {address!r}: port {number} outside [0, 65535]")
    return host, number


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _context() -> zmq.Context:
    """This process's side-channel context, of its own and sized before its first socket (issue
    44.2): the shared `zmq.Context.instance()` may have made sockets already, and libzmq reads
    `MAX_SOCKETS` only at a context's first socket; a forked child makes its own."""
    global _ctx, _ctx_pid
    if _ctx is None or _ctx_pid != os.getpid() or _ctx.closed:
        _ctx, _ctx_pid = sized(zmq.Context()), os.getpid()
    return _ctx


_ctx: zmq.Context | None = None
_ctx_pid = 0


def _configure(sock: zmq.Socket, host: str, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # closing never waits for unsent frames
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)


def _keepalive(sock: zmq.Socket, seconds: float) -> None:
    """Liveness from the peer's kernel, not from its process.

    TCP keepalive probes are answered by the peer host's kernel whether or not the peer process
    gets a CPU, so a prefill rank starved for a minute on a loaded host keeps its link (ZMTP
    heartbeats, answered by the peer's ZMQ I/O thread, dropped such a live peer after 3 silent
    intervals and failed its requests). A peer that dies is seen at once (its kernel closes the
    connection); a dead host or a cut link after `seconds` idle plus 3 unanswered probes, or, with
    frames unacknowledged, after `TCP_MAXRT` (Linux's TCP_USER_TIMEOUT) of 4 x `seconds`.
    """
    whole = max(1, round(seconds))  # the kernel counts keepalive times in whole seconds
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, whole)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, whole)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.TCP_MAXRT, 4 * whole * 1000)


_SAME_SECRET = ("configure the same secret on both engines: the kvbridge command's --secret-file, or ConnectorConfig's "
                "secret or secret file")
"""How a user fixes a one-sided secret, in the words of both ways to run an engine (its log is read
by people who typed flags and by people who wrote a vLLM config)."""


def _decode_parts(peer: bytes, parts: list[bytes], max_frame_bytes: int, auth: FrameAuth | None = None) -> Received:
    size = sum(len(p) for p in parts)
    if auth is not None:
        if len(parts) == 1:
            return Received(peer, None, AuthenticationError(
                "unauthenticated frame refused: a shared secret is configured on this side channel and the peer "
                f"sent no HMAC ({_SAME_SECRET})"), size)
        if len(parts) != 2:
            return Received(peer, None, ProtocolError(f"expected a frame and its HMAC, got {len(parts)} parts"), size)
        if len(parts[0]) > max_frame_bytes:
            return Received(peer, None, FrameTooLarge(f"frame of {len(parts[0])} bytes refused: the bound is "
                                                      f"{max_frame_bytes}"), size)
        try:
            auth.verify(parts[0], parts[1])
        except AuthenticationError as e:
            return Received(peer, None, e, size)
        parts = parts[:1]
    elif len(parts) == 2 and len(parts[1]) == AUTH_BYTES:
        return Received(peer, None, AuthenticationError(
            "authenticated frame refused: the peer signs its frames with a shared secret (HMAC) but none is "
            f"configured on this side ({_SAME_SECRET})"), size)
    if len(parts) != 1:
        return Received(peer, None, ProtocolError(f"expected one frame per message, got {len(parts)} parts"),
                        sum(len(p) for p in parts))
    try:
        return Received(peer, decode(parts[0], max_frame_bytes), None, len(parts[0]))
    except ProtocolError as e:
        return Received(peer, None, e, len(parts[0]))


def _timeout_ms(timeout: float) -> int:
    return max(0, int(timeout * 1000))


class SideChannelServer:
    """A prefill rank's ROUTER socket."""

    def __init__(self, listen: str = "127.0.0.1:0", *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 context: zmq.Context | None = None, secret: bytes | None = None, replay_window: float = 300.0,
                 heartbeat_seconds: float = 1.0):
        host, port = parse_address(listen)
        self.max_frame_bytes = max_frame_bytes
        self.auth = _auth(secret, b"kvbridge-sc1 s->c", b"kvbridge-sc1 c->s", replay_window)
        self.socket = (context or _context()).socket(zmq.ROUTER)
        _configure(self.socket, host, max_frame_bytes)
        _keepalive(self.socket, heartbeat_seconds)  # a reader's connection left over a cut link is closed too
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer fails instead of vanishing
        try:
            self.socket.bind(_endpoint(host, "*" if port == 0 else port))
            port = int(self.socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        except zmq.ZMQError as e:
            self.socket.close(0)
            raise SideChannelError(f"cannot listen on {format_address(host, port)}: {e}") from None
        self.address = format_address(host, port)
        self.closed = False

    def send(self, peer: bytes, msg: Message) -> bool:
        """Queue `msg` for `peer`; False when the peer is unknown or gone, or its queue is full."""
        if self.closed:
            return False
        data = encode(msg, self.max_frame_bytes)
        parts = [peer, data] if self.auth is None else [peer, data, self.auth.sign(data)]
        try:
            self.socket.send_multipart(parts, flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def recv(self, timeout: float = 0.0, max_messages: int = 1024) -> list[Received]:
        """What arrived within `timeout` seconds (at most `max_messages`), decoded or refused."""
        if self.closed or not self.socket.poll(_timeout_ms(timeout), zmq.POLLIN):
            return []
        return self.drain(max_messages)

    def drain(self, max_messages: int = 1024) -> list[Received]:
        out: list[Received] = []
        while len(out) < max_messages:
            try:
                parts = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(_decode_parts(parts[0], parts[1:], self.max_frame_bytes, self.auth))
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.socket.close(0)


class SideChannelClient:
    """A decode rank's DEALER connected to one prefill rank's ROUTER."""

    def __init__(self, address: str, identity: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES,
                 heartbeat_seconds: float = 1.0, context: zmq.Context | None = None,
                 secret: bytes | None = None, replay_window: float = 300.0):
        host, port = parse_address(address)
        self.auth = _auth(secret, b"kvbridge-sc1 c->s", b"kvbridge-sc1 s->c", replay_window)
        if port == 0:
            raise SideChannelError(f"cannot connect to {address!r}: port 0")
        if not identity or identity[0] == 0 or len(identity) > 255:
            raise SideChannelError("a side-channel identity is 1..255 bytes and does not start with NUL")
        self.address = format_address(host, port)
        self.max_frame_bytes = max_frame_bytes
        ctx = context or _context()
        self.socket = ctx.socket(zmq.DEALER)
        _configure(self.socket, host, max_frame_bytes)
        self.socket.setsockopt(zmq.ROUTING_ID, identity)
        _keepalive(self.socket, heartbeat_seconds)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self.socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.connected_once = False
        self.lost = False
        self.closed = False
        self._held: list[Received] = []  # frames that followed a handshake reply in one read
        try:
            self.socket.connect(_endpoint(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise SideChannelError(f"cannot connect to {self.address}: {e}") from None

    def send(self, msg: Message) -> bool:
        """Queue `msg` for the server; False when the queue is full or the socket closed."""
        if self.closed:
            return False
        data = encode(msg, self.max_frame_bytes)
        try:
            if self.auth is None:
                self.socket.send(data, flags=zmq.NOBLOCK)
            else:
                self.socket.send_multipart([data, self.auth.sign(data)], flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def check_monitor(self) -> None:
        """Consume connection events (non-blocking); sets `lost` when an established link drops."""
        if self.closed:
            return
        while True:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError):
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected_once = True
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and self.connected_once:
                self.lost = True

    def recv(self, timeout: float = 0.0, max_messages: int = 1024) -> list[Received]:
        if self.closed:
            return []
        self.check_monitor()
        if self._held:
            return self.drain(max_messages)
        if not self.socket.poll(_timeout_ms(timeout), zmq.POLLIN):
            self.check_monitor()
            return []
        return self.drain(max_messages)

    @property
    def has_held(self) -> bool:
        """Frames already read (with a handshake reply) and not yet returned."""
        return bool(self._held)

    def drain(self, max_messages: int = 1024) -> list[Received]:
        out, self._held = self._held[:max_messages], self._held[max_messages:]
        while len(out) < max_messages:
            try:
                parts = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(_decode_parts(b"", parts, self.max_frame_bytes, self.auth))
        return out

    def request(self, msg: Message, timeout: float, accept: tuple[type, ...]) -> Message:
        """Send `msg` and wait at most `timeout` s for a reply of a type in `accept` (or an Error).

        A message before the reply is refused with a `SideChannelError` (this is used only for
        the handshake, before which the server sends nothing). Messages read together with the
        reply (the server may announce work right after it) are kept for the next `recv`.
        """
        from kvbridge.connector.messages import Error
        if not self.send(msg):
            raise SideChannelError(f"cannot send {type(msg).__name__} to {self.address}: queue full or closed")
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SideChannelError(f"no reply from {self.address} within {timeout:.1f} s "
                                       f"(waited for {', '.join(t.__name__ for t in accept)})")
            batch = self.recv(min(left, 0.1), max_messages=16)
            for i, rec in enumerate(batch):
                if rec.error is not None:
                    raise SideChannelError(f"{self.address} answered with a frame we refuse: {rec.error}")
                if isinstance(rec.msg, accept) or isinstance(rec.msg, Error):
                    self._held = batch[i + 1:] + self._held
                    return rec.msg
                raise SideChannelError(f"{self.address} answered {type(rec.msg).__name__} to "
                                       f"{type(msg).__name__}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.socket.close(0)


def poll_clients(clients: Sequence[SideChannelClient], timeout: float) -> list[tuple[SideChannelClient, Received]]:
    """Wait at most `timeout` s for any of `clients` to have a frame or drop its link, then drain them all."""
    live = [c for c in clients if not c.closed]
    if not live:
        if timeout > 0:
            time.sleep(min(timeout, 0.05))
        return []
    poller = zmq.Poller()
    for c in live:
        poller.register(c.socket, zmq.POLLIN)
        if c.connected_once and not c.lost:  # a link that drops ends the wait: its requests fail at once
            poller.register(c.monitor, zmq.POLLIN)
    ready = dict(poller.poll(0 if any(c.has_held for c in live) else _timeout_ms(timeout)))
    out: list[tuple[SideChannelClient, Received]] = []
    for c in live:
        c.check_monitor()
        if c.socket in ready or c.has_held:
            out.extend((c, r) for r in c.drain())
    return out


__all__ = ["AUTH_BYTES", "AuthenticationError", "FrameAuth", "Received", "SideChannelClient", "SideChannelError", "SideChannelServer", "format_address",
           "parse_address", "poll_clients"]

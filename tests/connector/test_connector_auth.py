"""Side-channel authentication (`ConnectorConfig(secret=...)`): HMAC-SHA256 per frame, replay refusal."""

from __future__ import annotations

import time

import pytest
import zmq
from connector_harness import Cluster, Workload

from kvbridge.connector import messages as m
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.side_channel import (AUTH_BYTES, AuthenticationError, FrameAuth, SideChannelClient,
                                             SideChannelError, SideChannelServer)
from kvbridge.errors import ConfigError
from kvbridge.core.layout import EngineLayout

SECRET = b"correct horse battery staple"
PRE = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
DEC = EngineLayout(tp_size=1, block_size=16, num_blocks=64)


def _cfg(secret: bytes | None) -> ConnectorConfig:
    return ConnectorConfig(lease_seconds=5, transfer_timeout=5, abort_timeout=1, handshake_timeout=1.5, secret=secret,
                           insecure=secret is None)


def _recv_all(server: SideChannelServer, n: int, timeout: float = 2.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out.extend(server.recv(0.05))
    return out


def test_authenticated_requests_complete() -> None:
    cluster = Cluster(PRE, DEC, config=_cfg(SECRET))
    try:
        cluster.connect()
        work = Workload(cluster, 4, seed=11)
        work.add()
        work.receive()
        cluster.run_until(lambda: all(cluster.done(r) for r in work.requests), 10)
        assert all(r.ok for r in cluster.results.values())
        assert work.mismatches() == []
        assert all(p.stats["refused_frames"] == 0 for p in cluster.producers)
    finally:
        cluster.close()


@pytest.mark.parametrize("prefill_secret,decode_secret,expect", [
    (SECRET, None, "signs its frames with a shared secret"),
    (None, SECRET, "unauthenticated frame refused"),
    (SECRET, b"another secret of 16+ bytes", "bad HMAC"),
])
def test_handshake_refused_without_matching_secret(prefill_secret, decode_secret, expect) -> None:
    cluster = Cluster(PRE, DEC, config=_cfg(decode_secret), prefill_config=_cfg(prefill_secret))
    try:
        with pytest.raises(SideChannelError) as info:
            cluster.connect(timeout=1.5)
        text = str(info.value)
        # The decode side names the cause, or (prefill refused us first, silently for a bad MAC) times out;
        # either way the prefill side counted the refusal and no peer was registered.
        assert expect in text or "no reply" in text, text
        assert all(not p.decode_engines for p in cluster.producers)
        if decode_secret is not None and prefill_secret != decode_secret:
            assert cluster.producers[0].stats["refused_frames"] >= 1
    finally:
        cluster.close()


def test_unsigned_and_forged_frames_refused_by_server() -> None:
    server = SideChannelServer(secret=SECRET)
    plain = SideChannelClient(server.address, b"plain")
    forged = SideChannelClient(server.address, b"forged", secret=b"not the secret, 16 bytes+")
    try:
        hb = m.Heartbeat("decode", 0, ("r1",))
        assert plain.send(hb) and forged.send(hb)
        got = _recv_all(server, 2)
        assert len(got) == 2 and all(r.msg is None for r in got)
        reasons = sorted(str(r.error) for r in got)
        assert any("unauthenticated frame refused" in x for x in reasons)
        assert any("bad HMAC" in x for x in reasons)
        assert all(isinstance(r.error, AuthenticationError) for r in got)
    finally:
        plain.close()
        forged.close()
        server.close()


def test_replayed_frame_refused() -> None:
    """A captured [frame, auth] pair re-sent verbatim (same or another connection) is refused."""
    server = SideChannelServer(secret=SECRET)
    sender = FrameAuth(SECRET, b"kvbridge-sc1 c->s", b"kvbridge-sc1 s->c")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{server.address}")
    raw2 = zmq.Context.instance().socket(zmq.DEALER)
    raw2.setsockopt(zmq.LINGER, 0)
    raw2.connect(f"tcp://{server.address}")
    try:
        frame = m.encode(m.Heartbeat("decode", 0, ("r1",)))
        auth = sender.sign(frame)
        assert len(auth) == AUTH_BYTES
        raw.send_multipart([frame, auth])
        (first,) = _recv_all(server, 1)
        assert first.error is None and isinstance(first.msg, m.Heartbeat)
        raw.send_multipart([frame, auth])  # replay on the same connection
        raw2.send_multipart([frame, auth])  # replay on a new connection
        replays = _recv_all(server, 2)
        assert len(replays) == 2
        assert all(r.msg is None and "replayed frame refused" in str(r.error) for r in replays), replays
        # A tampered frame under a fresh counter fails the MAC.
        auth2 = sender.sign(frame)
        raw.send_multipart([frame.replace(b"r1", b"r2"), auth2])
        (tampered,) = _recv_all(server, 1)
        assert "bad HMAC" in str(tampered.error)
        # A stale timestamp (a replay to a receiver that forgot the session) is refused too.
        old = FrameAuth(SECRET, b"kvbridge-sc1 c->s", b"kvbridge-sc1 s->c")
        real_time = time.time
        try:
            time.time = lambda: real_time() - 3600  # type: ignore[assignment]
            stale = old.sign(frame)
        finally:
            time.time = real_time  # type: ignore[assignment]
        raw.send_multipart([frame, stale])
        (late,) = _recv_all(server, 1)
        assert "stale" in str(late.error) and "window" in str(late.error)
        # A server's own signed frame reflected back to it fails (direction label).
        reflect = FrameAuth(SECRET, b"kvbridge-sc1 s->c", b"kvbridge-sc1 c->s")
        raw.send_multipart([frame, reflect.sign(frame)])
        (reflected,) = _recv_all(server, 1)
        assert "bad HMAC" in str(reflected.error)
    finally:
        raw.close(0)
        raw2.close(0)
        server.close()


def test_short_secret_refused() -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        ConnectorConfig(secret=b"short")

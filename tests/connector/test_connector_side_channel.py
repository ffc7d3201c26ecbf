"""The ZMQ side channel: addresses, bounded receives, refused frames, liveness."""

from __future__ import annotations

import time

import pytest
import zmq

from kvbridge.connector import messages as m
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.connector.side_channel import (SideChannelClient, SideChannelError, SideChannelServer, parse_address,
                                             poll_clients)

HB = m.Heartbeat("d", 0, ("r1",))


@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:5", ("127.0.0.1", 5)),
    ("tcp://127.0.0.2:65535", ("127.0.0.2", 65535)),
    ("[::1]:0", ("::1", 0)),
    ("[fd00::1]:7000", ("fd00::1", 7000)),
    ("localhost:80", ("localhost", 80)),
])
def test_parse_address(text: str, want: tuple[str, int]) -> None:
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["", "host", ":5", "h:x", "h:70000", "::1:5", "[::1]5"])
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(SideChannelError, match="bad side-channel address"):
        parse_address(text)


@pytest.fixture
def server():
    s = SideChannelServer("127.0.0.1:0", max_frame_bytes=8192)
    yield s
    s.close()


def test_round_trip_and_reply(server: SideChannelServer) -> None:
    c = SideChannelClient(server.address, b"d/0/x", max_frame_bytes=8192)
    try:
        assert c.send(HB)
        got = server.recv(2.0)
        assert [r.msg for r in got] == [HB] and got[0].peer == b"d/0/x" and got[0].error is None
        assert server.send(got[0].peer, m.Abort("p", 0, "r1", "why"))
        back = c.recv(2.0)
        assert back[0].msg == m.Abort("p", 0, "r1", "why")
        assert not server.send(b"nobody", HB)  # ROUTER_MANDATORY: an unknown peer is an error, not a black hole
    finally:
        c.close()


def test_receive_waits_at_most_its_timeout(server: SideChannelServer) -> None:
    c = SideChannelClient(server.address, b"quiet")
    try:
        for timeout in (0.0, 0.05, 0.2):
            t0 = time.monotonic()
            assert server.recv(timeout) == [] and c.recv(timeout) == []
            assert time.monotonic() - t0 < 2 * timeout + 0.1
        t0 = time.monotonic()
        assert poll_clients([c], 0.1) == []
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(SideChannelError, match=r"no reply from .* within 0.2 s"):
            c.request(HB, 0.2, (m.Hello,))
    finally:
        c.close()


def test_malformed_and_wrong_version_frames_are_reported_not_raised(server: SideChannelServer) -> None:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.ROUTING_ID, b"hostile")
    raw.connect(f"tcp://{server.address}")
    try:
        raw.send(b"\xc1garbage")
        raw.send_multipart([b"two", b"parts"])
        raw.send(b"\x82\xa1v\x02\xa3msg\xc0")  # {"v": 2, "msg": nil}
        got = []
        deadline = time.monotonic() + 3
        while len(got) < 3 and time.monotonic() < deadline:
            got += server.recv(0.1)
        errors = [str(r.error) for r in got]
        assert len(got) == 3 and all(r.msg is None and r.peer == b"hostile" for r in got)
        assert "malformed" in errors[0]
        assert "expected one frame per message, got 2 parts" in errors[1]
        assert "protocol version 2 refused" in errors[2]
    finally:
        raw.close(0)


def test_oversized_frame_dropped_by_zmq_and_server_keeps_serving(server: SideChannelServer) -> None:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{server.address}")
    good = SideChannelClient(server.address, b"good", max_frame_bytes=8192)
    try:
        raw.send(b"\x00" * 100_000)  # above the server's 8 KiB MAXMSGSIZE: ZMQ closes that connection
        assert server.recv(0.5) == []
        assert good.send(HB)
        got = []
        deadline = time.monotonic() + 3
        while not got and time.monotonic() < deadline:
            got = server.recv(0.1)
        assert [r.msg for r in got] == [HB]
        spec, layout = ModelSpec.uniform(1, 1, 8), EngineLayout()
        big = m.Hello("d", 0, "decode", "pull", layout, spec, "shm", "a", b"z" * 9000, m.Fingerprint.of(spec, layout))
        with pytest.raises(m.FrameTooLarge, match="above the frame bound 8192"):  # our client refuses to send it
            good.send(big)
    finally:
        raw.close(0)
        good.close()


def test_client_notices_a_lost_server() -> None:
    server = SideChannelServer("127.0.0.1:0")
    c = SideChannelClient(server.address, b"watcher", heartbeat_seconds=0.2)
    try:
        c.send(HB)
        assert server.recv(2.0)
        deadline = time.monotonic() + 2
        while not c.connected_once and time.monotonic() < deadline:
            c.recv(0.02)
        assert c.connected_once and not c.lost
        server.close()
        deadline = time.monotonic() + 3
        while not c.lost and time.monotonic() < deadline:
            c.recv(0.05)
        assert c.lost
    finally:
        c.close()
        server.close()


def test_ipv6_loopback() -> None:
    try:
        server = SideChannelServer("[::1]:0")
    except SideChannelError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    c = SideChannelClient(server.address, b"v6")
    try:
        assert server.address.startswith("[::1]:")
        c.send(HB)
        got = []
        deadline = time.monotonic() + 3
        while not got and time.monotonic() < deadline:
            got = server.recv(0.1)
        assert got[0].msg == HB
    finally:
        c.close()
        server.close()


def test_bind_failure_is_clear() -> None:
    s = SideChannelServer("127.0.0.1:0")
    try:
        with pytest.raises(SideChannelError, match=f"cannot listen on {s.address}"):
            SideChannelServer(s.address)
    finally:
        s.close()


@pytest.mark.parametrize("reader", ["recv", "poll_clients"])
def test_frames_read_with_the_handshake_reply_are_kept(server: SideChannelServer, reader: str) -> None:
    """A server may announce work right after answering the handshake; both frames can arrive in
    the one read that finds the reply. The frames after the reply reach the next receive, in order."""
    import threading
    c = SideChannelClient(server.address, b"d/0/held", max_frame_bytes=8192)
    follow = [m.Abort("p", 0, f"r{i}", "after the reply") for i in range(3)]

    def answer() -> None:
        got = []
        while not got:
            got = server.recv(0.5)
        for msg in (HB, *follow):  # the reply and what follows it, back to back
            assert server.send(got[0].peer, msg)

    t = threading.Thread(target=answer)
    try:
        t.start()
        time.sleep(0.3)  # let every frame arrive before the client reads: one read holds them all
        assert c.request(HB, 5.0, (m.Heartbeat,)) == HB
        t.join(5)
        got: list = []
        end = time.monotonic() + 10.0  # the server's sends returned, but on a starved host ZMQ's I/O
        while len(got) < len(follow) and time.monotonic() < end:  # thread may not have delivered all
            if reader == "recv":
                got += [r.msg for r in c.recv(0.2)]
            else:
                got += [r.msg for _, r in poll_clients([c], 0.2)]
        assert got == follow
        assert c.recv(0.0) == []  # handed out once
    finally:
        t.join(5)
        c.close()


def test_a_starved_server_is_not_lost_and_a_dead_one_is() -> None:
    """Liveness is the peer host's kernel's answer, not the peer process's: a server process
    stopped (SIGSTOP, as a scheduler starving it) for 6x the heartbeat keeps its link; killed,
    it is lost at once. (ZMTP heartbeats, answered by the process, dropped the stopped one.)"""
    import signal
    import subprocess
    import sys
    code = ("import sys, time; from kvbridge.connector.side_channel import SideChannelServer as S; "
            "s = S('127.0.0.1:0'); print(s.address, flush=True); "
            "[s.recv(0.2) for _ in iter(int, 1)]")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    c = None
    try:
        address = proc.stdout.readline().strip()
        c = SideChannelClient(address, b"starved", heartbeat_seconds=1.0)
        c.send(HB)
        deadline = time.monotonic() + 10
        while not c.connected_once and time.monotonic() < deadline:
            c.recv(0.05)
        assert c.connected_once
        proc.send_signal(signal.SIGSTOP)
        stopped_until = time.monotonic() + 6.0
        while time.monotonic() < stopped_until:
            assert c.send(HB)  # frames queue up unanswered
            c.recv(0.2)
            assert not c.lost, "a stopped (starved) server was declared lost"
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while not c.lost and time.monotonic() < deadline:
            c.recv(0.05)
        assert c.lost
    finally:
        if c is not None:
            c.close()
        proc.kill()
        proc.wait(10)

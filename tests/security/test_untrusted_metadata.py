"""Peer metadata and secrets, attacked in-process: the shm transport's segment checks, agent
metadata bounds, the transport notification channel's HMAC, the secret file rules."""

from __future__ import annotations

import os
import stat
import time
import uuid

import msgspec
import pytest
import zmq

from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret, read_secret_file, resolve_secret, write_secret_file
from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.transport.agent import META_VERSION, AgentMeta, RegionInfo, host_id
from kvbridge.transport.notify import Channel
from kvbridge.transport.shm import SHM_DIR, SharedSegment, ShmTransport, _ShmEngine, shared_bytes


def _name(tag: str) -> str:
    return f"kvbridge-{os.getpid()}-{tag}-{uuid.uuid4().hex[:12]}"


def _meta(names, sizes, *, regions=None, seg=None, off=None, notify="tcp://127.0.0.1:9", pid=None) -> bytes:
    regions = regions if regions is not None else [RegionInfo(1 << 20, 4096, -1)]
    engine = msgspec.msgpack.encode(_ShmEngine(names, sizes, seg if seg is not None else [0] * len(regions),
                                               off if off is not None else [0] * len(regions)))
    return msgspec.msgpack.encode(AgentMeta(META_VERSION, "shm", "evil", host_id(), pid or os.getpid(), notify,
                                            regions, None, 0, engine))


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


@pytest.fixture
def agent():
    a = ShmTransport("victim")
    a.register([shared_bytes(8192, "victim")])
    yield a
    a.close()


def test_shm_maps_only_our_own_kvbridge_segments(agent, tmp_path) -> None:
    canary = tmp_path / "canary"
    canary.write_bytes(b"\0" * 4096)
    link, fifo, twice, right = _name("link"), _name("fifo"), _name("twice"), _name("ok")
    os.symlink(canary, os.path.join(SHM_DIR, link))
    os.mkfifo(os.path.join(SHM_DIR, fifo), 0o600)
    with open(os.path.join(SHM_DIR, twice), "wb") as f:
        f.write(b"\0" * 4096)
    os.link(os.path.join(SHM_DIR, twice), os.path.join(SHM_DIR, twice + "x"))
    good = SharedSegment(4096, "ok")  # a real peer segment (created like a peer would)
    own = os.path.basename(agent._own[0].path)
    cases = [
        (["/etc/passwd"], [4096], {}, "not a kvbridge segment name"),
        (["../../etc/passwd"], [4096], {}, "not a kvbridge segment name"),
        (["passwd"], [4096], {}, "not a kvbridge segment name"),
        ([link], [4096], {}, "symlinks are not followed"),
        ([fifo], [4096], {}, "not a regular file"),
        ([twice], [4096], {}, "2 links"),
        ([os.path.basename(good.path)], [8192], {}, "8192"),  # the peer lies about the size
        ([os.path.basename(good.path)], [4096], {"off": [1]}, "outside its segment"),
        ([os.path.basename(good.path)], [4096], {"seg": [3]}, "outside its segment"),
        ([os.path.basename(good.path)], [4096], {"seg": [0, 0]}, "regions with 2 segment indices"),
        ([own], [8192], {}, "of this agent"),
        ([], [], {}, "0 segments"),
        ([os.path.basename(good.path)] * 2, [4096] * 2, {}, "twice"),
        ([os.path.basename(good.path)], [-1], {}, "size -1"),
    ]
    try:
        for names, sizes, kw, expect in cases:
            t0 = time.perf_counter()
            with pytest.raises(InvalidRequest, match=expect):
                agent.connect("evil", _meta(names, sizes, **kw))
            assert time.perf_counter() - t0 < 0.5
        assert canary.read_bytes() == b"\0" * 4096
        maps = _maps()
        assert not any(n in maps for n in (str(canary), link, fifo, twice, "/etc/passwd"))
        agent.connect("evil", _meta([os.path.basename(good.path)], [4096]))  # the honest form works
        assert agent.figures()["mapped"] == 1
    finally:
        for n in (link, fifo, twice, twice + "x"):
            os.unlink(os.path.join(SHM_DIR, n))
        good.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="creating another user's file needs root")
def test_shm_refuses_another_users_segment(agent) -> None:
    name = _name("other")
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chown(path, 65534, 65534)
    os.chmod(path, 0o666)
    try:
        with pytest.raises(InvalidRequest, match="owned by uid 65534"):
            agent.connect("evil", _meta([name], [4096]))
    finally:
        os.unlink(path)


def test_agent_metadata_bounds(agent) -> None:
    name = os.path.basename(SharedSegment(4096, "x").path)
    for kw, expect in [
        ({"notify": "ipc:///tmp/evil"}, "expected tcp://HOST:PORT"),
        ({"notify": "tcp://127.0.0.1:99999"}, "expected tcp://HOST:PORT"),
        ({"pid": 1 << 40}, "pid"),
        ({"regions": [RegionInfo(1 << 20, 1 << 60, -1)]}, "out of bounds"),
        ({"regions": [RegionInfo(0, 4096, -1)]}, "out of bounds"),
        ({"regions": [RegionInfo(1 << 20, 4096, 1 << 30)]}, "out of bounds"),
        ({"regions": [RegionInfo(1 << 20, 16, -1)] * 70000}, "70000 regions"),
    ]:
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequest, match=expect):
            agent.connect("evil", _meta([name], [4096], **kw))
        assert time.perf_counter() - t0 < 0.5, kw
    with pytest.raises(InvalidRequest, match="not kvbridge agent metadata"):
        agent.connect("evil", msgspec.msgpack.encode({"version": "x"}))


def test_notification_channel_refuses_unsigned_and_replayed_messages() -> None:
    secret = generate_secret()
    a, b = Channel("a"), Channel("b")
    a.authenticate(secret)
    b.authenticate(secret)
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(a.endpoint)
    spy = zmq.Context.instance().socket(zmq.PULL)  # captures one of b's signed messages
    spy.setsockopt(zmq.LINGER, 0)
    port = spy.bind_to_random_port("tcp://127.0.0.1")
    try:
        b.connect("a", a.endpoint)
        b.send("a", 0, b"legit")
        deadline, got = time.monotonic() + 5, []
        while not got and time.monotonic() < deadline:
            got = a.recv(100)
        assert got == [("b", 0, b"legit")]
        b.connect("spy", f"tcp://127.0.0.1:{port}")
        b.send("spy", 0, b"release r0")
        captured = spy.recv_multipart()
        raw.send_multipart([b"b", b"\x00", b"release r0"])  # unsigned, claiming to be b
        raw.send_multipart(captured)  # b's signed message to another agent, replayed to a
        raw.send_multipart([b"b", b"\x00", b"legit", captured[3]])  # a MAC of another message
        raw.send_multipart(captured[:3] + [b"\0" * len(captured[3])])  # a forged MAC
        deadline, got = time.monotonic() + 2, []
        while a.refused < 4 and time.monotonic() < deadline:
            got += a.recv(100)
        assert got == [] and a.refused == 4
        b.send("a", 0, b"still served")
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = a.recv(100)
        assert got == [("b", 0, b"still served")]
    finally:
        raw.close(0)
        spy.close(0)
        a.close()
        b.close()


def test_secret_file_rules(tmp_path) -> None:
    path = tmp_path / "s"
    secret = write_secret_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret_file(path) == secret
    assert ConnectorConfig(secret_file=str(path)).secret == secret
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match="lets group or others access it; chmod 600"):
        read_secret_file(path)
    os.chmod(path, 0o600)
    os.symlink(path, tmp_path / "link")
    with pytest.raises(ConfigError, match="symlinks are refused"):
        read_secret_file(tmp_path / "link")
    (tmp_path / "short").write_bytes(b"abc")
    os.chmod(tmp_path / "short", 0o600)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        read_secret_file(tmp_path / "short")
    with pytest.raises(ConfigError, match="no such file"):
        read_secret_file(tmp_path / "missing")
    with pytest.raises(ConfigError, match="needs a shared secret"):
        ConnectorConfig()
    with pytest.raises(ConfigError, match="not both"):
        resolve_secret(secret, str(path))
    with pytest.raises(ConfigError, match="contradict"):
        ConnectorConfig(secret=secret, insecure=True)
    assert ConnectorConfig(insecure=True).secret is None


@pytest.mark.parametrize("kind", ["shm", "nixl"])
def test_connector_trusts_transport_notifications_only_when_they_carry_a_mac(kind) -> None:
    from kvbridge.connector.endpoint import authenticate_transport
    from kvbridge.connector.transports import make_transport, unavailable_reason
    why = unavailable_reason(kind)
    if why:
        pytest.skip(why)
    t = make_transport(kind, f"trust-{kind}-{uuid.uuid4().hex[:6]}")
    try:
        assert authenticate_transport(t, None) is True  # insecure: nothing to trust or distrust
        # shm's notifications travel on the HMAC'd channel; NIXL carries its own, without a MAC
        assert authenticate_transport(t, generate_secret()) is (kind == "shm")
    finally:
        t.close()

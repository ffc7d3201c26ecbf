"""A forged decode peer against a real prefill server process on loopback (docs/security.md).

The server (`run_prefill_server` in `peer_process.py`, push mode over shm, secret from a 0600
file) is attacked from this process with raw ZMQ sockets and only public facts (the model's
geometry, the kvbridge version, this host's id): an unauthenticated Hello naming /etc/passwd, a
Hello signed with a wrong key, a replayed frame, an oversized frame, a flood of garbage, a Hello
with TP 1,000,000; then, holding the secret, Hellos whose shm metadata names /etc/passwd, a path,
a symlink in /dev/shm, another user's segment, a wrong size, a region outside its segment.
Every attempt must get an `Error` reply (or a dropped connection) and nothing else: no
announcement, no handshake, no file mapped, bounded CPU and memory per frame; a legitimate decode
client is served right after.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq

from kvbridge.connector import messages as m
from kvbridge.connector.handshake import make_hello
from kvbridge.core.secrets import read_secret_file, write_secret_file
from kvbridge.connector.side_channel import FrameAuth
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.agent import META_VERSION, AgentMeta, RegionInfo, host_id
from kvbridge.transport.shm import SHM_DIR, _ShmEngine

HERE = Path(__file__).parent
SRC = str(HERE.parent.parent / "src")
COMMON = {"transport": "shm", "mode": "push", "model": "tiny-llama", "prompt_len": 21, "seed": 5, "timeout": 90.0}
C2S, S2C = b"kvbridge-sc1 c->s", b"kvbridge-sc1 s->c"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(role: str, args: dict, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(HERE / "peer_process.py"), role, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env, start_new_session=True)


def _line(proc: subprocess.Popen, prefix: str, timeout: float, log: Path) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line[len(prefix):].strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line within {timeout} s (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the rank processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _usage(pids: list[int]) -> tuple[int, float]:
    """(RSS bytes, CPU seconds) of `pids` together."""
    rss, cpu, tick = 0, 0.0, os.sysconf("SC_CLK_TCK")
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            rss += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            cpu += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return rss, cpu


def _mapped_or_open(pids: list[int], names: list[str]) -> list[str]:
    hits = []
    for p in pids:
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
            fds = [os.readlink(f"/proc/{p}/fd/{fd}") for fd in os.listdir(f"/proc/{p}/fd")]
        except OSError:
            continue
        hits += [f"{p}: {n}" for n in names if n in maps or any(n in f for f in fds)]
    return hits


class Attacker:
    """A raw DEALER to the server: sends frames as given, reads every reply part."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"evil-{uuid.uuid4().hex[:8]}".encode())
        self.sock.connect(f"tcp://{address}")

    def send(self, *parts: bytes) -> None:
        self.sock.send_multipart(list(parts))

    def replies(self, timeout: float = 5.0, want: int = 1) -> list[m.Message]:
        out: list[m.Message] = []
        deadline = time.monotonic() + timeout
        while len(out) < want and self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            parts = self.sock.recv_multipart()
            out.append(m.decode(parts[0]))
        return out

    def close(self) -> None:
        self.sock.close(0)


def _spec():
    import torch

    from kvbridge.proofs import tiny_models as hf
    from kvbridge.proofs.workload import model_config as _model_config
    return hf.spec_for(_model_config("tiny-llama"), torch.float32)


def _hello(spec, names: list[str], sizes: list[int], *, tp: int = 1, region_bytes: int = 4096,
           offset: int = 0) -> m.Hello:
    """A decode Hello from engine "evil" whose shm metadata names `names` (sizes as given)."""
    layout = EngineLayout(tp_size=tp, block_size=16, num_blocks=64)
    engine = msgspec.msgpack.encode(_ShmEngine(names, sizes, [0], [offset]))
    meta = msgspec.msgpack.encode(AgentMeta(META_VERSION, "shm", "evil/0", host_id(), os.getpid(),
                                            "tcp://127.0.0.1:9", [RegionInfo(1 << 20, region_bytes, -1)], None, 0,
                                            engine))
    return make_hello("evil", 0, "decode", "push", spec, layout, "shm", "evil/0", meta)


@pytest.fixture
def world(tmp_path: Path):
    secret_file = tmp_path / "secret"
    write_secret_file(secret_file)
    address = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "server.log"
    server = _start("prefill", {**COMMON, "listen": address, "secret_file": str(secret_file)}, log)
    try:
        _line(server, "LISTENING ", 120, log)
        yield server, address, secret_file, log
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)


def test_forged_peers_get_nothing_and_a_real_client_is_served_after(world, tmp_path: Path) -> None:
    server, address, secret_file, log = world
    secret = read_secret_file(secret_file)
    spec = _spec()
    pids = _tree(server.pid)
    canary = tmp_path / "canary"
    canary.write_bytes(b"\0" * 4096)
    foreign = [f"kvbridge-{os.getpid()}-link-{uuid.uuid4().hex[:12]}", f"kvbridge-{os.getpid()}-other-"
               f"{uuid.uuid4().hex[:12]}", f"kvbridge-{os.getpid()}-small-{uuid.uuid4().hex[:12]}"]
    os.symlink(canary, os.path.join(SHM_DIR, foreign[0]))
    with open(os.path.join(SHM_DIR, foreign[1]), "wb") as f:
        f.write(b"\0" * 4096)
    with open(os.path.join(SHM_DIR, foreign[2]), "wb") as f:
        f.write(b"\0" * 100)
    root = os.geteuid() == 0
    if root:
        os.chown(os.path.join(SHM_DIR, foreign[1]), 65534, 65534)  # another user's segment
    evil = Attacker(address)
    report: list[tuple[str, str]] = []
    try:
        rss0, cpu0 = _usage(pids)
        # 1. unauthenticated Hello naming /etc/passwd
        evil.send(m.encode(_hello(spec, ["/etc/passwd"], [4096])))
        (reply,) = evil.replies()
        assert isinstance(reply, m.Error) and "unauthenticated frame refused" in reply.reason, reply
        report.append(("unauthenticated Hello", reply.reason))
        # 2. a Hello signed with another key
        frame = m.encode(_hello(spec, ["/etc/passwd"], [4096]))
        evil.send(frame, FrameAuth(b"guessed key, 16 bytes or more", C2S, S2C).sign(frame))
        (reply,) = evil.replies()
        assert isinstance(reply, m.Error) and "bad HMAC" in reply.reason, reply
        report.append(("wrong key", reply.reason))
        # 3. a captured (validly signed) frame, replayed from another connection
        frame = m.encode(m.Heartbeat("decode", 0, ("r0",)))
        captured = FrameAuth(secret, C2S, S2C).sign(frame)
        evil.send(frame, captured)
        (reply,) = evil.replies()
        assert "before a handshake" in reply.reason, reply
        replay = Attacker(address)
        replay.send(frame, captured)
        (reply,) = replay.replies()
        replay.close()
        assert isinstance(reply, m.Error) and "replayed frame refused" in reply.reason, reply
        report.append(("replayed frame", reply.reason))
        # 4. huge: TP 1,000,000 unauthenticated; a 4 MiB frame; 3000 garbage frames
        t0 = time.perf_counter()
        evil.send(m.encode(_hello(spec, ["x"], [1], tp=1_000_000)))
        (reply,) = evil.replies()
        assert "unauthenticated" in reply.reason and time.perf_counter() - t0 < 2.0, reply
        big = Attacker(address)
        big.send(os.urandom(4 << 20))
        assert big.replies(1.0) == []  # ZMQ drops the connection before buffering the frame
        big.close()
        for i in range(3000):
            evil.send(os.urandom(64 + i % 512))
        got = evil.replies(30.0, want=3000)
        assert len(got) == 3000 and all(isinstance(r, m.Error) for r in got)
        rss1, cpu1 = _usage(pids)
        report.append(("3000 garbage frames", f"RSS {(rss1 - rss0) / 2**20:+.1f} MiB, CPU {cpu1 - cpu0:.2f} s"))
        assert rss1 - rss0 < 64 << 20, (rss0, rss1)
        assert (cpu1 - cpu0) / 3005 < 0.005, cpu1 - cpu0  # < 5 ms of CPU per refused frame
        # 5. with the secret: hostile metadata is refused and no file is opened
        signer = FrameAuth(secret, C2S, S2C)
        hostile = [
            ("/etc/passwd", _hello(spec, ["/etc/passwd"], [4096]), "not a kvbridge segment name"),
            ("a path", _hello(spec, [f"../{foreign[1]}"], [4096]), "not a kvbridge segment name"),
            ("a symlink in /dev/shm", _hello(spec, [foreign[0]], [4096]), "symlinks are not followed"),
            ("another user's segment" if root else "a segment of ours of another size",
             _hello(spec, [foreign[1]], [4096] if root else [8192]), "owned by uid" if root else "bytes, the peer"),
            ("a wrong size", _hello(spec, [foreign[2]], [4096]), "100 bytes, the peer registered 4096"),
            ("a region outside its segment", _hello(spec, [foreign[2]], [100], region_bytes=4096),
             "outside its segment"),
            ("TP 1,000,000", _hello(spec, [foreign[2]], [100], tp=1_000_000), "tp_size 1000000: the bound is"),
        ]
        for what, hello, expect in hostile:
            frame = m.encode(hello)
            t0 = time.perf_counter()
            evil.send(frame, signer.sign(frame))
            (reply,) = evil.replies()
            took = time.perf_counter() - t0
            assert isinstance(reply, m.Error) and expect in reply.reason, (what, reply)
            assert took < 2.0, (what, took)
            report.append((f"authenticated Hello naming {what}", f"{reply.reason} ({took * 1e3:.1f} ms)"))
        assert canary.read_bytes() == b"\0" * 4096
        assert _mapped_or_open(_tree(server.pid), ["/etc/passwd", str(canary), *foreign]) == []
        assert evil.replies(0.5) == []  # nothing announced to the attacker
    finally:
        evil.close()
        for name in foreign:
            os.unlink(os.path.join(SHM_DIR, name))
    # 6. the legitimate decode client is served right after
    dlog = tmp_path / "decode.log"
    client = _start("decode", {**COMMON, "prefill": address, "secret_file": str(secret_file), "new_tokens": 2},
                    dlog)
    try:
        result = json.loads(_line(client, "RESULT ", 240, dlog))
        assert result["ok"], result
    finally:
        if client.poll() is None:
            client.kill()
        client.wait(10)
    served = json.loads(_line(server, "RESULT ", 120, log))
    assert served["decode_engines"] == ["decode"] and served["all_done"], served
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    report.append(("legitimate decode client right after", f"served: engines {served['decode_engines']}, "
                   f"every request released once: {served['all_done']}"))
    print("\n".join(f"{what}: {outcome}" for what, outcome in report))
    if os.environ.get("KVBRIDGE_SECURITY_REPORT"):  # scripts/reliability_report.py renders these rows
        Path(os.environ["KVBRIDGE_SECURITY_REPORT"]).write_text(json.dumps(report))

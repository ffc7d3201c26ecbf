"""atheris (libFuzzer) harness for the side-channel decoder.

    .venv/bin/python tests/fuzz/fuzz_messages.py -runs=200000 -max_total_time=600 [CORPUS_DIR ...]

Feeds arbitrary bytes, and libFuzzer's mutations of valid frames (seeded below, every message
type, with and without the HMAC part), to the exact path a received frame takes:
`side_channel._decode_parts` (what `SideChannelServer.drain` and `SideChannelClient.drain` call on
each ZMQ multipart message, with and without a shared secret) and `messages.decode` (what a
transport notification goes through).

The contract checked on every input (anything else is a crash that libFuzzer reports with the
input that caused it):

* `_decode_parts` never raises; it returns either a message of a side-channel type or a
  `ProtocolError` (`FrameTooLarge`, `VersionMismatch`, `side_channel.AuthenticationError`);
* `messages.decode` raises nothing but `ProtocolError`;
* a decoded message encodes again and decodes to an equal message;
* with a secret, a correctly signed frame is decoded exactly as without one, and the same
  signed frame sent twice is refused as a replay the second time.

Hangs: libFuzzer's `-timeout` (seconds per input) and the caller's wall clock
(tests/fuzz/test_fuzz_messages.py runs this bounded in CI). `check_one_input` is importable
without atheris, so hypothesis drives the same contract where atheris is not installed.

Input layout: byte 0 picks the path (`MODES`), byte 1 the number of extra ZMQ parts, then one
16-bit big-endian length per extra part; the rest is the first part (the frame).
"""

from __future__ import annotations

import os
import sys
import tempfile

MODES = ("server", "server+secret signed", "server+secret raw", "client", "client+secret signed", "notification")
SECRET = b"fuzz-secret-0123456789abcdef"
MAX_FRAME = 1 << 16
"""A smaller frame bound than the default so the size check is reached by mutation too."""

_state: dict = {}


def _setup() -> dict:
    if not _state:
        from kvbridge.connector import messages as m
        from kvbridge.connector import side_channel as sc
        _state.update(
            m=m, sc=sc,
            # one long-lived receiver per direction, as a live engine has: replay state carries over
            server=sc.FrameAuth(SECRET, b"kvbridge-sc1 s->c", b"kvbridge-sc1 c->s"),
            client=sc.FrameAuth(SECRET, b"kvbridge-sc1 c->s", b"kvbridge-sc1 s->c"),
            server_signer=sc.FrameAuth(SECRET, b"kvbridge-sc1 s->c", b"kvbridge-sc1 c->s"),
            client_signer=sc.FrameAuth(SECRET, b"kvbridge-sc1 c->s", b"kvbridge-sc1 s->c"),
        )
    return _state


def split(data: bytes) -> tuple[int, list[bytes]]:
    """(mode, ZMQ parts) of one fuzz input (see the module docstring)."""
    if not data:
        return 0, [b""]
    mode = data[0] % len(MODES)
    extra = (data[1] % 4) if len(data) > 1 else 0
    pos = 2
    lengths = []
    for _ in range(extra):
        lengths.append(int.from_bytes(data[pos:pos + 2], "big") % 512)
        pos += 2
    rest = data[pos:]
    parts = []
    for n in lengths:
        parts.append(rest[len(rest) - n:] if n else b"")
        rest = rest[:len(rest) - n] if n else rest
    return mode, [rest, *reversed(parts)]


def _check_received(r, peer: bytes) -> object | None:
    st = _state
    assert r.peer == peer, r
    assert (r.msg is None) != (r.error is None), f"exactly one of msg/error must be set: {r!r}"
    if r.error is not None:
        assert isinstance(r.error, st["m"].ProtocolError), f"undocumented error type {type(r.error)!r}: {r.error}"
        assert str(r.error), "an error without a reason"
        return None
    assert isinstance(r.msg, st["m"].MESSAGE_TYPES), type(r.msg)
    again = st["m"].decode(st["m"].encode(r.msg))
    assert again == r.msg, (again, r.msg)
    return r.msg


def feedback(r) -> int:
    """One branch per outcome, instrumented so libFuzzer keeps inputs that reach each (msgspec's
    decoder is C, invisible to atheris's Python coverage); the value is unused."""
    if r.msg is not None:
        name = type(r.msg).__name__
        if name == "Hello":
            return 1
        if name == "RequestReady":
            return 2 if r.msg.checksum is None else 3
        if name == "DestinationReady":
            return 4
        if name == "ReadDone":
            return 5
        if name == "WriteDone":
            return 6
        if name == "Heartbeat":
            return 7
        if name == "Abort":
            return 8
        return 9
    text = str(r.error)
    if text.startswith("malformed frame"):
        return 10
    if text.startswith("invalid message"):
        if "$.msg.layout" in text:
            return 11
        if "$.msg.spec" in text:
            return 12
        if "$.msg.fingerprint" in text:
            return 13
        if "missing required field" in text:
            return 14
        if "Invalid value" in text:
            return 15
        return 16
    if text.startswith("frame of"):
        return 17
    if "replayed" in text:
        return 18
    if "HMAC" in text or "authenticat" in text:
        return 19
    return 20


def check_one_input(data: bytes) -> None:
    """Raise AssertionError (or whatever escaped the decoder) if the contract is broken."""
    st = _setup()
    m, sc = st["m"], st["sc"]
    mode, parts = split(bytes(data))
    name = MODES[mode]
    frame = parts[0]
    if name == "notification":
        try:
            msg = m.decode(frame, MAX_FRAME)
        except m.ProtocolError as e:
            assert str(e)
            return
        assert isinstance(msg, m.MESSAGE_TYPES)
        return
    server = name.startswith("server")
    peer = b"peer-id" if server else b""
    receiver = st["server" if server else "client"] if "secret" in name else None
    if name.endswith("signed"):
        # A peer that shares the secret sends this frame: authentication passes, the decoder runs.
        signer = st["client_signer" if server else "server_signer"]
        auth = signer.sign(frame)
        got = sc._decode_parts(peer, [frame, auth], MAX_FRAME, receiver)
        plain = sc._decode_parts(peer, [frame], MAX_FRAME, None)
        _check_received(got, peer)
        _check_received(plain, peer)
        feedback(got)
        assert got.msg == plain.msg and type(got.error) is type(plain.error), (got, plain)
        if len(frame) <= MAX_FRAME:  # (a larger one is refused by size before the MAC is looked at)
            replay = sc._decode_parts(peer, [frame, auth], MAX_FRAME, receiver)
            assert _check_received(replay, peer) is None and isinstance(replay.error, sc.AuthenticationError), replay
        return
    r = sc._decode_parts(peer, parts, MAX_FRAME, receiver)
    _check_received(r, peer)
    feedback(r)


def seeds() -> list[bytes]:
    """Valid frames of every message type, prefixed for each mode (the corpus libFuzzer mutates)."""
    from kvbridge.connector import messages as m
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.spec import ModelSpec
    spec = ModelSpec.uniform(2, 4, 16, "bfloat16")
    layout = EngineLayout(tp_size=2, block_size=16, num_blocks=64)
    msgs = [
        m.Hello("p", 0, "prefill", "pull", layout, spec, "shm", "p/0", b"\x00meta", m.Fingerprint.of(spec, layout),
                ("127.0.0.1:1", "127.0.0.1:2")),
        m.RequestReady("p", 1, "req-1", ((1, 2, 3), (4, 5, 6)), 40, 29.5, 17, -12345),
        m.DestinationReady("d", 0, "req-1", ((9, 8),), 20, 4),
        m.ReadDone("d", 3, "req-1"), m.WriteDone("p", 0, "req-1"), m.Heartbeat("d", 0, ("a", "b")),
        m.Abort("d", 0, "req-1", "lease expired"), m.Error("p", 0, "refused", "req-1"),
    ]
    sc_auth = b"\x00" * (16 + 8 + 8 + 32)
    out = []
    for msg in msgs:
        frame = m.encode(msg)
        for mode in range(len(MODES)):
            out.append(bytes([mode, 0]) + frame)
        # a second part shaped like an HMAC, into the receivers with and without a secret
        out.append(bytes([0, 1]) + len(sc_auth).to_bytes(2, "big") + frame + sc_auth)
        out.append(bytes([2, 1]) + len(sc_auth).to_bytes(2, "big") + frame + sc_auth)
    return out


def write_seeds(directory: str) -> None:
    for i, s in enumerate(seeds()):
        with open(os.path.join(directory, f"seed-{i:03d}"), "wb") as f:
            f.write(s)


def atheris_unavailable() -> str | None:
    """Why the atheris run cannot happen here (None when it can)."""
    try:
        import atheris  # noqa: F401
    except ImportError as e:
        return (f"atheris is not installed ({e}); it ships wheels for CPython 3.11-3.13 on x86-64 Linux only "
                "(pip install 'kvbridge[test]' installs it there); hypothesis drives the same contract")
    return None


def run_atheris(runs: int, max_seconds: int, workdir: str, wall_timeout: float | None = None,
                script: str | None = None) -> dict:
    """Run this harness in a child process, bounded by `runs` inputs (0: no bound) and
    `max_seconds` of fuzzing, under a hard wall clock (`wall_timeout`, default `max_seconds`
    plus time for the child to import torch on a loaded host). A hang is a child still running
    at the wall clock (killed, `hung`), or libFuzzer's per-input `-timeout` (30 s) firing.

    Returns runs executed and seconds as libFuzzer counted them, the exit status, the crash
    artifacts it wrote (none expected) and the tail of its output. `script`: another harness
    with the same command line (default this one)."""
    import re
    import subprocess
    import time
    corpus = os.path.join(workdir, "corpus")
    os.makedirs(corpus, exist_ok=True)
    script = os.path.abspath(script or __file__)
    cmd = [sys.executable, script, f"-runs={runs if runs > 0 else -1}",
           f"-max_total_time={max_seconds}", "-timeout=30", "-rss_limit_mb=4096", "-print_final_stats=1",
           f"-artifact_prefix={os.path.join(workdir, '')}", corpus]
    wall = wall_timeout if wall_timeout is not None else max_seconds + 300.0
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=wall, errors="replace")
        out, rc, hung = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"") + (e.stderr or b"")
        out = text.decode(errors="replace") if isinstance(text, bytes) else text
        rc, hung = None, True
    done = re.search(r"Done (\d+) runs in (\d+) second", out)
    crashes = sorted(n for n in os.listdir(workdir) if n.startswith(("crash-", "timeout-", "oom-", "leak-")))
    lines = [ln for ln in out.splitlines() if not ln.startswith("INFO: Instrumenting")]
    return {"runs": int(done[1]) if done else 0, "seconds": int(done[2]) if done else None, "rc": rc,
            "hung": hung, "crashes": crashes, "wall_seconds": time.monotonic() - t0,
            "corpus_files": len(os.listdir(corpus)), "tail": "\n".join(lines[-40:]),
            "command": " ".join([f"tests/fuzz/{os.path.basename(script)}", *cmd[2:-2], "CORPUS"])}


def main(argv: list[str]) -> None:
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if not corpus:  # a fresh corpus of valid frames in a temporary directory, removed afterwards
        import subprocess  # (libFuzzer ends the process without running Python's exit handlers)
        with tempfile.TemporaryDirectory(prefix="kvbridge-fuzz-corpus-") as tmp:
            write_seeds(tmp)
            sys.exit(subprocess.call([sys.executable, os.path.abspath(__file__), *argv[1:], tmp]))
    import atheris
    with atheris.instrument_imports(include=["kvbridge"]):  # before anything imports kvbridge
        _setup()
    if not any(os.listdir(d) for d in corpus if os.path.isdir(d)):
        write_seeds(corpus[0])
    atheris.instrument_func(feedback)
    atheris.Setup(argv, check_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)

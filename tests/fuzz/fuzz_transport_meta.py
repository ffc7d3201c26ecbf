"""atheris (libFuzzer) harness for the transport metadata a peer sends in its Hello.

    .venv/bin/python tests/fuzz/fuzz_transport_meta.py -runs=200000 -max_total_time=600 [CORPUS_DIR ...]

Byte 0 picks the path, the rest is the input:

* 0: `transport_metadata` as `Agent.connect` takes it: `AgentMeta` decoding, `peer_meta.
  check_agent_meta`, then the shm engine's part (`_ShmEngine` decoding, `shm._check_layout`,
  `shm.open_peer_segment` for every segment it names);
* 1: a side-channel frame as a prefill rank takes a Hello: `messages.decode`, then
  `peer_bounds.check_hello_bounds`.

Contract: path 0 raises nothing but what `connect` turns into `InvalidRequest` (msgspec's
`DecodeError`, and `ValueError`: msgspec raises `UnicodeDecodeError` for invalid UTF-8 in a
string, found by this harness), `InvalidRequest` or `FileNotFoundError`, and opens no file that is not a kvbridge segment of this user (any
descriptor it gets is checked and closed); path 1 raises nothing but `ProtocolError` or
`HandshakeRefused`. Each input takes bounded time (libFuzzer's `-timeout`).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile

_state: dict = {}


def _setup() -> dict:
    if not _state:
        import msgspec

        from kvbridge.connector import messages, peer_bounds
        from kvbridge.errors import InvalidRequest
        from kvbridge.transport import agent, peer_meta, shm
        _state.update(msgspec=msgspec, messages=messages, peer_bounds=peer_bounds, InvalidRequest=InvalidRequest,
                      agent=agent, peer_meta=peer_meta, shm=shm)
    return _state


def _connect_checks(data: bytes) -> None:
    s = _setup()
    msgspec, shm = s["msgspec"], s["shm"]
    try:
        try:  # the decoding steps exactly as `Agent.connect` and `ShmTransport._engine_connect` catch them
            meta = s["agent"]._meta_decoder.decode(data)
        except (msgspec.DecodeError, ValueError):
            return
        s["peer_meta"].check_agent_meta("fuzz", "peer", meta)
        try:
            eng = msgspec.msgpack.decode(meta.engine, type=shm._ShmEngine)
        except (msgspec.DecodeError, ValueError):
            return
        paths = shm._check_layout("fuzz", "peer", meta, eng)
        for path, size in zip(paths, eng.sizes):
            fd = shm.open_peer_segment(path, size)
            try:  # only a kvbridge segment of ours may ever come back
                st = os.fstat(fd)
                assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid(), path
                assert os.path.basename(path).startswith("kvbridge-"), path
            finally:
                os.close(fd)
    except (s["InvalidRequest"], FileNotFoundError):
        pass


def _hello_checks(data: bytes) -> None:
    s = _setup()
    m = s["messages"]
    try:
        msg = m.decode(data)
        if isinstance(msg, m.Hello):
            s["peer_bounds"].check_hello_bounds(msg)
    except (m.ProtocolError, m.HandshakeRefused):
        pass


def check_one_input(data: bytes) -> None:
    if not data:
        return
    (_connect_checks if data[0] % 2 == 0 else _hello_checks)(bytes(data[1:]))


def seeds() -> list[bytes]:
    """Valid inputs of both paths (a real segment name among them), to mutate."""
    s = _setup()
    msgspec, agent, shm, m = s["msgspec"], s["agent"], s["shm"], s["messages"]
    from kvbridge.connector.handshake import make_hello
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.spec import ModelSpec
    name = f"kvbridge-{os.getpid()}-fuzz-0123456789ab"
    out = []
    for names, sizes, seg, off in ((["kvbridge-1-x-0123456789ab"], [4096], [0], [0]), ([name], [1 << 20], [0, 0],
                                                                                        [0, 4096])):
        engine = msgspec.msgpack.encode(shm._ShmEngine(names, sizes, seg, off))
        regions = [agent.RegionInfo(1 << 20, 4096, -1) for _ in seg]
        meta = msgspec.msgpack.encode(agent.AgentMeta(agent.META_VERSION, "shm", "peer", "host/boot", 1234,
                                                      "tcp://127.0.0.1:5555", regions, None, 0, engine))
        out.append(b"\0" + meta)
    spec = ModelSpec.uniform(2, 4, 16, "bfloat16", name="fuzz")
    for tp in (1, 4, 1 << 20):
        hello = make_hello("d", 0, "decode", "pull", spec, EngineLayout(tp_size=tp, num_blocks=64), "shm", "d/0",
                           out[0][1:])
        out.append(b"\1" + m.encode(hello))
    return out


def main(argv: list[str]) -> None:
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if not corpus:
        import subprocess
        with tempfile.TemporaryDirectory(prefix="kvbridge-fuzz-meta-") as tmp:
            sys.exit(subprocess.call([sys.executable, os.path.abspath(__file__), *argv[1:], tmp]))
    import atheris
    with atheris.instrument_imports(include=["kvbridge"]):
        _setup()
    if not any(os.listdir(d) for d in corpus if os.path.isdir(d)):
        for i, seed in enumerate(seeds()):
            with open(os.path.join(corpus[0], f"seed-{i:03d}"), "wb") as f:
                f.write(seed)
    atheris.Setup(argv, check_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)

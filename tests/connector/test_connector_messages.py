"""Side-channel messages: round trips, and refusal of malformed, oversized, wrong-version frames."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.connector import messages as m
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec

SPEC = ModelSpec.uniform(2, 4, 16, "bfloat16")
LAYOUT = EngineLayout(tp_size=2, block_size=16, num_blocks=64)


def hello(**kw) -> m.Hello:
    base = dict(engine_id="p", rank=0, role="prefill", mode="pull", layout=LAYOUT, spec=SPEC, transport="shm",
                agent_name="p/0", transport_metadata=b"\x00meta", fingerprint=m.Fingerprint.of(SPEC, LAYOUT),
                peer_addresses=("127.0.0.1:1", "127.0.0.1:2"))
    return m.Hello(**{**base, **kw})


EXAMPLES = [
    hello(),
    m.RequestReady("p", 1, "req-1", ((1, 2, 3), (4, 5, 6)), 40, 29.5, 17),
    m.RequestReady("p", 1, "req-1", ((),), 0, 0.0),
    m.DestinationReady("d", 0, "req-1", ((9, 8),), 20, 4),
    m.ReadDone("d", 3, "req-1"),
    m.WriteDone("p", 0, "req-1"),
    m.Heartbeat("d", 0, ("a", "b")),
    m.Abort("d", 0, "req-1", "lease expired"),
    m.Error("p", 0, "refused", "req-1"),
    m.Error("", 0, "anonymous"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg: m.Message) -> None:
    data = m.encode(msg)
    assert m.decode(data) == msg
    assert msgspec.msgpack.decode(data)["v"] == m.PROTOCOL_VERSION


def test_fingerprint_fields_and_compatibility() -> None:
    fp = m.Fingerprint.of(SPEC, LAYOUT)
    assert fp.model == SPEC.fingerprint() and fp.dtype == "bfloat16" and fp.kernel_block_size == 16
    assert fp.kv_layout == "HND/kv_first/per_layer"
    other = m.Fingerprint.of(ModelSpec.uniform(2, 4, 16, "float16"), LAYOUT)
    with pytest.raises(m.HandshakeRefused, match="KV dtype differs: local bfloat16, remote float16"):
        fp.check_compatible(other)
    newer = msgspec.structs.replace(fp, kvbridge_version="9.9.9")
    with pytest.raises(m.HandshakeRefused, match=r"kvbridge version differs: local \S+, remote 9.9.9"):
        fp.check_compatible(newer)
    # Layout and kernel block size may differ between engines: kvbridge plans across them.
    fp.check_compatible(m.Fingerprint.of(SPEC, EngineLayout(block_size=32, kernel_block_size=8, kv_order="NHD")))


def _frame(v, msg) -> bytes:
    return msgspec.msgpack.encode({"v": v, "msg": msg})


def test_wrong_version_refused_before_schema() -> None:
    # Version 2 with a body this version cannot parse: the error is about the version.
    with pytest.raises(m.VersionMismatch, match="protocol version 2 refused: this peer speaks version 1"):
        m.decode(_frame(2, {"type": "something_new", "x": 1}))
    with pytest.raises(m.VersionMismatch):
        m.decode(_frame(0, msgspec.to_builtins(m.ReadDone("d", 0, "r"))))


@pytest.mark.parametrize("data, match", [
    (b"", "empty frame"),
    (b"\xc1", "malformed"),
    (b"\x92\x01\x02", "malformed"),  # an array, not a map
    (msgspec.msgpack.encode({"msg": {}}), "malformed"),  # no version
    (msgspec.msgpack.encode({"v": "1"}), "malformed"),
    (_frame(1, {"type": "nope"}), "Invalid value 'nope'"),
    (_frame(1, {"type": "read_done", "engine_id": "d", "rank": -1, "request_id": "r"}), r"\$.msg.rank"),
    (_frame(1, {"type": "read_done", "engine_id": "", "rank": 0, "request_id": "r"}), r"\$.msg.engine_id"),
    (_frame(1, {"type": "read_done", "engine_id": "d", "rank": 0, "request_id": "r", "extra": 1}), "unknown field"),
    (_frame(1, {"type": "read_done", "engine_id": "d", "rank": 0}), "missing required field `request_id`"),
    (_frame(1, {"type": "request_ready", "engine_id": "p", "rank": 0, "request_id": "r", "block_ids": [[-5]],
                "num_tokens": 1, "lease_seconds": 1.0}), r"block_ids"),
    (_frame(1, {"type": "request_ready", "engine_id": "p", "rank": 0, "request_id": "r", "block_ids": [[1]],
                "num_tokens": 1, "lease_seconds": 1e12}), r"lease_seconds"),
    (_frame(1, {"type": "heartbeat", "engine_id": "d", "rank": 0, "request_ids": ["x" * 300]}), r"request_ids"),
    (_frame(1, {"v": 1}), "missing required field `type`"),
    (_frame(1, [1, 2]), r"Expected `object`, got `array` - at `\$.msg`"),
])
def test_malformed_frames_refused(data: bytes, match: str) -> None:
    with pytest.raises(m.ProtocolError, match=match):
        m.decode(data)


def test_hello_with_invalid_layout_is_refused_by_schema() -> None:
    body = msgspec.to_builtins(hello())
    body["layout"]["tp_size"] = 0
    with pytest.raises(m.ProtocolError, match=r"TP size.*\$.msg.layout"):
        m.decode(_frame(1, body))


def test_oversized_frames_refused_on_both_ends() -> None:
    big = m.Hello(**{**{f: getattr(hello(), f) for f in hello().__struct_fields__},
                     "transport_metadata": b"x" * 5000})
    with pytest.raises(m.FrameTooLarge, match="above the frame bound 4096"):
        m.encode(big, max_frame_bytes=4096)
    data = m.encode(big)
    with pytest.raises(m.FrameTooLarge, match=f"frame of {len(data)} bytes refused: the bound is 4096"):
        m.decode(data, max_frame_bytes=4096)
    # The size check comes before any parsing: garbage of the wrong size is refused as too large.
    with pytest.raises(m.FrameTooLarge):
        m.decode(b"\xc1" * (m.MAX_FRAME_BYTES + 1))


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(m.ProtocolError, match="not a side-channel message"):
        m.encode(LAYOUT)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_decoder_fuzz_random_bytes(data: bytes) -> None:
    try:
        m.decode(data)
    except m.ProtocolError:
        pass


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
                     | st.binary(max_size=20),
                     lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children,
                                                                                        max_size=4),
                     max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EXAMPLES), st.data())
def test_decoder_fuzz_mutated_messages(msg: m.Message, data: st.DataObject) -> None:
    """Replace one field of a valid message with arbitrary msgpack: decoded or refused, never a crash."""
    body = msgspec.to_builtins(msg)
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = data.draw(_json)
    try:
        out = m.decode(_frame(1, body))
    except m.ProtocolError:
        return
    assert isinstance(out, m.MESSAGE_TYPES)

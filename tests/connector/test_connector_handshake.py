"""Handshake: an incompatible peer is refused before any byte moves, naming both values."""

from __future__ import annotations

import msgspec
import pytest
from connector_harness import SPEC, Cluster, pumping, require

from kvbridge.connector import messages as m
from kvbridge.connector.consumer import Consumer
from kvbridge.connector.handshake import make_hello, validate_peer
from kvbridge.connector.transports import make_transport
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import LayerSpec, ModelSpec
from kvbridge.core.topology import TransferTopology

P = EngineLayout(tp_size=2, num_blocks=32)
D = EngineLayout(tp_size=1, block_size=8, num_blocks=64, kv_order="NHD")


def _pair(**peer_kw) -> tuple[TransferTopology, m.Hello, m.Hello]:
    topo = TransferTopology("decode", SPEC, D, 0)
    mine = make_hello("decode", 0, "decode", "pull", SPEC, D, "shm", "decode/0", b"")
    kw = dict(engine_id="prefill", rank=0, role="prefill", mode="pull", spec=SPEC, layout=P, transport_name="shm",
              agent_name="prefill/0", transport_metadata=b"")
    kw.update(peer_kw)
    return topo, mine, make_hello(**kw)


def test_compatible_peer_is_registered_with_different_tp_block_size_and_layout() -> None:
    topo, mine, peer = _pair()
    info = validate_peer(topo, mine, peer)
    assert info.layout == P and topo.source_ranks("prefill") == (0, 1)


@pytest.mark.parametrize("peer_kw, message", [
    (dict(spec=ModelSpec.uniform(3, 6, 16, "bfloat16")),
     "layer count differs: local 'decode' 2, remote 'prefill' rank 0 3"),
    (dict(spec=ModelSpec.uniform(2, 6, 16, "float16")),
     "KV dtype differs: local 'decode' bfloat16, remote 'prefill' rank 0 float16"),
    (dict(spec=ModelSpec.uniform(2, 6, 32, "bfloat16")),
     "layer 0 key_dim differs: local 'decode' 16, remote 'prefill' rank 0 32"),
    (dict(spec=ModelSpec((LayerSpec("full", 6, 16, 16), LayerSpec("sliding", 6, 16, 16, 8)), "bfloat16")),
     "layer 1 kind differs: local 'decode' full, remote 'prefill' rank 0 sliding"),
    (dict(mode="push"), "transfer mode differs: local pull, remote 'prefill' rank 0 push"),
    (dict(transport_name="nixl"), "transport differs: local shm, remote 'prefill' rank 0 nixl"),
    (dict(role="decode"), "role clash: local 'decode' is a decode engine and so is remote 'prefill' rank 0"),
    (dict(rank=2), "claims rank 2 of an engine of TP size 2"),
    (dict(layout=EngineLayout(tp_size=4, num_blocks=32)), "cannot shard 6 KV heads over TP=4"),
    (dict(engine_id="decode"), "cannot register the local engine 'decode' as a remote engine"),
])
def test_incompatible_peer_refused_naming_both_values(peer_kw: dict, message: str) -> None:
    topo, mine, peer = _pair(**peer_kw)
    with pytest.raises(m.HandshakeRefused) as e:
        validate_peer(topo, mine, peer)
    assert message in str(e.value)
    assert topo.remote_engine_ids == ()  # nothing registered


def test_version_and_inconsistent_fingerprint_refused() -> None:
    topo, mine, peer = _pair()
    newer = msgspec.structs.replace(peer, fingerprint=msgspec.structs.replace(peer.fingerprint,
                                                                              kvbridge_version="0.0.1-old"))
    with pytest.raises(m.HandshakeRefused, match=r"kvbridge version differs: local \S+, remote 'prefill' rank 0 "
                                                 r"0.0.1-old"):
        validate_peer(topo, mine, newer)
    lying = msgspec.structs.replace(peer, fingerprint=msgspec.structs.replace(peer.fingerprint, kv_layout="NHD/x/y"))
    with pytest.raises(m.HandshakeRefused, match="inconsistent fingerprint: kv_layout 'NHD/x/y' but its declared "
                                                 "spec/layout give 'HND/kv_first/per_layer'"):
        validate_peer(topo, mine, lying)
    short = msgspec.structs.replace(peer, peer_addresses=("127.0.0.1:1",))
    with pytest.raises(m.HandshakeRefused, match="lists 1 rank addresses for an engine of TP size 2"):
        validate_peer(topo, mine, short)


def test_reregistering_a_known_engine_with_another_layout_is_refused() -> None:
    topo, mine, peer = _pair()
    validate_peer(topo, mine, peer)
    validate_peer(topo, mine, peer)  # identical: idempotent
    moved = make_hello("prefill", 1, "prefill", "pull", SPEC, EngineLayout(tp_size=2, num_blocks=64), "shm", "p/1", b"")
    with pytest.raises(m.HandshakeRefused, match="already registered as TP=2 block 16 HND kv_first; it now reports"):
        validate_peer(topo, mine, moved)


def test_refusal_over_the_side_channel_both_sides() -> None:
    """A decode engine of another geometry: the prefill rank refuses it and says why; nothing connects."""
    other = ModelSpec.uniform(2, 6, 8, "bfloat16", name="narrow")
    cl = Cluster(EngineLayout(tp_size=1, num_blocks=32), EngineLayout(tp_size=2, num_blocks=32), decode_spec=other)
    try:
        with pytest.raises(m.HandshakeRefused) as e:
            cl.connect(timeout=3)
        text = str(e.value)
        assert "prefill engine 'prefill' rank 0 at" in text and "refused decode 'decode' rank 0" in text
        assert "layer 0 key_dim differs: local 'prefill' 16, remote 'decode' rank 0 8" in text
        assert cl.producers[0].stats["handshakes_refused"] == 1 and cl.producers[0].decode_engines == ()
        assert cl.consumers[0].prefill_engines == ()
    finally:
        cl.close()


def test_mode_mismatch_refused_over_the_side_channel() -> None:
    cl = Cluster(EngineLayout(tp_size=1, num_blocks=32), EngineLayout(tp_size=1, num_blocks=32), mode="pull")
    push = Consumer("decode-push", 0, cl.dst[0], make_transport("shm", "dp/0"), mode="push", config=cl.config)
    try:
        with pumping(cl.producers), pytest.raises(
                m.HandshakeRefused, match="transfer mode differs: local pull, remote 'decode-push' rank 0 push"):
            push.connect(cl.address, 3)
    finally:
        push.close()
        push.transport.close()
        cl.close()


def test_transport_mismatch_refused_over_the_side_channel() -> None:
    require("mooncake")
    cl = Cluster(EngineLayout(tp_size=1, num_blocks=32), EngineLayout(tp_size=1, num_blocks=32))
    consumer = Consumer("decode-mc", 0, cl.dst[0], make_transport("mooncake", "dm/0"), config=cl.config)
    try:
        with pumping(cl.producers), pytest.raises(
                m.HandshakeRefused, match="transport differs: local shm, remote 'decode-mc' rank 0 mooncake"):
            consumer.connect(cl.address, 3)
    finally:
        consumer.close()
        consumer.transport.close()
        cl.close()


def test_unresponsive_address_fails_within_the_handshake_timeout() -> None:
    import socket
    import time

    from kvbridge.connector.side_channel import SideChannelError
    cl = Cluster(EngineLayout(tp_size=1, num_blocks=32), EngineLayout(tp_size=1, num_blocks=32))
    try:
        with socket.socket() as s:  # a listening TCP port that never speaks ZMTP
            s.bind(("127.0.0.1", 0))
            s.listen()
            t0 = time.monotonic()
            with pytest.raises(SideChannelError, match=r"no reply from 127.0.0.1:\d+ within 0.5 s"):
                cl.consumers[0].connect(f"127.0.0.1:{s.getsockname()[1]}", 0.5)
            assert time.monotonic() - t0 < 2.0
    finally:
        cl.close()


def _identity(**values) -> KVIdentity:
    base = {"weights": "a1b2", "dtype": "bfloat16", "config.rope_theta": 10000.0,
            "config.rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}
    base.update(values)
    return KVIdentity.of(base)


@pytest.mark.parametrize("theirs, message", [
    (_identity(**{"config.rope_theta": 500000.0}),
     "KV identity differs in config.rope_theta: local 'decode' 10000.0, remote 'prefill' rank 0 500000.0"),
    (_identity(weights="ffff"), 'KV identity differs in weights: local \'decode\' "a1b2", remote'),
    (_identity(quantization="fp8"), "KV identity differs in quantization: local 'decode' (absent)"),
    (None, "only local 'decode' states its KV identity"),
])
def test_a_peer_whose_kv_means_something_else_is_refused_naming_the_field(theirs, message) -> None:
    """Same geometry, other meaning (weights, RoPE, quantization): refused before any byte moves."""
    topo, _, peer = _pair(identity=theirs)
    mine = make_hello("decode", 0, "decode", "pull", SPEC, D, "shm", "decode/0", b"", identity=_identity())
    with pytest.raises(m.HandshakeRefused) as e:
        validate_peer(topo, mine, peer)
    assert message in str(e.value)
    assert topo.remote_engine_ids == ()
    same = make_hello("prefill", 0, "prefill", "pull", SPEC, P, "shm", "prefill/0", b"", identity=_identity())
    assert validate_peer(TransferTopology("decode", SPEC, D, 0), mine, same).layout == P


def test_a_kv_identity_is_bounded_and_shows_long_values_as_digests() -> None:
    ident = _identity(**{"config.long": "x" * 10_000})
    shown = dict(ident.fields)
    assert shown["config.long"].startswith("sha256:") and len(shown["config.long"]) <= 56
    assert shown["config.rope_scaling"].startswith("sha256:")  # its JSON is longer than 48 characters
    assert ident.digest() != _identity().digest() and ident.digest() == _identity(**{"config.long": "x" * 10_000}).digest()
    wire = msgspec.msgpack.encode(ident)
    assert msgspec.msgpack.decode(wire, type=KVIdentity) == ident
    with pytest.raises(msgspec.ValidationError):  # a peer cannot send an unbounded identity
        msgspec.msgpack.decode(msgspec.msgpack.encode({"fields": [["f", "v" * 100]]}), type=KVIdentity)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"fields": [[f"f{i}", "v"] for i in range(600)]}),
                               type=KVIdentity)

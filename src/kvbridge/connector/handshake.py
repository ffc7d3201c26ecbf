"""The handshake rules both sides apply to a peer's `Hello`, before any byte moves.

Why both sides: the decode rank must refuse a prefill engine whose cache it cannot read, and
the prefill rank must refuse a decode engine it would write into (push) or whose reads it
would count (pull). Each side registers the peer in its own `TransferTopology`, which is
where geometry and sharding are judged; this module adds what the topology cannot know
(protocol role and mode, transport name, fingerprint consistency, kvbridge version) and turns
every refusal into a `HandshakeRefused` whose message names the local and the remote value.
"""

from __future__ import annotations

from kvbridge.connector.peer_bounds import check_hello_bounds
from kvbridge.connector.messages import Fingerprint, HandshakeRefused, Hello, Mode, Role, layout_name
from kvbridge.errors import KVBridgeError
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.core.topology import EngineTransferInfo, TransferTopology


def make_hello(engine_id: str, rank: int, role: Role, mode: Mode, spec: ModelSpec, layout: EngineLayout,
               transport_name: str, agent_name: str, transport_metadata: bytes,
               peer_addresses: tuple[str, ...] = (), identity: KVIdentity | None = None) -> Hello:
    return Hello(engine_id=engine_id, rank=rank, role=role, mode=mode, layout=layout, spec=spec,
                 transport=transport_name, agent_name=agent_name, transport_metadata=transport_metadata,
                 fingerprint=Fingerprint.of(spec, layout, identity), peer_addresses=peer_addresses)


def validate_peer(topology: TransferTopology, mine: Hello, peer: Hello) -> EngineTransferInfo:
    """Refuse or register `peer` in `topology`; returns the registered engine info."""
    who = f"remote {peer.engine_id!r} rank {peer.rank}"
    check_hello_bounds(peer)  # before any work that scales with what the peer declares
    if peer.role == mine.role:
        raise HandshakeRefused(f"role clash: local {mine.engine_id!r} is a {mine.role} engine and so is {who}")
    if peer.mode != mine.mode:
        raise HandshakeRefused(f"transfer mode differs: local {mine.mode}, {who} {peer.mode}")
    if peer.transport != mine.transport:
        raise HandshakeRefused(f"transport differs: local {mine.transport}, {who} {peer.transport}")
    if not 0 <= peer.rank < peer.layout.world_size:
        raise HandshakeRefused(f"{who} claims rank {peer.rank} of an engine of {peer.layout.describe_ranks()}")
    declared = Fingerprint.of(peer.spec, peer.layout)
    # A fingerprint that disagrees with the layout and spec in the same message is a broken or
    # lying peer: compare every field except the version, which check_compatible reports.
    for name in ("model", "dtype", "kv_layout", "kernel_block_size"):
        if getattr(peer.fingerprint, name) != getattr(declared, name):
            raise HandshakeRefused(
                f"{who} sent an inconsistent fingerprint: {name} {getattr(peer.fingerprint, name)!r} but its "
                f"declared spec/layout give {getattr(declared, name)!r}")
    if peer.fingerprint.kvbridge_version != mine.fingerprint.kvbridge_version:
        raise HandshakeRefused(f"kvbridge version differs: local {mine.fingerprint.kvbridge_version}, "
                               f"{who} {peer.fingerprint.kvbridge_version}")
    try:  # the geometry check names the first differing field, which a digest cannot
        topology.spec.check_compatible(peer.spec, f"local {mine.engine_id!r}", who)
    except KVBridgeError as e:
        raise HandshakeRefused(f"{who} refused: {e}") from None
    mine.fingerprint.check_compatible(peer.fingerprint, f"local {mine.engine_id!r}", who)
    if peer.peer_addresses and len(peer.peer_addresses) != peer.layout.world_size:
        raise HandshakeRefused(f"{who} lists {len(peer.peer_addresses)} rank addresses for an engine of "
                               f"{peer.layout.describe_ranks()}")
    try:
        return topology.register_remote_engine(peer.engine_id, peer.layout, peer.spec)
    except HandshakeRefused:
        raise
    except KVBridgeError as e:
        raise HandshakeRefused(f"{who} refused: {e}") from None


def describe(hello: Hello) -> str:
    return (f"{hello.role} engine {hello.engine_id!r} rank {hello.rank} ({hello.layout.describe()}, "
            f"{layout_name(hello.layout)}, transport {hello.transport})")


__all__ = ["describe", "make_hello", "validate_peer"]

"""Side-channel messages: typed, versioned, size-bounded msgspec structs.

Every frame on the side channel is one msgpack map `{"v": PROTOCOL_VERSION, "msg": <tagged
struct>}`. Decoding is done in the order a hostile or merely old peer requires:

1. the frame's length is checked against `max_frame_bytes` *before* any parsing, so a peer
   cannot make us allocate or parse an arbitrarily large object;
2. only the version header is read next, so a peer speaking another protocol version gets an
   error that says "version 2, we speak 1" instead of a confusing schema error about a field
   that moved;
3. the whole frame is decoded against the schema: unknown fields are refused, every id, count
   and list length is bounded (`msgspec.Meta`), and the embedded `EngineLayout` / `ModelSpec`
   run their own validation. An error names the field (`$.msg.num_tokens`).

Messages and their direction (P = prefill/producer rank, D = decode/consumer rank):

| message            | direction | meaning |
|--------------------|-----------|---------|
| `Hello`            | D -> P, P -> D | handshake: who I am, my layout, model, transport metadata, fingerprint |
| `RequestReady`     | P -> D    | a request's source blocks are filled and leased; here are their ids |
| `DestinationReady` | D -> P    | push mode: my blocks for the request are allocated; write here |
| `ReadDone`         | D -> P    | pull mode: my reads from you for this request finished (you may release) |
| `WriteDone`        | P -> D    | push mode: my writes into you for this request finished (bytes landed) |
| `Heartbeat`        | D -> P    | I am still working on these requests: extend their leases |
| `Abort`            | both      | the request is cancelled; the sender has no transfer for it in flight anymore |
| `Error`            | both      | the sender refused a message (malformed, incompatible, unknown) |

`ReadDone` and `WriteDone` are also what a transfer's transport-level notification carries, so
one decoder serves both paths and a duplicate arriving on both is recognised as such.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from kvbridge.errors import IncompatibleEngines, KVBridgeError
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec

PROTOCOL_VERSION = 1
"""Bumped on any change of a message's schema; peers of another version are refused."""

MAX_FRAME_BYTES = 1 << 20
"""Default bound of one encoded frame (1 MiB): a Hello with NIXL metadata is a few KiB, a
RequestReady for a 128k-token request with 16-token blocks about 25 KiB per group."""

MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_GROUPS = 64
MAX_REQUESTS_PER_HEARTBEAT = 4096
MAX_ADDRESSES = 1024

# Bounded scalar and container types: the schema is the first line of defence.
EngineId = Annotated[str, Meta(min_length=1, max_length=128)]
RequestId = Annotated[str, Meta(min_length=1, max_length=256)]
Rank = Annotated[int, Meta(ge=0, lt=1 << 16)]
BlockId = Annotated[int, Meta(ge=0, lt=1 << 40)]
TokenCount = Annotated[int, Meta(ge=0, lt=1 << 32)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 32)]
Reason = Annotated[str, Meta(max_length=4096)]
Seconds = Annotated[float, Meta(ge=0.0, le=7 * 24 * 3600.0)]
BlockIds = Annotated[tuple[Annotated[tuple[BlockId, ...], Meta(max_length=MAX_BLOCKS_PER_GROUP)], ...],
                     Meta(max_length=MAX_GROUPS)]
Mode = Literal["pull", "push"]
Role = Literal["prefill", "decode"]

_log = logging.getLogger(__name__)


class ProtocolError(KVBridgeError, ValueError):
    """A frame kvbridge refuses to decode (malformed, too large, schema violation)."""


class FrameTooLarge(ProtocolError):
    """A frame above the size bound; refused before any parsing."""


class VersionMismatch(ProtocolError):
    """A frame of another protocol version."""


class HandshakeRefused(IncompatibleEngines):
    """A peer refused at handshake (or refused us); the message names both values."""


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What two engines must agree on before any byte moves, and what they may differ in.

    `model` (the geometry digest of `ModelSpec.fingerprint()`), `dtype` and `kvbridge_version`
    must be equal. `kv_layout` and `kernel_block_size` are carried so both sides see each
    other's choice in one line of a log, but they may differ: kvbridge plans NHD <-> HND and
    any block-size pair. They must, however, match the layout the same Hello declares, so a
    peer cannot claim one layout in its fingerprint and another in its metadata.
    """

    model: Annotated[str, Meta(max_length=64)]
    dtype: Annotated[str, Meta(max_length=32)]
    kv_layout: Annotated[str, Meta(max_length=64)]
    kernel_block_size: Annotated[int, Meta(ge=1, lt=1 << 20)]
    kvbridge_version: Annotated[str, Meta(max_length=32)]
    identity: KVIdentity | None = None
    """What the engine's KV means beyond its geometry (weights, RoPE, overrides, dtypes:
    `core.kv_identity`), as the integration states it; None where nobody states one (a library
    user's engines). Two stated identities must be equal; one side alone stating one is refused."""

    @classmethod
    def of(cls, spec: ModelSpec, layout: EngineLayout, identity: KVIdentity | None = None) -> Fingerprint:
        from kvbridge._version import __version__
        return cls(spec.fingerprint(), spec.dtype, layout_name(layout), layout.kernel_size, __version__, identity)

    def check_compatible(self, other: Fingerprint, mine: str = "local", theirs: str = "remote") -> None:
        """Raise `HandshakeRefused` naming the first field that must match and does not."""
        for name, what in (("kvbridge_version", "kvbridge version"), ("dtype", "KV dtype"),
                           ("model", "model geometry fingerprint")):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise HandshakeRefused(f"{what} differs: {mine} {a}, {theirs} {b}")
        if (self.identity is None) != (other.identity is None):
            stated = mine if self.identity is not None else theirs
            raise HandshakeRefused(f"only {stated} states its KV identity (weights, RoPE, overrides, dtypes): "
                                   f"engines that may compute other KV are not paired")
        if self.identity is not None and other.identity is not None:
            differs = self.identity.first_difference(other.identity)
            if differs is not None:
                field, a, b = differs
                raise HandshakeRefused(f"KV identity differs in {field}: {mine} {a}, {theirs} {b} (their KV "
                                       f"is not interchangeable)")


def layout_name(layout: EngineLayout) -> str:
    """The layout fields that decide where bytes are, as one short string (fingerprint field)."""
    return f"{layout.kv_order}/{layout.kv_placement}/{layout.layer_placement}"


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="hello"):
    """Handshake: everything a peer needs to validate us and to reach our registered memory.

    A decode rank sends it to each prefill rank it talks to; the prefill rank answers with its
    own. Rank 0 of a prefill engine also lists the side-channel address of every rank of its
    engine (`peer_addresses`), so a decode engine needs one bootstrap address.
    """

    engine_id: EngineId
    rank: Rank
    role: Role
    mode: Mode
    layout: EngineLayout
    spec: ModelSpec
    transport: Annotated[str, Meta(max_length=32)]
    agent_name: Annotated[str, Meta(max_length=256)]
    transport_metadata: Annotated[bytes, Meta(max_length=MAX_FRAME_BYTES)]
    fingerprint: Fingerprint
    peer_addresses: Annotated[tuple[Annotated[str, Meta(max_length=300)], ...], Meta(max_length=MAX_ADDRESSES)] = ()


class RequestReady(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="request_ready"):
    """P -> D: the request's KV is complete in these source blocks and leased for `lease_seconds`.

    The lease is sent as seconds *remaining* rather than a wall-clock deadline: two hosts'
    clocks need not agree, a duration measured on each side does.
    """

    engine_id: EngineId
    rank: Rank
    request_id: RequestId
    block_ids: BlockIds
    num_tokens: TokenCount
    lease_seconds: Seconds
    first_token: TokenId | None = None
    checksum: Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None
    """This prefill rank's share of the receiving decode rank's integrity checksum (opt-in), a
    64-bit value sent as signed int64 (msgpack's and msgspec's bound)."""


class DestinationReady(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="destination_ready"):
    """D -> P (push): write the request into these destination blocks of my rank."""

    engine_id: EngineId
    rank: Rank
    request_id: RequestId
    block_ids: BlockIds
    num_tokens: TokenCount
    num_cached_tokens: TokenCount = 0


class ReadDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="read_done"):
    """D -> P (pull): every read this decode rank makes from the receiving prefill rank finished.

    Also sent when there was nothing to read (prefix-cache hit), so the prefill rank releases
    its blocks now instead of at lease expiry.
    """

    engine_id: EngineId
    rank: Rank
    request_id: RequestId


class WriteDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="write_done"):
    """P -> D (push): every write this prefill rank makes into the receiving decode rank landed."""

    engine_id: EngineId
    rank: Rank
    request_id: RequestId


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="heartbeat"):
    """D -> P: these requests are still wanted; extend their leases."""

    engine_id: EngineId
    rank: Rank
    request_ids: Annotated[tuple[RequestId, ...], Meta(max_length=MAX_REQUESTS_PER_HEARTBEAT)] = ()


class Abort(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="abort"):
    """The request is cancelled, with a reason. The sender guarantees that none of *its*
    transfers for the request is still posted, so the receiver may treat it as its
    acknowledgement too (a push writer's Abort tells the decode rank its blocks are quiet)."""

    engine_id: EngineId
    rank: Rank
    request_id: RequestId
    reason: Reason = ""


class Error(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    """The sender refused something we sent (handshake, malformed frame, unknown request)."""

    engine_id: Annotated[str, Meta(max_length=128)]
    rank: Rank
    reason: Reason
    request_id: Annotated[str, Meta(max_length=256)] | None = None


Message = Union[Hello, RequestReady, DestinationReady, ReadDone, WriteDone, Heartbeat, Abort, Error]
MESSAGE_TYPES: tuple[type, ...] = (Hello, RequestReady, DestinationReady, ReadDone, WriteDone, Heartbeat, Abort, Error)


class Frame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    msg: Message


class _Header(msgspec.Struct):
    """Only the version; every other field is skipped unvalidated at this stage."""

    v: int


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_frame_decoder = msgspec.msgpack.Decoder(Frame)


def encode(msg: Message, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One frame; refuses (before sending) a message a well-behaved peer would refuse."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a side-channel message")
    data = _encoder.encode(Frame(PROTOCOL_VERSION, msg))
    if len(data) > max_frame_bytes:
        raise FrameTooLarge(f"{type(msg).__name__} encodes to {len(data)} bytes, above the frame bound "
                            f"{max_frame_bytes}")
    return data


def decode(data: bytes | bytearray | memoryview, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """The message in one frame, or `ProtocolError` (`FrameTooLarge`, `VersionMismatch`) saying why."""
    size = len(data)
    if size > max_frame_bytes:
        raise FrameTooLarge(f"frame of {size} bytes refused: the bound is {max_frame_bytes}")
    if size == 0:
        raise ProtocolError("empty frame")
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed frame ({size} bytes): {e}") from None
    if header.v != PROTOCOL_VERSION:
        raise VersionMismatch(f"frame of protocol version {header.v} refused: this peer speaks version "
                              f"{PROTOCOL_VERSION}")
    try:
        return _frame_decoder.decode(data).msg
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except (ValueError, TypeError, RecursionError) as e:  # pragma: no cover - a nested __post_init__
        raise ProtocolError(f"invalid message: {e}") from None


__all__ = [
    "Abort", "BlockIds", "DestinationReady", "Error", "Fingerprint", "Frame", "FrameTooLarge", "HandshakeRefused",
    "Heartbeat", "Hello", "MAX_FRAME_BYTES", "Message", "PROTOCOL_VERSION", "ProtocolError", "ReadDone",
    "RequestReady", "VersionMismatch", "WriteDone", "decode", "encode", "layout_name",
]


def decoded_notifications(transport: Any, max_frame_bytes: int, stats: dict[str, int],
                          who: str, trusted: bool = True) -> list[tuple[str, Message]]:
    """The transport's pending notifications, decoded; undecodable ones are counted in
    `stats["refused_notifications"]` and logged, and a failing transport yields none (logged).
    Untrusted ones (a secret is configured but the engine's notifications carry no MAC) are
    drained and counted in `stats["unauthenticated_notifications"]`: the side-channel copy counts."""
    try:
        notes = transport.notifications()
    except Exception as e:  # noqa: BLE001 - a broken channel must not stop the engine's loop
        _log.error("%s: transport notifications failed: %s", who, e)
        return []
    if not trusted:
        stats["unauthenticated_notifications"] += len(notes)
        return []
    out = []
    for sender, payload in notes:
        try:
            out.append((sender, decode(payload, max_frame_bytes)))
        except ProtocolError as e:
            stats["refused_notifications"] += 1
            _log.warning("%s refused a transport notification from %s: %s", who, sender, e)
    return out

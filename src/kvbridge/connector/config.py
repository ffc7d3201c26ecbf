"""Every deadline of the request lifecycle, in one place.

The worst failure of a disaggregated server is a wait that never ends, so there is no
"infinite" here: each knob is a finite number of seconds, checked when the config is built.
Defaults follow vLLM's NIXL connector where it has one (5 s handshake receive, 30 s lease,
heartbeats every lease/6 extending the lease to 2/3 of its length), and are small enough that
a failure shows up in a test within seconds when a test shortens them.
"""

from __future__ import annotations

import msgspec

from kvbridge.connector.messages import MAX_FRAME_BYTES
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.core.secrets import resolve_secret
from kvbridge.errors import ConfigError


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True):
    handshake_timeout: float = 5.0
    """Seconds to wait for each peer's Hello reply."""
    transfer_timeout: float = 30.0
    """Seconds a decode rank gives a request, from `receive` to the last byte, before failing it."""
    lease_seconds: float = 30.0
    """Seconds a prefill rank holds a request's blocks without hearing from its readers."""
    heartbeat_interval: float | None = None
    """Seconds between a decode rank's heartbeats per prefill rank (default lease / 6)."""
    abort_timeout: float = 2.0
    """Seconds to wait for a transfer to stop (or a push writer to confirm it stopped) after an abort."""
    announcement_ttl: float | None = None
    """Seconds an unclaimed RequestReady is kept on a decode rank (default: its lease)."""
    remote_engine_ttl: float = 600.0
    """Seconds a remote engine that no request needs stays known (vLLM's transfer topology keeps
    remote engines with a TTL too): a decode rank forgets an idle prefill engine unused this long,
    or at once when all its sources came back as another incarnation; a prefill rank forgets a
    decode engine silent twice this long. Forgetting closes its connections and drops its transport peer and topology
    entry, so fleets whose instances come and go keep bounded state; an engine that comes back
    handshakes anew."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """Bound of one side-channel frame; larger frames are refused on both ends."""
    max_pending: int = 65536
    """Bound on buffered announcements / early destinations / release history per rank."""
    transport_notify: bool = True
    """Also carry ReadDone / WriteDone as the transfer's own notification (NIXL style); the
    side-channel copy is always sent, and the receiver counts whichever arrives first."""
    side_channel_heartbeat: float = 1.0
    """TCP keepalive interval (whole seconds, at least 1) of the side-channel sockets: a peer host that
    answers no probe for 4x this long is dropped; a peer process starved of CPU is not (its
    kernel answers)."""
    checksum: bool = False
    """End-to-end integrity: each prefill rank sends, with a request's announcement, its share
    of the logical checksum (`kvbridge.core.integrity`) of what each decode rank must receive; the
    decode rank recomputes over what landed and fails the request on a mismatch. Covers requests
    without a prefix-cache hit (`num_cached_tokens == 0`); others are counted as skipped. Off by
    default: it costs 76-154x the transfer it checks (`bench/checksum.py`, docs/security.md)."""
    secret: bytes | None = None
    """Shared secret authenticating the side channel (and the transport's notification channel):
    every frame carries an HMAC-SHA256 over the frame, a per-connection session id, a counter and
    a timestamp; frames without a valid MAC (or replayed: counter not increasing, timestamp outside
    `replay_window`) are refused before they are parsed. Required unless `insecure` (or
    `secret_file`); see docs/security.md."""
    secret_file: str | None = None
    """Path of a file holding the secret, read once here (mode 0600, ours, no symlink); the config
    then carries the bytes in `secret` and `secret_file` is None."""
    insecure: bool = False
    """Run the side channel unauthenticated: any host that reaches the port can act as a peer."""
    replay_window: float = 300.0
    """Seconds an authenticated frame's timestamp may differ from the receiver's clock."""
    kv_identity: KVIdentity | None = None
    """What this engine's KV means beyond its geometry (`core.kv_identity`): stated in its Hello,
    a peer whose stated identity differs is refused at handshake, naming the field."""

    def __post_init__(self) -> None:
        for name in ("handshake_timeout", "transfer_timeout", "lease_seconds", "abort_timeout",
                     "side_channel_heartbeat", "remote_engine_ttl"):
            value = getattr(self, name)
            if not 0 < value < 7 * 24 * 3600:
                raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value}")
        for name in ("heartbeat_interval", "announcement_ttl"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 7 * 24 * 3600:
                raise ConfigError(f"{name} must be None or a finite number of seconds > 0, got {value}")
        resolved = resolve_secret(self.secret, self.secret_file, self.insecure)  # read once, then carried
        msgspec.structs.force_setattr(self, "secret", resolved)
        msgspec.structs.force_setattr(self, "secret_file", None)
        if not 0 < self.replay_window < 7 * 24 * 3600:
            raise ConfigError(f"replay_window must be a finite number of seconds > 0, got {self.replay_window}")
        if self.max_frame_bytes < 4096:
            raise ConfigError(f"max_frame_bytes must be >= 4096, got {self.max_frame_bytes}")
        if self.max_pending < 1:
            raise ConfigError(f"max_pending must be >= 1, got {self.max_pending}")

    @property
    def heartbeat_every(self) -> float:
        return self.heartbeat_interval or self.lease_seconds / 6

    @property
    def lease_extension(self) -> float:
        """How far a heartbeat pushes a lease (vLLM: 2/3 of the lease)."""
        return self.lease_seconds * 2 / 3


__all__ = ["ConnectorConfig"]

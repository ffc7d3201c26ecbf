"""`Settings`: KVBridgeConnector's `kv_connector_extra_config`, checked once when vLLM builds the
connector (an unknown key or a bad value is refused by name) and handed to each rank's sidecar
inside its `Init` frame."""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.errors import ConfigError


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config` of KVBridgeConnector; an unknown key is refused (named)."""

    transport: str = "shm"  # shm | nixl | mooncake
    mode: str = "pull"  # pull (decode reads) | push (prefill writes)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5570  # prefill rank r listens on port + r
    # Generous deadlines: on a loaded 2-core host (load average 10-27 while this was measured) a
    # vLLM CPU engine stalls its peers for tens of seconds, and a side channel with 1 s heartbeats
    # (3 s timeout) was dropped; vLLM's own NixlConnector took 114 s for its first transfer in the
    # same conditions.
    lease_seconds: float = 300.0
    transfer_timeout: float = 300.0
    handshake_timeout: float = 120.0
    heartbeat_seconds: float = 10.0  # the side channel's TCP keepalive interval: a peer host silent 4x this long is lost
    stats_path: str = ""  # append one JSON line per transfer event (demos and benchmarks)
    # The side channel's shared secret (docs/security.md): a file (mode 0600) or the text itself,
    # the same on both engines; `insecure: true` runs it unauthenticated. One of them is required.
    secret_file: str = ""
    secret: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "push"):
            raise ConfigError(f"KVBridgeConnector mode must be 'pull' or 'push', got {self.mode!r}")
        if not 0 < self.side_channel_port < 65536:
            raise ConfigError(f"KVBridgeConnector side_channel_port must be in 1..65535, got {self.side_channel_port}")
        if not (self.secret_file or self.secret or self.insecure):
            raise ConfigError("KVBridgeConnector needs a side-channel secret: set kv_connector_extra_config "
                              "secret_file (or secret), the same on both engines, or insecure: true")

    def connector_config(self, identity: KVIdentity | None = None) -> ConnectorConfig:
        # transport_notify=False: completion goes over the side channel only. The transport's
        # notification channel gives a peer 2 s to accept a message and fails the *transfer*
        # otherwise, after its bytes landed (seen on a loaded host: "accepted no message within
        # 2000 ms").
        return ConnectorConfig(lease_seconds=self.lease_seconds, transfer_timeout=self.transfer_timeout,
                               handshake_timeout=self.handshake_timeout, side_channel_heartbeat=self.heartbeat_seconds,
                               transport_notify=False, secret=self.secret.encode() or None,
                               secret_file=self.secret_file or None, insecure=self.insecure, kv_identity=identity)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        try:
            return msgspec.convert(dict(extra or {}), cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"KVBridgeConnector kv_connector_extra_config: {e}") from None


__all__ = ["Settings"]

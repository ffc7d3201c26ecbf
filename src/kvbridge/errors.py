"""Exceptions raised by kvbridge.

Every error a user can trigger is a `KVBridgeError` subclass whose message names the offending
values, so a CLI can print one line and a library caller can catch one type.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """A model config or geometry kvbridge cannot describe (unknown architecture, bad field)."""


class ShardingError(KVBridgeError, ValueError):
    """A TP size that cannot shard the KV heads (neither divides the other)."""


class IncompatibleEngines(KVBridgeError, ValueError):
    """Two engines whose caches cannot exchange bytes (geometry, dtype, layout)."""


class InvalidRequest(KVBridgeError, ValueError):
    """A request whose block ids or token counts do not fit the engines' caches."""

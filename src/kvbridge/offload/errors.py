"""Errors of the offload package: subclasses of kvbridge's own, so one `except KVBridgeError`
catches them, and every message names the values that are wrong."""

from __future__ import annotations

from kvbridge.errors import IncompatibleEngines, InvalidRequest, KVBridgeError


class SpecMismatch(InvalidRequest):
    """A transfer whose GPU and CPU specs do not describe the same blocks (ids not consumed exactly,
    wrong number of groups, bad group sizes or indices)."""


class NotCanonicalizable(IncompatibleEngines):
    """A device layout or pool that cannot be stored in, or loaded from, an offload format
    without ambiguity (block sizes that do not divide, another model geometry)."""


class OffloadStateError(KVBridgeError, RuntimeError):
    """A manager call that breaks the block life cycle (loading a missing or unready block,
    completing a load twice)."""

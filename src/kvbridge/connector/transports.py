"""Choosing and constructing a transport by name, and allocating caches it can register.

The connector only needs the `Transport` protocol; this module is the one place that knows the
backends' constructors and their memory rules: `shm` can only register regions that live in
POSIX shared memory (`transport.shm.allocate_shared`), while `nixl` and `mooncake` register any
CPU (or CUDA) tensor. Backends import lazily, so a missing optional engine fails with its own
import error when (and only when) it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.base import Transport

TRANSPORTS: dict[str, tuple[str, str]] = {
    "shm": ("kvbridge.transport.shm", "ShmTransport"),
    "nixl": ("kvbridge.transport.nixl", "NixlTransport"),
    "mooncake": ("kvbridge.transport.mooncake", "MooncakeTransport"),
}


def transport_class(kind: str) -> type:
    """The backend class for `kind`; raises `ImportError` (the backend's own) if it cannot load."""
    if kind not in TRANSPORTS:
        raise ConfigError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    module, cls = TRANSPORTS[kind]
    return getattr(importlib.import_module(module), cls)


def unavailable_reason(kind: str) -> str | None:
    """None when `kind` can be constructed here, else the exact error that prevents it."""
    try:
        transport_class(kind)
    except Exception as e:  # noqa: BLE001 - reported verbatim (ImportError, OSError from a .so ...)
        return f"{type(e).__name__}: {e}"
    return None


def make_transport(kind: str, agent_name: str, *, host: str = "127.0.0.1", timeout_s: float = 30.0,
                   **kwargs: Any) -> Transport:
    """A transport agent called `agent_name`, reachable on `host` (its notification channel and,
    for network engines, its data plane)."""
    return transport_class(kind)(agent_name, host=host, timeout_s=timeout_s, **kwargs)


def allocate_cache(kind: str, spec: ModelSpec, layout: EngineLayout, rank: int,
                   name_prefix: str = "cache") -> RankCache:
    """A zeroed rank cache in memory the `kind` transport can register."""
    if kind == "shm":
        from kvbridge.transport.shm import allocate_shared
        return allocate_shared(spec, layout, rank, name_prefix=name_prefix)
    return RankCache.allocate(spec, layout, rank)


def transport_kind(transport: Transport) -> str:
    """The backend name carried in a Hello (`shm`, `nixl`, `mooncake`)."""
    return str(getattr(transport, "backend", None) or getattr(transport, "name", type(transport).__name__))


def agent_name(transport: Transport) -> str:
    """The name this agent is known by to peers (what `connect` and notifications use)."""
    if hasattr(transport, "backend"):
        return str(transport.name)  # kvbridge agents: `name` is the agent, `backend` the engine
    return str(getattr(transport, "agent_name", None) or transport.name)


__all__ = ["TRANSPORTS", "agent_name", "allocate_cache", "make_transport", "transport_class", "transport_kind",
           "unavailable_reason"]

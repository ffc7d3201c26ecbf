"""Bounds on a peer agent's metadata (`AgentMeta`), checked in `Agent.connect` before the engine
sees it.

Why: the metadata arrives in a peer's Hello, and even an authenticated peer may be buggy or
hostile. Its numbers size arrays (`regions`), bound the runs we post (`nbytes`), pick devices,
and its `notify` string is an endpoint our channel connects to. Everything is checked here in
O(len(metadata)) with one-line refusals, so no engine call, allocation or connection depends
on an unchecked value:

* names and host ids are short printable strings; the pid is a Linux pid;
* at most `MAX_REGIONS` regions, each of 0..`MAX_REGION_BYTES` bytes at a non-null address,
  on the CPU (-1) or a device ordinal below `MAX_DEVICE`;
* the staging slot size is 0..`MAX_REGION_BYTES`;
* `notify` is `tcp://HOST:PORT` (no ipc://, inproc:// or other transports a peer could aim us at);
* the engine's own blob is at most `MAX_ENGINE_BYTES` (NIXL's metadata is a few KiB).
"""

from __future__ import annotations

import re
from typing import Any

from kvbridge.errors import InvalidRequest

MAX_REGIONS = 1 << 16
MAX_REGION_BYTES = 1 << 44
MAX_DEVICE = 1024
MAX_NAME = 256
MAX_ENGINE_BYTES = 512 << 10
PID_MAX = 1 << 22  # Linux's pid_max ceiling
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):[1-9][0-9]{0,4}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")


def check_endpoint(endpoint: Any, what: str = "notify endpoint") -> str:
    """`endpoint` if it is `tcp://HOST:PORT` with a port in 1..65535, else `InvalidRequest`."""
    if not isinstance(endpoint, str) or not _ENDPOINT.fullmatch(endpoint) or int(endpoint.rsplit(":", 1)[1]) > 65535:
        raise InvalidRequest(f"{what} {str(endpoint)[:100]!r} refused: expected tcp://HOST:PORT")
    return endpoint


def check_agent_meta(agent: str, peer: str, meta: Any) -> None:
    """Raise `InvalidRequest` naming the first field of `meta` (an `AgentMeta`) out of bounds."""
    who = f"{agent}: metadata of peer {peer!r}"
    for field in ("name", "backend"):
        value = getattr(meta, field)
        if not (isinstance(value, str) and 0 < len(value) <= MAX_NAME and "\0" not in value):
            raise InvalidRequest(f"{who}: {field} must be 1..{MAX_NAME} characters without NUL")
    if not (isinstance(meta.host_id, str) and len(meta.host_id) <= 512 and _PRINTABLE.fullmatch(meta.host_id)):
        raise InvalidRequest(f"{who}: host id must be up to 512 printable characters")
    if not (isinstance(meta.pid, int) and 0 < meta.pid < PID_MAX):
        raise InvalidRequest(f"{who}: pid {meta.pid!r} outside 1..{PID_MAX - 1}")
    check_endpoint(meta.notify, f"{who}: notify endpoint")
    if len(meta.regions) > MAX_REGIONS:
        raise InvalidRequest(f"{who}: {len(meta.regions)} regions, the bound is {MAX_REGIONS}")
    infos = list(meta.regions) + ([meta.staging] if meta.staging is not None else [])
    for i, r in enumerate(infos):
        if not (0 < r.addr < 1 << 64 and 0 <= r.nbytes <= MAX_REGION_BYTES and r.addr + r.nbytes < 1 << 64
                and -1 <= r.device < MAX_DEVICE):
            what = "staging region" if i == len(meta.regions) else f"region {i}"
            raise InvalidRequest(f"{who}: {what} ({r.nbytes} B at {r.addr:#x} on device {r.device}) out of bounds")
    if not 0 <= meta.slot_bytes <= MAX_REGION_BYTES:
        raise InvalidRequest(f"{who}: slot size {meta.slot_bytes} outside [0, {MAX_REGION_BYTES}]")
    if len(meta.engine) > MAX_ENGINE_BYTES:
        raise InvalidRequest(f"{who}: {len(meta.engine)} bytes of engine metadata, the bound is {MAX_ENGINE_BYTES}")


__all__ = ["MAX_DEVICE", "MAX_ENGINE_BYTES", "MAX_REGIONS", "MAX_REGION_BYTES", "check_agent_meta",
           "check_endpoint"]

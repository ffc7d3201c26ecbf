"""The frames between a vLLM worker and its sidecar (`sidecar.py`): typed msgspec structs, length-
prefixed on the sidecar's stdin (commands) and stdout (events), as `connector.rank_host` frames them.

    worker -> sidecar   Init, then any of Send / Recv / Expect / Abandon, then Close (or EOF)
    sidecar -> worker   Ready(address), then Released / Received per request, Fatal(error)
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvbridge.connector.rank_host import Failed, Stop
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.integrations.vllm.cache_handles import Region, StorageHandle
from kvbridge.integrations.vllm.settings import Settings


class Init(msgspec.Struct, tag="init"):
    engine_id: str
    rank: int
    produce: bool
    consume: bool
    spec: ModelSpec
    layout: EngineLayout  # the fields of a VllmCpuLayout
    storages: list[StorageHandle]  # the worker's cache memory (cache_handles.py)
    regions: list[Region]  # each layer's bytes in it, in layer order
    settings: Settings
    identity: KVIdentity | None = None  # what the engine's KV means (stated in every Hello)


class Send(msgspec.Struct, tag="send"):
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    to_engine: str | None = None


class Recv(msgspec.Struct, tag="recv"):
    request_id: str  # the decode engine's id (reported back)
    remote_request_id: str
    remote_engine_id: str
    remote_address: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    num_cached_tokens: int
    report: bool = True


class Expect(msgspec.Struct, tag="expect"):
    remote_engine_id: str
    remote_address: str
    remote_request_id: str


class Abandon(msgspec.Struct, tag="abandon"):
    remote_engine_id: str
    remote_request_id: str


Close = Stop
"""Worker -> sidecar: close and exit (answered with `rank_host.Stopped`)."""
class Ready(msgspec.Struct, tag="ready"):
    address: str
    pid: int


class Released(msgspec.Struct, tag="released"):
    request_id: str
    reason: str


class Received(msgspec.Struct, tag="received"):
    request_id: str
    ok: bool
    reason: str = ""


Fatal = Failed
"""Sidecar -> worker: it failed (one line); it exits."""

Command = Union[Init, Send, Recv, Expect, Abandon, Close]
Event = Union[Ready, Released, Received, Fatal]



__all__ = ["Abandon", "Close", "Command", "Event", "Expect", "Fatal", "Init", "Ready", "Received", "Recv", "Released",
           "Send"]

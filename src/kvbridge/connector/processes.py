"""One OS process per engine rank, driven by typed requests (hosted by `connector.rank_host`).

Why processes and not threads: the point of the multi-process demo and of the fault tests is
that each rank owns its memory, its transport agent and its side-channel sockets the way a
serving engine's TP worker does, and that a rank can die (SIGKILL) without taking its peers
with it.

Start method: `forkserver` where the platform has it, with torch and kvbridge (and whatever
modules the caller names, e.g. a model library) preloaded into the fork server once; every rank
process then forks from that clean, single-threaded server in milliseconds instead of
importing torch and transformers again (seconds of CPU each, which on a two-core CI machine
decides whether a test suite with dozens of rank processes fits its budget). Like `spawn`, it
never forks the caller's threads. Set `KVBRIDGE_START_METHOD=spawn` to force `spawn`.

A rank process (`RankService`) runs `Producer.progress` / `Consumer.progress` with a short
timeout, then every request waiting. Everything it learns (its address, handshakes, releases,
request results) comes back as a typed event. Work that is not the connector's (decode rank
0 proving the cache with a model) is named by the caller as an import path (`Run`), so this
engine module imports no proof.

`RankProcess` is the parent's handle: `send(request)`, `expect(EventType, timeout)` (every wait
has a deadline and fails fast, with the child's one-line error, if it failed or died),
`kill()`, `stop()`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.consumer import RequestResult
from kvbridge.connector.rank_host import (Emit, HostError, HostProcess, fill_rows, random_fill, regions_bytes,
                                          resolve, stop_all, warm_copier)
from kvbridge.core.layout import EngineLayout
from kvbridge.errors import KVBridgeError

BlockIds = tuple[tuple[int, ...], ...]

PRELOAD = ["torch", "numpy", "zmq", "msgspec", "kvbridge.connector.processes", "kvbridge.connector.producer",
           "kvbridge.connector.consumer", "kvbridge.transport.shm"]


def process_context(preload: Sequence[str] = ()) -> Any:
    """The multiprocessing context rank processes start from (see the module docstring).

    `preload`: modules the fork server imports too (say, the model code a decode rank will run).
    The fork server is one per process and keeps the preload of its first start.
    """
    method = os.environ.get("KVBRIDGE_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD + list(preload))
    return ctx


class RankProcessError(HostError):
    """A rank process failed, died, or did not answer in time."""


class RankArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank process needs to build its connector (picklable for spawn)."""

    role: str  # "prefill" | "decode"
    engine_id: str
    rank: int
    transport: str
    spec: Any  # ModelSpec
    layout: Any  # EngineLayout
    mode: str = "pull"
    listen: str = "127.0.0.1:0"  # prefill: side-channel bind address
    host: str = "127.0.0.1"  # transport agent host (notification channel / data plane)
    config: Any = None  # ConnectorConfig
    fill_seed: int = 0  # the cache starts as random bytes from this seed
    max_lifetime: float = 600.0
    threads: int = 1


# -- requests (parent -> rank) ---------------------------------------------------------------------
class Lease(msgspec.Struct, frozen=True):
    """A request a prefill rank leases; `fill_seed`: first write fresh random rows (a prefill pass)."""

    request_id: str
    block_ids: BlockIds
    num_tokens: int
    first_token: int | None = None
    lease_seconds: float | None = None
    fill_seed: int | None = None


class Incoming(msgspec.Struct, frozen=True):
    """A request a decode rank receives; `poison_seed`: first overwrite the destination rows."""

    request_id: str
    block_ids: BlockIds
    num_tokens: int | None
    timeout: float | None = None
    engine_id: str | None = None
    poison_seed: int | None = None


class Load(msgspec.Struct, tag="load"):
    """Prefill: overwrite the cache with these region bytes (what the prefill pass computed)."""

    regions: list[np.ndarray]


class Add(msgspec.Struct, tag="add"):
    """Prefill: lease these requests (answered with `Added`)."""

    requests: list[Lease]


class Directory(msgspec.Struct, tag="directory"):
    """Prefill rank 0: every rank's side-channel address, listed in its Hello."""

    addresses: list[str]


class Abort(msgspec.Struct, tag="abort"):
    """Either side: abort a request (answered with `Aborted`)."""

    request_id: str
    reason: str


class GetStats(msgspec.Struct, tag="get_stats"):
    """The connector's counters (answered with `Stats`)."""


class GetFigures(msgspec.Struct, tag="get_figures"):
    """Open descriptors and what the transport agent holds, for leak checks (`Figures`)."""


class GetRegions(msgspec.Struct, tag="get_regions"):
    """A copy of the cache's region bytes (`Regions`)."""


class Connect(msgspec.Struct, tag="connect"):
    """Decode: handshake with the prefill engine at `address` (`Connected` or `ConnectFailed`)."""

    address: str
    timeout: float


class Receive(msgspec.Struct, tag="receive"):
    """Decode: receive these requests (answered with `Receiving`; each ends as a `Result`)."""

    requests: list[Incoming]


class Run(msgspec.Struct, tag="run"):
    """Run `job` ("package.module:function", called as function(cache, payload)) on this rank's
    cache; `payload["others"]` becomes `others` (region bytes of other ranks, by rank)."""

    job: str
    payload: dict[str, Any]
    others: dict[int, list[np.ndarray]] = {}


Request = Union[Load, Add, Directory, Abort, GetStats, GetFigures, GetRegions, Connect, Receive, Run]


# -- events (rank -> parent) -----------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    address: str  # prefill: its side-channel address; decode: ""


class Handshake(msgspec.Struct, tag="handshake"):
    engine_id: str  # a decode engine connected


class Released(msgspec.Struct, tag="released"):
    """The producer released a request's blocks (once per request)."""

    request_id: str
    reason: str


class Result(msgspec.Struct, tag="result"):
    result: RequestResult


class Loaded(msgspec.Struct, tag="loaded"):
    """The cache holds the bytes of `Load`."""


class Added(msgspec.Struct, tag="added"):
    request_ids: list[str]


class DirectorySet(msgspec.Struct, tag="directory_set"):
    """Rank 0 lists the engine's addresses in its Hello from now on."""


class Aborted(msgspec.Struct, tag="aborted"):
    """`aborted`: whether the request was still active on this rank."""

    request_id: str
    aborted: bool


class Stats(msgspec.Struct, tag="stats"):
    stats: dict[str, int]


class Figures(msgspec.Struct, tag="figures"):
    figures: dict[str, int]


class Regions(msgspec.Struct, tag="regions"):
    regions: list[np.ndarray]


class Connected(msgspec.Struct, tag="connected"):
    engine_id: str
    sources: list[int]
    layout: EngineLayout


class ConnectFailed(msgspec.Struct, tag="connect_failed"):
    error: str


class Receiving(msgspec.Struct, tag="receiving"):
    request_ids: list[str]


class Ran(msgspec.Struct, tag="ran"):
    result: Any


Event = Union[Ready, Handshake, Released, Result, Loaded, Added, DirectorySet, Aborted, Stats, Figures, Regions,
              Connected, ConnectFailed, Receiving, Ran]


# -- the rank (child side) -------------------------------------------------------------------------
class RankService:  # pragma: no cover - runs in the child
    """A Producer or Consumer of one rank over its own cache and transport agent."""

    requests = Request

    def __init__(self, args: RankArgs, emit: Emit):
        import torch

        from kvbridge.connector.transports import allocate_cache, make_transport
        torch.set_num_threads(args.threads)
        self.args, self.emit = args, emit
        self.transport = self.connector = None
        config = args.config or ConnectorConfig()
        self.cache = allocate_cache(args.transport, args.spec, args.layout, args.rank,
                                    name_prefix=f"{args.engine_id}-{args.role}")
        random_fill([self.cache], args.fill_seed)
        warm_copier()
        self.transport = make_transport(args.transport, f"{args.engine_id}/{args.rank}/{os.getpid()}",
                                        host=args.host, timeout_s=config.transfer_timeout)
        self.seen: set[str] = set()
        if args.role == "prefill":
            from kvbridge.connector.producer import Producer
            self.connector = Producer(args.engine_id, args.rank, self.cache, self.transport, listen=args.listen,
                                      mode=args.mode, config=config,
                                      on_release=lambda rid, why: emit(Released(rid, why)))
            emit(Ready(self.connector.address))
        else:
            from kvbridge.connector.consumer import Consumer
            self.connector = Consumer(args.engine_id, args.rank, self.cache, self.transport, mode=args.mode,
                                      config=config)
            emit(Ready(""))

    def step(self) -> float:
        if self.args.role == "prefill":
            self.connector.progress(0.002)
            for eng in self.connector.decode_engines:
                if eng not in self.seen:
                    self.seen.add(eng)
                    self.emit(Handshake(eng))
        else:
            for res in self.connector.progress(0.002):
                self.emit(Result(res))
        return 0.0

    def handle(self, req: Any) -> None:
        c, cache, emit = self.connector, self.cache, self.emit
        if isinstance(req, Load):
            import torch
            for dst, src in zip(cache.byte_regions(), req.regions):
                dst.copy_(torch.from_numpy(src))
            emit(Loaded())
        elif isinstance(req, Add):
            for q in req.requests:
                if q.fill_seed is not None:
                    fill_rows(cache, q.block_ids, q.num_tokens, q.fill_seed)
                c.add_request(q.request_id, q.block_ids, q.num_tokens, q.first_token, lease_seconds=q.lease_seconds)
            emit(Added([q.request_id for q in req.requests]))
        elif isinstance(req, Directory):
            c.set_peer_addresses(req.addresses)
            emit(DirectorySet())
        elif isinstance(req, Abort):
            emit(Aborted(req.request_id, c.abort(req.request_id, req.reason)))
        elif isinstance(req, GetStats):
            emit(Stats(dict(c.stats)))
        elif isinstance(req, GetFigures):  # this rank's open descriptors and what its agent holds (leak checks)
            from kvbridge.transport.agent import resource_figures
            emit(Figures({"fds": len(os.listdir("/proc/self/fd")), **resource_figures()}))
        elif isinstance(req, GetRegions):
            emit(Regions(regions_bytes(cache)))
        elif isinstance(req, Connect):
            try:
                engine = c.connect(req.address, req.timeout)
            except KVBridgeError as e:
                emit(ConnectFailed(f"{type(e).__name__}: {e}"))
                return
            emit(Connected(engine, list(c.source_ranks(engine)), c.remote_layout(engine)))
        elif isinstance(req, Receive):
            for q in req.requests:
                if q.poison_seed is not None:
                    fill_rows(cache, q.block_ids, q.num_tokens or 0, q.poison_seed)
                c.receive(q.request_id, q.block_ids, num_tokens=q.num_tokens, timeout=q.timeout,
                          engine_id=q.engine_id)
            emit(Receiving([q.request_id for q in req.requests]))
        elif isinstance(req, Run):
            emit(Ran(resolve(req.job)(cache, {**req.payload, "others": req.others})))

    def stats(self) -> dict[str, int]:
        return dict(self.connector.stats) if self.connector is not None else {}

    def close(self) -> None:
        try:
            if self.connector is not None:
                self.connector.close()
        finally:
            if self.transport is not None:
                self.transport.close()


# -- the parent's handle ---------------------------------------------------------------------------
class RankProcess(HostProcess):
    """Parent-side handle of one rank process (see the module docstring)."""

    def __init__(self, args: RankArgs, context: Any = None):
        self.args = args
        super().__init__("kvbridge.connector.processes:RankService", args, Event,
                         context=context or process_context(), name=f"{args.role} {args.engine_id!r} rank {args.rank}",
                         max_lifetime=args.max_lifetime, error_type=RankProcessError)

    def _reap(self) -> None:
        """Also free the /dev/shm segments a killed rank could not unlink."""
        if self.proc.pid is not None and self.proc.exitcode is not None and self.args.transport == "shm":
            from kvbridge.transport.shm import reap_stale_segments
            reap_stale_segments(self.proc.pid)
        super()._reap()


__all__ = ["Abort", "Aborted", "Add", "Added", "Connect", "ConnectFailed", "Connected", "Directory", "DirectorySet",
           "Event", "Figures", "GetFigures", "GetRegions", "GetStats", "Handshake", "Incoming", "Lease", "Load",
           "Loaded", "Ran", "RankArgs", "RankProcess", "RankProcessError", "RankService", "Ready", "Receive",
           "Receiving", "Regions", "Released", "Request", "Result", "Run", "Stats", "process_context",
           "stop_all"]

"""The prefill side of the lifecycle: lease a request's blocks, tell the readers, release once.

One `Producer` serves one prefill TP rank. The engine gives it the rank's cache (registered
with the transport here) and calls:

* `add_request(id, block_ids, num_tokens, first_token)` when the request's KV is complete in
  those blocks. The blocks are now *leased*: the producer owns them until it calls
  `on_release(id, reason)`, exactly once, after which the engine may reuse them.
* `progress(timeout)` from its loop (it is a state machine, not a thread: no locks, and an
  engine step decides when side-channel work happens). It answers handshakes, handles
  notifications, runs push writes, expires leases.
* `abort(id)` when the engine cancels the request.

When does a request end (and `on_release` fire)?

* pull: every decode rank that reads from this rank (`TransferTopology.reader_ranks`) sent
  `ReadDone` (on the side channel or as its read's transport notification; the first counts,
  later copies are duplicates and only counted);
* push: this rank's writes into every such decode rank completed (the decode rank asked with
  `DestinationReady`);
* the lease expired: no completion within `lease_seconds`, extended by the readers' heartbeats
  to `now + 2/3 lease` each time (vLLM's rule);
* abort, by the engine here or by a decode rank (`Abort`);
* no decode rank reads from this rank at all (GQA dedup or MLA: another rank serves the heads).

Release is idempotent, and it never happens while a transfer this rank posted may still touch
the blocks: posted writes are aborted first and the release waits (bounded retries, never a
blocking wait) until the transport reports them stopped. Any ending other than completion sends
`Abort` to every reader, which both fails the request on the decode side early and tells a push
target that this writer is quiet.

Length: about 560 lines, one state machine (a lease from `add_request` to `on_release`) whose
transitions read best together; what it shares with the decode side is in `endpoint.py`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbridge.connector import messages as m
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.endpoint import RankEndpoint
from kvbridge.connector.handshake import describe, validate_peer
from kvbridge.connector.runs import runs_for
from kvbridge.connector.side_channel import Received, SideChannelServer
from kvbridge.errors import InvalidRequest, KVBridgeError
from kvbridge.core.integrity import contribution_checksums
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.topology import TransferTopology
from kvbridge.transport.base import Handle, Transport, XferState

log = logging.getLogger("kvbridge.connector.producer")

ReleaseCallback = Callable[[str, str], None]


@dataclass
class _Reader:
    """A decode rank that completed the handshake with this rank."""

    engine_id: str
    rank: int
    agent: str
    peer: bytes  # ROUTER routing id


@dataclass
class _Lease:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    first_token: int | None
    lease: float
    expiry: float
    engine: str | None  # decode engine; None until one is connected
    readers: frozenset[int] | None = None
    announced: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    destinations: dict[int, m.DestinationReady] = field(default_factory=dict)
    writes: dict[int, Handle] = field(default_factory=dict)
    ending: str | None = None  # reason, once the release has begun (waiting for writes to stop)
    ending_ok: bool = False
    stop_deadline: float = 0.0
    nbytes: int = 0
    nruns: int = 0
    checksums: list[int] | None = None  # this rank's share of each decode rank's checksum


class Producer(RankEndpoint):
    """Prefill-side connector for one TP rank."""

    role = "prefill"
    kind = "producer"

    def __init__(self, engine_id: str, rank: int, cache: RankCache, transport: Transport, *,
                 listen: str = "127.0.0.1:0", mode: m.Mode = "pull", config: ConnectorConfig | None = None,
                 on_release: ReleaseCallback | None = None, peer_addresses: Sequence[str] = (),
                 clock: Callable[[], float] = time.monotonic, topology: TransferTopology | None = None):
        super().__init__(engine_id, rank, cache, transport, mode=mode, config=config, clock=clock, topology=topology)
        self.on_release = on_release
        self.server = SideChannelServer(listen, max_frame_bytes=self.config.max_frame_bytes,
                                        secret=self.config.secret, replay_window=self.config.replay_window,
                                        heartbeat_seconds=self.config.side_channel_heartbeat)
        self.address = self.server.address
        self._peer_addresses = tuple(peer_addresses)
        self._readers: dict[bytes, _Reader] = {}
        self._engines: dict[str, dict[int, bytes]] = {}
        self._heard: dict[str, float] = {}  # decode engine -> when a frame of it last arrived
        self._next_forget = 0.0
        self._leases: dict[str, _Lease] = {}
        self._early: OrderedDict[str, tuple[float, dict[int, m.DestinationReady]]] = OrderedDict()
        # request id -> (since, decode engine): a decode rank's heartbeat named a request this rank
        # has not leased yet, so that engine will read it (`claimant`: which of several decode
        # engines a request the router did not name belongs to)
        self._claims: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._early_aborts: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._history: OrderedDict[str, str] = OrderedDict()
        self._confirmed: set[tuple[str, int]] = set()  # readers heard from after their Hello
        self.releases: list[tuple[str, str]] = []  # (request id, reason), in order; bounded by max_pending

    # -- public API -------------------------------------------------------------------------------
    def _hello_addresses(self) -> tuple[str, ...]:
        return self._peer_addresses

    def set_peer_addresses(self, addresses: Sequence[str]) -> None:
        """The side-channel address of every rank of this engine, by rank (rank 0 serves it)."""
        if len(addresses) != self.cache.layout.world_size:
            raise KVBridgeError(f"{len(addresses)} addresses for an engine of {self.cache.layout.describe_ranks()}")
        self._peer_addresses = tuple(addresses)

    @property
    def active(self) -> tuple[str, ...]:
        """Requests whose blocks are still leased."""
        return tuple(self._leases)

    @property
    def decode_engines(self) -> tuple[str, ...]:
        return tuple(self._engines)

    def reader_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Ranks of decode engine `engine_id` that completed the handshake with this rank."""
        return tuple(sorted(self._engines.get(engine_id, {})))

    def confirmed_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Ranks of `engine_id` known to be past their handshake: a frame of their own arrived after
        their Hello, on the connection they handshook on (a new Hello unconfirms the rank). What is
        sent to such a rank cannot be lost in its handshake (`SideChannelClient.request` drops the
        frames that arrive with the reply)."""
        return tuple(sorted(r for e, r in self._confirmed if e == engine_id))

    def claimant(self, request_id: str) -> str | None:
        """The decode engine whose heartbeat named `request_id` before it was leased here, if any."""
        claim = self._claims.get(request_id)
        return claim[1] if claim is not None else None

    def take_early_abort(self, request_id: str) -> str | None:
        """Why a decode engine gave `request_id` up before it was leased here (and forget that it
        did), or None: a caller holding blocks for a lease that will never be read releases them."""
        abort = self._early_aborts.pop(request_id, None)
        return abort[1] if abort is not None else None

    def add_request(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
                    first_token: int | None = None, *, to_engine: str | None = None,
                    lease_seconds: float | None = None) -> None:
        """Lease `block_ids` (per KV-cache group) holding the request's `num_tokens` tokens.

        `to_engine` names the decode engine that reads it; without it, the engine that claimed
        the request (its heartbeat named it, `claimant`), else the only connected one."""
        self._check_open()
        if request_id in self._leases or request_id in self._history:
            raise InvalidRequest(f"request id {request_id!r} is already known to prefill rank {self.rank} "
                                 f"(active or recently released); request ids must be unique")
        ids = self._checked_blocks(block_ids, num_tokens, request_id, exact=False)
        lease = float(lease_seconds or self.config.lease_seconds)
        if not 0 < lease < 7 * 24 * 3600:
            raise InvalidRequest(f"lease_seconds must be a finite number of seconds > 0, got {lease}")
        now = self.clock()
        claimed = self._claims.pop(request_id, None)
        if to_engine is None and claimed is not None:
            to_engine = claimed[1]
        req = _Lease(request_id, ids, int(num_tokens), first_token, lease, now + lease, to_engine)
        self._leases[request_id] = req
        self.stats["requests"] += 1
        if to_engine is None and len(self._engines) > 1:
            self._leases.pop(request_id)
            raise InvalidRequest(f"{len(self._engines)} decode engines are connected ({', '.join(self._engines)}): "
                                 f"name one with to_engine=")
        early_abort = self._early_aborts.pop(request_id, None)
        if early_abort is not None:
            self._early.pop(request_id, None)
            self._end(req, early_abort[1], ok=False)
            return
        self._bind(req)
        self._advance(req)

    def abort(self, request_id: str, reason: str = "aborted by the prefill engine") -> bool:
        """End a lease now (writes stopped first). False when the request is not leased here."""
        req = self._leases.get(request_id)
        if req is None:
            return False
        self._end(req, reason, ok=False)
        return True

    def progress(self, timeout: float = 0.0) -> None:
        """One bounded round of work; waits at most `timeout` s for side-channel traffic."""
        if self.closed:
            return
        for rec in self.server.recv(timeout):
            self._on_frame(rec)
        self._transport_notifications()
        now = self.clock()
        for req in list(self._leases.values()):
            if req.ending is None and req.expiry <= now:
                done = len(req.done)
                want = "?" if req.readers is None else str(len(req.readers))
                self.stats["expired"] += 1
                self._end(req, f"lease expired after {req.lease:.1f} s ({done}/{want} decode ranks done)", ok=False)
            else:
                self._advance(req)
        self._expire_early(now)
        self._forget_silent(now)

    def run_until(self, predicate: Callable[[], bool], timeout: float, step: float = 0.01) -> bool:
        """Call `progress` until `predicate()` holds or `timeout` s pass; returns the predicate."""
        deadline = self.clock() + timeout
        while not predicate():
            left = deadline - self.clock()
            if left <= 0:
                return predicate()
            self.progress(min(step, left))
        return True

    def close(self) -> None:
        """End every lease (reason "producer closed"), then close the side channel. Idempotent."""
        if self.closed:
            return
        deadline = self.clock() + self.config.abort_timeout
        for req in list(self._leases.values()):
            if req.ending is None:
                self._end(req, "producer closed", ok=False)
        while self._leases and self.clock() < deadline:
            for req in list(self._leases.values()):
                self._advance(req)
            time.sleep(0.005)
        for rid in list(self._leases):
            log.error("prefill rank %d: request %s still has a posted write at close; its blocks are NOT released",
                      self.rank, rid)
        self.closed = True
        self.server.close()

    # -- frames -----------------------------------------------------------------------------------
    def _on_frame(self, rec: Received) -> None:
        if rec.error is not None:
            self._refuse_frame("", rec.error)
            self._reply(rec.peer, m.Error(self.engine_id, self.rank, f"refused: {rec.error}"))
            return
        msg = rec.msg
        if isinstance(msg, m.Hello):
            self._confirmed.discard((msg.engine_id, msg.rank))
            self._on_hello(rec.peer, msg)
            return
        reader = self._readers.get(rec.peer)
        if reader is None:
            self.stats["refused_frames"] += 1
            self._reply(rec.peer, m.Error(self.engine_id, self.rank,
                                          f"{type(msg).__name__} before a handshake: send Hello first"))
            return
        if (msg.engine_id, msg.rank) != (reader.engine_id, reader.rank) and not isinstance(msg, m.Error):
            self.stats["refused_frames"] += 1
            self._reply(rec.peer, m.Error(self.engine_id, self.rank,
                                          f"message claims {msg.engine_id!r} rank {msg.rank}, but this connection "
                                          f"handshook as {reader.engine_id!r} rank {reader.rank}"))
            return
        if (msg.engine_id, msg.rank) == (reader.engine_id, reader.rank) \
                and self._engines.get(reader.engine_id, {}).get(reader.rank) == rec.peer:
            self._confirmed.add((reader.engine_id, reader.rank))
        self._heard[reader.engine_id] = self.clock()
        self._on_message(msg, reader)

    def _on_message(self, msg: m.Message, reader: _Reader | None) -> None:
        if isinstance(msg, m.ReadDone):
            self._on_done(msg.engine_id, msg.rank, msg.request_id, "read")
        elif isinstance(msg, m.Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(msg)
        elif isinstance(msg, m.DestinationReady):
            self._on_destination(msg)
        elif isinstance(msg, m.Error):
            self.stats["errors_received"] += 1
            log.warning("prefill rank %d: decode %s rank %d reports: %s", self.rank, msg.engine_id, msg.rank,
                        msg.reason)
            if msg.request_id and msg.request_id in self._leases:
                req = self._leases[msg.request_id]
                if req.engine == msg.engine_id:
                    self._end(req, f"decode {msg.engine_id!r} rank {msg.rank} refused it: {msg.reason}", ok=False)
        else:
            self.stats["unexpected_messages"] += 1

    def _on_hello(self, peer: bytes, hello: m.Hello) -> None:
        """A decode rank's handshake. One that does not read from this rank (it came here, usually
        to rank 0, only to learn the engine's rank addresses from this Hello's reply) is answered
        as a directory answers: no transport connection and no reader entry for it, so a rank
        holds only the decode ranks that read it (issue 44.1)."""
        mine = self.hello
        try:
            validate_peer(self.topology, mine, hello)
            if hello.rank not in self.topology.reader_ranks(hello.engine_id):
                self.stats["directory_answers"] += 1
                if hello.engine_id not in self._engines:  # no reader of it here: nothing forgets it later
                    self.topology.unregister_remote_engine(hello.engine_id)
                self._reply(peer, mine)
                return
            self.transport.connect(hello.agent_name, hello.transport_metadata)
        except KVBridgeError as e:
            self.stats["handshakes_refused"] += 1
            log.warning("prefill rank %d refused %s: %s", self.rank, describe(hello), e)
            self._reply(peer, m.Error(self.engine_id, self.rank, str(e)))
            return
        except Exception as e:  # a transport refusing the metadata
            self.stats["handshakes_refused"] += 1
            self._reply(peer, m.Error(self.engine_id, self.rank, f"transport {mine.transport} cannot connect to "
                                                                 f"{hello.agent_name!r}: {e}"))
            return
        old = self._engines.setdefault(hello.engine_id, {}).get(hello.rank)
        if old is not None and old != peer:
            self._readers.pop(old, None)
        self._readers[peer] = _Reader(hello.engine_id, hello.rank, hello.agent_name, peer)
        self._engines[hello.engine_id][hello.rank] = peer
        self._heard[hello.engine_id] = self.clock()
        self.stats["handshakes"] += 1
        self._reply(peer, mine)
        for req in list(self._leases.values()):
            if req.engine is None:
                self._bind(req)
            self._advance(req)

    def _on_done(self, engine: str, rank: int, request_id: str, what: str) -> None:
        req = self._leases.get(request_id)
        if req is None:
            key = "late_notifications" if request_id in self._history else "unknown_notifications"
            self.stats[key] += 1
            return
        if req.engine != engine or req.readers is None or rank not in req.readers:
            self.stats["unexpected_notifications"] += 1
            return
        if rank in req.done or req.ending is not None:
            self.stats["duplicate_notifications"] += 1
            return
        if self.mode == "push" and what == "read":
            self.stats["unexpected_notifications"] += 1
            return
        req.done.add(rank)
        self._advance(req)

    def _on_heartbeat(self, hb: m.Heartbeat) -> None:
        self.stats["heartbeats"] += 1
        horizon = self.clock() + self.config.lease_extension
        for rid in hb.request_ids:
            req = self._leases.get(rid)
            if req is not None and req.ending is None and req.engine in (None, hb.engine_id):
                req.expiry = max(req.expiry, horizon)
            elif req is None and rid not in self._history and rid not in self._claims:
                self._claims[rid] = (self.clock(), hb.engine_id)
                self._bounded(self._claims, "claims_dropped")

    def _on_abort(self, msg: m.Abort) -> None:
        req = self._leases.get(msg.request_id)
        if req is None or req.engine not in (None, msg.engine_id):
            if msg.request_id in self._history:  # acknowledge: nothing of ours is in flight
                self.stats["late_aborts"] += 1
                self._send_to(msg.engine_id, msg.rank, m.Abort(self.engine_id, self.rank, msg.request_id,
                                                               f"already released: {self._history[msg.request_id]}"))
            elif req is None:
                # The decode side gave up before this rank finished its prefill: remember it, so
                # the lease ends at `add_request` instead of holding the blocks for a full lease.
                self.stats["early_aborts"] += 1
                self._early_aborts[msg.request_id] = (
                    self.clock(), f"aborted by decode {msg.engine_id!r} rank {msg.rank} before prefill finished: "
                                  f"{msg.reason}")
                self._bounded(self._early_aborts)
                self._early.pop(msg.request_id, None)  # never start those writes
                # Acknowledge: nothing of ours is in flight for a request we do not lease yet.
                self._send_to(msg.engine_id, msg.rank, m.Abort(self.engine_id, self.rank, msg.request_id,
                                                               "not leased here yet; nothing in flight"))
            return
        self.stats["aborts_received"] += 1
        self._end(req, f"aborted by decode {msg.engine_id!r} rank {msg.rank}: {msg.reason}", ok=False)

    def _on_destination(self, msg: m.DestinationReady) -> None:
        if self.mode != "push":
            self._send_to(msg.engine_id, msg.rank, m.Error(self.engine_id, self.rank,
                                                           "DestinationReady in pull mode", msg.request_id))
            return
        req = self._leases.get(msg.request_id)
        if req is None:
            if msg.request_id in self._history:
                self._send_to(msg.engine_id, msg.rank, m.Abort(self.engine_id, self.rank, msg.request_id,
                                                               f"already released: {self._history[msg.request_id]}"))
                return
            _, early = self._early.setdefault(msg.request_id, (self.clock(), {}))
            early[msg.rank] = msg
            self._bounded(self._early, "early_destinations_dropped")
            return
        if req.engine not in (None, msg.engine_id):
            self._send_to(msg.engine_id, msg.rank, m.Error(self.engine_id, self.rank,
                                                           f"request is bound to decode engine {req.engine!r}",
                                                           msg.request_id))
            return
        if msg.rank in req.destinations:
            self.stats["duplicate_destinations"] += 1
            return
        if req.readers is not None and msg.rank not in req.readers:
            self._send_to(msg.engine_id, msg.rank, m.Error(self.engine_id, self.rank, f"decode rank {msg.rank} "
                                                           f"does not read from prefill rank {self.rank}",
                                                           msg.request_id))
            return
        req.destinations[msg.rank] = msg
        self._advance(req)

    # -- state machine ----------------------------------------------------------------------------
    def _bind(self, req: _Lease) -> None:
        """Choose the request's decode engine (when known) and its reader ranks."""
        if req.engine is None:
            if len(self._engines) != 1:
                return
            req.engine = next(iter(self._engines))
        if req.readers is None:
            try:
                self.topology.get_engine_info(req.engine)
            except KVBridgeError:
                return  # that engine has not connected yet
            req.readers = frozenset(self.topology.reader_ranks(req.engine))
            early = self._early.pop(req.request_id, None)
            if early is not None:
                for rank, dest in early[1].items():
                    if dest.engine_id == req.engine and rank in req.readers:
                        req.destinations.setdefault(rank, dest)

    def _advance(self, req: _Lease) -> None:
        if req.ending is not None:
            self._finish_ending(req)
            return
        if req.readers is None:
            return
        if not req.readers:
            self._end(req, "done: no decode rank reads from this rank", ok=True)
            return
        conns = self._engines.get(req.engine or "", {})
        for rank in sorted(req.readers - req.announced):
            if rank in conns:
                checksum = None
                if self.config.checksum:
                    if req.checksums is None:
                        req.checksums = self._checksums(req)
                        if req.checksums is None:
                            return
                    checksum = req.checksums[rank] - (1 << 64) if req.checksums[rank] >> 63 else req.checksums[rank]
                ready = m.RequestReady(self.engine_id, self.rank, req.request_id, req.block_ids, req.num_tokens,
                                       max(0.0, req.expiry - self.clock()), req.first_token, checksum)
                if self.server.send(conns[rank], ready):
                    req.announced.add(rank)
        if self.mode == "push":
            self._push(req)
        if req.ending is None and req.done >= req.readers:
            self._end(req, "done", ok=True)

    def _push(self, req: _Lease) -> None:
        for rank, dest in req.destinations.items():
            if rank in req.done or req.ending is not None:
                continue
            handle = req.writes.get(rank)
            if handle is None:
                self._start_write(req, rank, dest)
                continue
            state = self._poll(handle)
            if state == XferState.DONE:
                req.done.add(rank)
                self._send_to(req.engine, rank, m.WriteDone(self.engine_id, self.rank, req.request_id))
            elif state == XferState.FAILED:
                self._end(req, f"write to decode rank {rank} failed: {handle.reason or 'no reason given'}", ok=False)

    def _start_write(self, req: _Lease, rank: int, dest: m.DestinationReady) -> None:
        assert req.engine is not None
        if dest.num_tokens != req.num_tokens:
            self._end(req, f"decode rank {rank} expects {dest.num_tokens} tokens, prefill holds {req.num_tokens}",
                      ok=False)
            return
        try:
            remote = self.topology.get_engine_info(req.engine)
            request = Request(req.block_ids, dest.block_ids, req.num_tokens, dest.num_cached_tokens)
            plan = plan_request(self.cache.spec, self.cache.layout, remote.layout, request, dst_ranks=[rank])
            runs = runs_for(plan, "write", self.rank)
        except KVBridgeError as e:
            self._end(req, f"invalid destination from decode rank {rank}: {e}", ok=False)
            return
        if len(runs) == 0:
            req.done.add(rank)
            self._send_to(req.engine, rank, m.WriteDone(self.engine_id, self.rank, req.request_id))
            return
        posted = self._post(self._agent(req.engine, rank), "write", runs,
                            m.WriteDone(self.engine_id, self.rank, req.request_id))
        if isinstance(posted, str):
            self._end(req, f"posting the write to decode rank {rank} failed: {posted}", ok=False)
            return
        req.writes[rank] = posted
        req.nbytes += runs.nbytes
        req.nruns += len(runs)

    def _end(self, req: _Lease, reason: str, ok: bool) -> None:
        """Begin the release: stop our posted writes; the release fires once they are stopped."""
        if req.ending is not None:
            return
        req.ending, req.ending_ok = reason, ok
        req.stop_deadline = self.clock() + self.config.abort_timeout
        self._abort_pending(req.writes.values())
        self._finish_ending(req)

    def _finish_ending(self, req: _Lease) -> None:
        pending = self._still_pending(req.writes)
        if pending:
            if self.clock() > req.stop_deadline:
                self.stats["stuck_writes"] += 1
                req.stop_deadline = self.clock() + self.config.abort_timeout
                log.error("prefill rank %d: writes of %s to decode ranks %s did not stop after abort; blocks stay "
                          "leased until they do", self.rank, req.request_id, pending)
                self._abort_pending(req.writes[rank] for rank in pending)
            return
        self._release(req)

    def _release(self, req: _Lease) -> None:
        if self._leases.pop(req.request_id, None) is None:
            return  # idempotent
        reason = req.ending or "released"
        self._history[req.request_id] = reason
        self._bounded(self._history)
        self.releases.append((req.request_id, reason))
        if len(self.releases) > self.config.max_pending:
            del self.releases[: len(self.releases) - self.config.max_pending]
        self.stats["released_ok" if req.ending_ok else "released_failed"] += 1
        self.stats["bytes_written"] += req.nbytes
        self.stats["runs_written"] += req.nruns
        if not req.ending_ok and req.engine is not None:
            for rank in sorted(req.readers or ()):
                self._send_to(req.engine, rank, m.Abort(self.engine_id, self.rank, req.request_id, reason))
        if self.on_release is not None:
            try:
                self.on_release(req.request_id, reason)
            except Exception:  # noqa: BLE001 - the callback ran once; its failure is the engine's
                log.exception("prefill rank %d: on_release(%r) raised", self.rank, req.request_id)

    # -- helpers ----------------------------------------------------------------------------------
    def _transport_notifications(self) -> None:
        for msg in self._notifications(m.ReadDone, self._reader_agent):
            self._on_done(msg.engine_id, msg.rank, msg.request_id, "read")

    def _reader_agent(self, engine: str, rank: int) -> str | None:
        reader = self._readers.get(self._engines.get(engine, {}).get(rank, b""))
        return reader.agent if reader is not None else None

    def _checksums(self, req: _Lease) -> list[int] | None:
        """This rank's share of every decode rank's checksum, taken once, before any reader is told."""
        try:
            remote = self.topology.get_engine_info(req.engine or "")
            request = Request(req.block_ids, req.block_ids, req.num_tokens, 0)
            sums = contribution_checksums(self.cache, request, remote.layout)
        except Exception as e:  # noqa: BLE001 - a checksum we cannot take fails the request, visibly
            self._end(req, f"cannot compute the integrity checksum: {type(e).__name__}: {e}", ok=False)
            return None
        self.stats["checksums"] += 1
        return sums

    def _agent(self, engine: str, rank: int) -> str:
        return self._readers[self._engines[engine][rank]].agent

    def _send_to(self, engine: str | None, rank: int, msg: m.Message) -> bool:
        peer = self._engines.get(engine or "", {}).get(rank)
        if peer is None:
            return False
        return self._reply(peer, msg)

    def _reply(self, peer: bytes, msg: m.Message) -> bool:
        if not peer:
            return False
        ok = self.server.send(peer, msg)
        if not ok:
            self.stats["send_failures"] += 1
        return ok

    def forget(self, engine_id: str) -> bool:
        """Forget decode engine `engine_id` (it left): its readers, its transport agents and its
        topology entry. Leases bound to it end first. False when it was not connected."""
        for req in list(self._leases.values()):
            if req.engine == engine_id and req.ending is None:
                self._end(req, f"decode engine {engine_id!r} was forgotten (it left)", ok=False)
        peers = self._engines.pop(engine_id, None)
        self._heard.pop(engine_id, None)
        if peers is None:
            return False
        agents = {self._readers.pop(p).agent for p in peers.values() if p in self._readers}
        self._confirmed = {(e, r) for e, r in self._confirmed if e != engine_id}
        for agent in agents:
            try:
                self.transport.disconnect(agent)
            except Exception as e:  # noqa: BLE001 - a transport that already dropped the peer
                log.debug("disconnect %s: %s", agent, e)
        self.topology.unregister_remote_engine(engine_id)
        self.stats["engines_forgotten"] += 1
        return True

    def _forget_silent(self, now: float) -> None:
        """Forget decode engines silent for twice `remote_engine_ttl` that no lease is bound to
        (twice: a decode rank forgets an unused prefill engine after one TTL and handshakes anew
        when it needs it again, so it never sends to a prefill rank that forgot it). Runs once a
        second at most."""
        if now < self._next_forget:
            return
        self._next_forget = now + 1.0
        bound = {req.engine for req in self._leases.values()}
        for engine, heard in list(self._heard.items()):
            if engine not in bound and now - heard > 2 * self.config.remote_engine_ttl:
                log.info("prefill rank %d: forgetting decode engine %r (silent for %.0f s)", self.rank, engine,
                         now - heard)
                self.forget(engine)

    def _expire_early(self, now: float) -> None:
        ttl = self.config.announcement_ttl or self.config.lease_seconds
        while self._claims:
            since, _ = next(iter(self._claims.values()))
            if now - since < ttl:
                break
            self._claims.popitem(last=False)
        while self._early_aborts:
            since, _ = next(iter(self._early_aborts.values()))
            if now - since < ttl:
                break
            self._early_aborts.popitem(last=False)
        while self._early:
            rid, (since, _) = next(iter(self._early.items()))
            if now - since < ttl:
                break
            self._early.popitem(last=False)
            self.stats["early_destinations_expired"] += 1


__all__ = ["Producer", "ReleaseCallback"]

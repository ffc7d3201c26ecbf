"""The decode side of the lifecycle: handshake, receive a request from all its source ranks, report.

One `Consumer` serves one decode TP rank. The engine gives it the rank's cache (registered
with the transport here), connects it to a prefill engine with `connect("host:port")` (any rank
of that engine whose Hello lists its engine's rank addresses, normally rank 0), and then calls

* `receive(id, block_ids, ...)` once it has allocated the request's destination blocks;
* `progress(timeout)` from its loop; it returns the requests that finished since the last
  call as `RequestResult`s (success, or failure with a reason);
* `abort(id)` to cancel.

A request is done on this rank when every source rank (`TransferTopology.source_ranks`: every
prefill rank holding heads this rank needs, GQA-deduplicated) has delivered: in pull mode our
read from it finished (we post it once the source rank announced the request with
`RequestReady`, which is also what tells us the source block ids), in push mode it reported
`WriteDone`. A read that fails, a source rank that aborts, a side channel that drops (the peer
died or the network between them is cut), a plan that the request's block ids make invalid, or
the request's deadline all end it as a failure; every failure has a reason naming the rank and
the cause. A dropped side channel fails the requests still waiting on that source in the
`progress` call that sees the drop (a waiting call wakes for it), but only after our reads were
polled: a source that delivered and then exited (it may release on the transport's notification
of our read before we polled it) leaves its requests done.

A lost source rank is not given up for good: while it is lost, every request that needs it
fails at once (no announcement or destination is sent to it), and the rank re-handshakes with
it on a fresh side-channel connection every `handshake_timeout` at most. When it answers with
the very Hello it gave at the handshake (same engine id, rank, transport agent and metadata: the
same incarnation, e.g. after a network cut healed) it serves new requests again; a different
incarnation under the same engine id (a restarted peer) stays lost, and the engine must connect
it under a new engine id (`TransferTopology` refuses to mix two incarnations).

A result is reported only when no transfer may still write this rank's blocks for the request:
our own reads are aborted and polled to a stop first; in push mode we ask every writer that has
not finished to stop (`Abort`) and wait, bounded, for its acknowledgement (an `Abort` back, or
its side channel gone). If a writer does not confirm in time the result says so
(`quiesced=False`) and the engine must not reuse the blocks.

The decode engine (its scheduler) aggregates its ranks' results, like vLLM's
`KVOutputAggregator`: the request is usable when every rank reports ok.

Length: about 620 lines, one state machine (a request from `receive` to its `RequestResult`) whose
transitions read best together; what it shares with the prefill side is in `endpoint.py`, its
side channels (handshake, loss, rejoin) in `sources.py`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from kvbridge.connector import messages as m
from kvbridge.connector.admission import BlockOwners, written_blocks
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.endpoint import RankEndpoint
from kvbridge.connector.runs import runs_for
from kvbridge.connector.side_channel import Received, SideChannelClient, poll_clients
from kvbridge.connector.sources import SourceEngine, SourceLinks
from kvbridge.errors import InvalidRequest, KVBridgeError
from kvbridge.core.integrity import destination_checksums
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Plan, Request
from kvbridge.core.topology import TransferTopology
from kvbridge.transport.base import Handle, Transport, XferState

log = logging.getLogger("kvbridge.connector.consumer")

CLAIM_REFRESH_S = 1.0
"""How often a received request still unannounced by a source rank is named to it again. Seen in
a fleet continued from SIGSTOP (`kvbridge bench --serve` pauses the fleet it does not load): the
first claims of a round did not count, and their leases waited 17-111 s for the periodic
heartbeat (every lease/6)."""


class RequestResult(msgspec.Struct, frozen=True):
    """How one request ended on one decode rank."""

    request_id: str
    ok: bool
    reason: str
    engine_id: str  # the prefill engine it came from
    rank: int  # this decode rank
    num_tokens: int
    first_token: int | None
    nbytes: int
    nruns: int
    seconds: float  # from `receive` to the end
    transfer_seconds: float  # from the first transfer posted (or requested) to the last completion
    quiesced: bool = True  # False: a writer did not confirm it stopped; do not reuse the blocks


@dataclass
class _Pending:
    request_id: str
    engine: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int | None
    num_cached_tokens: int
    started: float
    deadline: float
    sources: tuple[int, ...]
    announced: dict[int, m.RequestReady] = field(default_factory=dict)
    plan: Plan | None = None
    reads: dict[int, Handle] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    quiet: set[int] = field(default_factory=set)
    failure: str | None = None
    stop_deadline: float = 0.0
    first_post: float | None = None
    last_done: float | None = None
    nbytes: int = 0
    nruns: int = 0


class Consumer(RankEndpoint):
    """Decode-side connector for one TP rank."""

    role = "decode"
    kind = "consumer"

    def __init__(self, engine_id: str, rank: int, cache: RankCache, transport: Transport, *,
                 mode: m.Mode = "pull", config: ConnectorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, topology: TransferTopology | None = None):
        super().__init__(engine_id, rank, cache, transport, mode=mode, config=config, clock=clock, topology=topology)
        self._links = SourceLinks(self)
        self._engines = self._links.engines
        self._owners = BlockOwners(f"decode rank {rank}")  # destination blocks of in-flight requests
        self._recurrent = [cache.spec.group_layer(g).is_recurrent for g in range(len(cache.spec.groups))]
        self._active: dict[str, _Pending] = {}
        self._unclaimed: OrderedDict[str, tuple[float, dict[int, m.RequestReady]]] = OrderedDict()
        self._cancelled: OrderedDict[str, str] = OrderedDict()
        self._expected: OrderedDict[str, tuple[str, float]] = OrderedDict()  # id -> (engine, expiry)
        self._finished: OrderedDict[str, RequestResult] = OrderedDict()
        self._out: list[RequestResult] = []
        self._next_heartbeat = self.clock() + self.config.heartbeat_every
        self._next_claim_refresh = self.clock() + CLAIM_REFRESH_S

    # -- public API -------------------------------------------------------------------------------
    @property
    def prefill_engines(self) -> tuple[str, ...]:
        return tuple(self._engines)

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(self._active)

    def source_ranks(self, engine_id: str) -> tuple[int, ...]:
        return self._engines[engine_id].sources

    def lost_sources(self, engine_id: str) -> tuple[int, ...]:
        """Source ranks of `engine_id` whose side channel is lost (requests needing them fail)."""
        return tuple(sorted(self._engines[engine_id].lost))

    def remote_layout(self, engine_id: str) -> EngineLayout:
        """The layout prefill engine `engine_id` declared at the handshake."""
        return self._engines[engine_id].layout

    def forget(self, engine_id: str) -> bool:
        """Forget prefill engine `engine_id` (it left): its connections, transport peer and topology
        entry go, its requests here fail. False when it was not connected. Idle engines are
        forgotten by `progress` on their own (`ConnectorConfig.remote_engine_ttl`)."""
        for req in list(self._active.values()):
            if req.engine == engine_id:
                self._fail(req, f"prefill engine {engine_id!r} was forgotten (it left)")
        for rid in [r for r, (e, _) in self._expected.items() if e == engine_id]:
            del self._expected[rid]
        return self._links.forget(engine_id)

    def _forget_idle(self) -> None:
        """Forget prefill engines no request needs: at once when every source came back as another
        incarnation (it will never answer again), else after `remote_engine_ttl` unused (a lost
        engine keeps re-handshaking until then: a cut link may come back)."""
        now = self.clock()
        busy = {r.engine for r in self._active.values()} | {e for e, _ in self._expected.values()}
        for eng in list(self._engines.values()):
            if eng.engine_id not in busy and (eng.replaced_whole or
                                              now - eng.last_used > self.config.remote_engine_ttl):
                log.info("decode rank %d: forgetting prefill engine %r (%s)", self.rank, eng.engine_id,
                         "replaced" if eng.replaced_whole else f"unused for {now - eng.last_used:.0f} s")
                self._links.forget(eng.engine_id)

    def touch(self, engine_id: str) -> tuple[int, ...]:
        """Send an empty `Heartbeat` to every reachable source rank of `engine_id`: a frame of ours
        after the handshake tells the producer this rank is past it (`Producer.confirmed_ranks`).
        Returns the source ranks it could not be sent to (side channel full or closed)."""
        eng = self._engines[engine_id]
        hb = m.Heartbeat(self.engine_id, self.rank, ())
        return tuple(s for s, c in eng.clients.items() if s not in eng.lost and not c.send(hb))

    def connect(self, address: str, timeout: float | None = None) -> str:
        """Handshake with the prefill engine reachable at `address`; returns its engine id.

        Refuses (raises `HandshakeRefused`, naming both values) an engine this rank cannot
        exchange bytes with, and is refused in turn the same way. Bounded by `timeout`
        (default `handshake_timeout`) per rank contacted.
        """
        self._check_open()
        engine_id = self._links.connect(address, timeout or self.config.handshake_timeout)
        self.stats["handshakes"] += 1
        return engine_id

    def receive(self, request_id: str, block_ids: Sequence[Sequence[int]], *, num_tokens: int | None = None,
                num_cached_tokens: int = 0, engine_id: str | None = None, timeout: float | None = None) -> None:
        """Receive `request_id` into this rank's `block_ids` (per KV-cache group).

        `num_tokens` is required in push mode (the writer needs it to plan); in pull mode it is
        taken from the source's announcement and, if given, checked against it. The request
        fails unless it completes within `timeout` (default `transfer_timeout`) seconds.
        """
        self._check_open()
        engine = self._engine_for(engine_id)
        if request_id in self._active or request_id in self._finished:
            raise InvalidRequest(f"request id {request_id!r} is already known to decode rank {self.rank}")
        if self.mode == "push" and num_tokens is None:
            raise InvalidRequest("push mode needs num_tokens: the prefill side plans the writes with it")
        ids = self._checked_blocks(block_ids, num_tokens, request_id, exact=True)
        now = self.clock()
        budget = timeout or self.config.transfer_timeout
        eng = self._engines[engine]
        eng.last_used = now
        req = _Pending(request_id, engine, ids, num_tokens, int(num_cached_tokens), now, now + budget, eng.sources)
        # Leading ids holding only cached tokens (on every CP rank; pages may be smaller than the
        # interleave): up to the request's end, or one interleave round past the prefix if unknown.
        layout, cached = self.cache.layout, req.num_cached_tokens
        stop = num_tokens if num_tokens is not None and num_tokens > cached else (
            cached + layout.cp_interleave * layout.cp_size)
        skips = [layout.block_span(g, cached, stop)[0] for g in range(len(ids))]
        self._owners.admit(request_id, written_blocks(ids, req.num_cached_tokens, 1, self._recurrent, skips))
        self._expected.pop(request_id, None)
        self._active[request_id] = req
        self.stats["requests"] += 1
        cancelled = self._cancelled.pop(request_id, None)
        if cancelled is not None:
            self._fail(req, cancelled)
        else:
            self._claim(eng, request_id)
        claimed = self._unclaimed.pop(request_id, None)
        if claimed is not None:
            for ann in claimed[1].values():
                if ann.engine_id == engine:
                    self._on_ready(req, ann)
        if self.mode == "push" and req.failure is None and not eng.lost & set(req.sources):
            # (a lost source is not told: `_advance` fails the request below, and a writer that
            # learned the destination could write into blocks this rank already gave up)
            assert num_tokens is not None
            for s in req.sources:
                dest = m.DestinationReady(self.engine_id, self.rank, request_id, ids, num_tokens, req.num_cached_tokens)
                if not eng.clients[s].send(dest):
                    self._fail(req, f"cannot send DestinationReady to prefill rank {s}: side channel full or closed")
                    break
            req.first_post = now
        self._advance(req)

    def expect(self, request_id: str, *, engine_id: str | None = None, timeout: float | None = None) -> None:
        """The engine has `request_id` queued and will `receive` it: heartbeat its lease meanwhile.

        This is vLLM's heartbeat case: a decode scheduler that knows a request but has not
        allocated its blocks yet keeps the prefill side from expiring them. The expectation
        itself expires after `timeout` (default `transfer_timeout`) so a forgotten one cannot
        hold remote blocks forever.
        """
        self._check_open()
        engine = self._engine_for(engine_id)
        if request_id in self._active:
            return
        self._expected[request_id] = (engine, self.clock() + (timeout or self.config.transfer_timeout))
        self._expected.move_to_end(request_id)
        self._bounded(self._expected)
        self._engines[engine].last_used = self.clock()
        self._claim(self._engines[engine], request_id)

    def _claim(self, eng: SourceEngine, request_id: str) -> None:
        """Name `request_id` to the engine's reachable source ranks at once (a heartbeat): a prefill
        rank serving several decode engines learns which one reads a request nobody named to it
        (`Producer.claimant`), and its lease is extended."""
        hb = m.Heartbeat(self.engine_id, self.rank, (request_id,))
        for s, client in eng.clients.items():
            if s not in eng.lost and client.send(hb):
                self.stats["heartbeats_sent"] += 1

    def abort(self, request_id: str, reason: str = "aborted by the decode engine") -> bool:
        """Cancel a request; its result (a failure) comes from `progress` once its transfers stopped.

        A request only `expect`ed (not received) is dropped and its prefill ranks are told to
        release now; that returns True too but produces no result.
        """
        req = self._active.get(request_id)
        if req is None:
            expected = self._expected.pop(request_id, None)
            if expected is None:
                return False
            eng = self._engines.get(expected[0])
            for s, client in (eng.clients.items() if eng else ()):
                if s not in eng.lost:
                    client.send(m.Abort(self.engine_id, self.rank, request_id, reason[:4000]))
            return True
        self._fail(req, reason)
        self._advance(req)
        return True

    def progress(self, timeout: float = 0.0) -> list[RequestResult]:
        """One bounded round of work (waits at most `timeout` s); the requests that ended since last call."""
        if self.closed:
            return self._drain()
        for client, rec in poll_clients(self._links.clients(), timeout):
            self._on_frame(client, rec)
        self._transport_notifications()
        for eng, s in self._links.newly_lost():
            # A peer that closes with nothing of ours in flight is a normal end (the prefill server
            # stops once it released everything): worth a warning only when a request needs it.
            needed = any(r.engine == eng.engine_id and s in r.sources and s not in r.done
                         for r in self._active.values())
            log.log(logging.WARNING if needed else logging.INFO, "decode rank %d: side channel to prefill %r rank %d "
                    "(%s) lost", self.rank, eng.engine_id, s, eng.clients[s].address)
        for req in list(self._active.values()):
            self._advance(req)
        self._heartbeat()
        self._refresh_claims()
        return self._drain()

    def wait(self, request_ids: Iterable[str], timeout: float, step: float = 0.01) -> dict[str, RequestResult]:
        """Drive `progress` until every id has a result or `timeout` s pass; returns the results seen."""
        want = set(request_ids)
        got: dict[str, RequestResult] = {rid: self._finished[rid] for rid in want if rid in self._finished}
        deadline = self.clock() + timeout
        while want - set(got):
            left = deadline - self.clock()
            if left <= 0:
                break
            for res in self.progress(min(step, left)):
                if res.request_id in want:
                    got[res.request_id] = res
        return got

    def unclaimed(self) -> list[m.RequestReady]:
        """Announced requests that `receive` has not claimed yet (first announcement of each)."""
        return [next(iter(anns.values())) for _, anns in self._unclaimed.values() if anns]

    def result(self, request_id: str) -> RequestResult | None:
        return self._finished.get(request_id)

    def close(self) -> None:
        """Cancel active requests (bounded wait for their transfers to stop), close the side channels."""
        if self.closed:
            return
        for req in list(self._active.values()):
            self._fail(req, "decode consumer closed")
        deadline = self.clock() + self.config.abort_timeout + 0.5
        while self._active and self.clock() < deadline:
            self.progress(0.01)
        self.closed = True
        self._links.close()

    # -- frames -----------------------------------------------------------------------------------
    def _on_frame(self, client: SideChannelClient, rec: Received) -> None:
        if self._links.is_rejoin(client):
            self._links.on_rejoin_reply(client, rec)
            return
        if rec.error is not None:
            self._refuse_frame(f" from {client.address}", rec.error)
            return
        engine, s = self._links.source_of(client)
        msg = rec.msg
        if isinstance(msg, m.Hello):
            self.stats["unexpected_messages"] += 1
            return
        if (msg.engine_id, msg.rank) != (engine, s):
            self.stats["refused_frames"] += 1
            log.warning("decode rank %d: message from %s claims %r rank %d, expected %r rank %d", self.rank,
                        client.address, msg.engine_id, msg.rank, engine, s)
            return
        self._on_message(msg)

    def _on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.RequestReady):
            req = self._active.get(msg.request_id)
            if req is not None and req.engine == msg.engine_id:
                self._on_ready(req, msg)
                self._advance(req)
            elif msg.request_id in self._finished:
                self.stats["late_announcements"] += 1
            else:
                since, anns = self._unclaimed.setdefault(msg.request_id, (self.clock(), {}))
                anns[msg.rank] = msg
                self._bounded(self._unclaimed, "announcements_dropped")
        elif isinstance(msg, m.WriteDone):
            self._on_write_done(msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(msg)
        elif isinstance(msg, m.Error):
            self.stats["errors_received"] += 1
            req = self._active.get(msg.request_id or "")
            if req is not None and req.engine == msg.engine_id:
                self._fail(req, f"prefill {msg.engine_id!r} rank {msg.rank} refused it: {msg.reason}")
                self._advance(req)
            else:
                log.warning("decode rank %d: prefill %r rank %d reports: %s", self.rank, msg.engine_id, msg.rank,
                            msg.reason)
        else:
            self.stats["unexpected_messages"] += 1

    def _on_ready(self, req: _Pending, ann: m.RequestReady) -> None:
        if ann.rank not in req.sources:
            self.stats["unexpected_announcements"] += 1
            return
        if ann.rank in req.announced:
            self.stats["duplicate_announcements"] += 1
            return
        first = next(iter(req.announced.values()), None)
        if first is not None and (first.block_ids, first.num_tokens) != (ann.block_ids, ann.num_tokens):
            self._fail(req, f"prefill ranks {first.rank} and {ann.rank} announced different block ids or token "
                            f"counts ({first.num_tokens} vs {ann.num_tokens} tokens)")
            return
        if req.num_tokens is not None and req.num_tokens != ann.num_tokens:
            self._fail(req, f"prefill rank {ann.rank} announced {ann.num_tokens} tokens, this rank expects "
                            f"{req.num_tokens}")
            return
        req.announced[ann.rank] = ann

    def _on_write_done(self, msg: m.WriteDone) -> None:
        req = self._active.get(msg.request_id)
        if req is None or req.engine != msg.engine_id:
            self.stats["late_notifications" if msg.request_id in self._finished else "unknown_notifications"] += 1
            return
        if self.mode != "push" or msg.rank not in req.sources:
            self.stats["unexpected_notifications"] += 1
            return
        if msg.rank in req.done:
            self.stats["duplicate_notifications"] += 1
            return
        req.done.add(msg.rank)
        req.quiet.add(msg.rank)
        req.last_done = self.clock()
        self._advance(req)

    def _on_abort(self, msg: m.Abort) -> None:
        req = self._active.get(msg.request_id)
        if req is None or req.engine != msg.engine_id:
            if msg.request_id in self._finished:
                self.stats["late_aborts"] += 1
            else:
                self._unclaimed.pop(msg.request_id, None)
                self._cancelled[msg.request_id] = f"prefill {msg.engine_id!r} rank {msg.rank} aborted: {msg.reason}"
                self._bounded(self._cancelled)
            return
        req.quiet.add(msg.rank)  # the sender has nothing in flight for this request anymore
        self._fail(req, f"prefill {msg.engine_id!r} rank {msg.rank} aborted: {msg.reason}")
        self._advance(req)

    # -- state machine ----------------------------------------------------------------------------
    def _advance(self, req: _Pending) -> None:
        if req.request_id not in self._active:
            return
        eng = self._engines[req.engine]
        if req.failure is None and eng.lost:
            self._judge_loss(req, eng)
        if req.failure is None and self.mode == "pull":
            self._start_reads(req, eng)
            self._poll_reads(req)
        if req.failure is None:
            if req.done >= set(req.sources):
                if self.config.checksum:
                    verdict = self._verify(req)
                    if verdict is None:  # push: an announcement (with its checksum) is still on its way
                        if self.clock() > req.deadline:
                            self._fail(req, self._timeout_reason(req, self.clock()))
                            self._stop(req, eng)
                        return
                    if verdict:
                        self._fail(req, verdict)
                        self._stop(req, eng)
                        return
                self._finish(req, ok=True, reason="")
                return
            now = self.clock()
            if now > req.deadline:
                self._fail(req, self._timeout_reason(req, now))
        if req.failure is not None:
            self._stop(req, eng)

    def _judge_loss(self, req: _Pending, eng: SourceEngine) -> None:
        """Fail `req` if a source it still needs is lost. Our reads are polled first: a prefill rank
        may release on the transport's notification of a finished read and exit before we polled
        that read, and bytes that landed count (push: a WriteDone received already counts)."""
        if not eng.lost & (set(req.sources) - req.done):
            return
        if self.mode == "pull":
            self._poll_reads(req)
        lost = sorted(s for s in req.sources if s in eng.lost and s not in req.done)
        if lost and req.failure is None:
            req.quiet.update(lost)
            self._fail(req, f"side channel to prefill {req.engine!r} rank(s) {lost} lost (peer closed, died or "
                            f"unreachable; its transfers are presumed stopped)")

    def _start_reads(self, req: _Pending, eng: SourceEngine) -> None:
        for s in sorted(set(req.announced) - set(req.reads) - req.done):
            ann = req.announced[s]
            if req.plan is None:
                try:
                    request = Request(ann.block_ids, req.block_ids, ann.num_tokens, req.num_cached_tokens)
                    req.plan = self.topology.plan_pull(req.engine, request)
                except KVBridgeError as e:
                    self._fail(req, f"invalid request from prefill rank {s}: {e}")
                    return
                req.num_tokens = ann.num_tokens
            runs = runs_for(req.plan, "read", s)
            if req.first_post is None:
                req.first_post = self.clock()
            if len(runs) == 0:
                self._read_done(req, eng, s)
                continue
            posted = self._post(eng.agents[s], "read", runs, m.ReadDone(self.engine_id, self.rank, req.request_id))
            if isinstance(posted, str):
                self._fail(req, f"posting the read from prefill rank {s} failed: {posted}")
                return
            req.reads[s] = posted
            req.nbytes += runs.nbytes
            req.nruns += len(runs)

    def _poll_reads(self, req: _Pending) -> None:
        eng = self._engines[req.engine]
        for s, handle in req.reads.items():
            if s in req.done:
                continue
            state = self._poll(handle)
            if state == XferState.DONE:
                self._read_done(req, eng, s)
            elif state == XferState.FAILED:
                self._fail(req, f"read from prefill {req.engine!r} rank {s} failed: {handle.reason or 'no reason'}")
                return

    def _read_done(self, req: _Pending, eng: SourceEngine, s: int) -> None:
        req.done.add(s)
        req.last_done = self.clock()
        if s not in eng.lost and not eng.clients[s].send(m.ReadDone(self.engine_id, self.rank, req.request_id)):
            self.stats["send_failures"] += 1

    def _fail(self, req: _Pending, reason: str) -> None:
        """Record the first failure and stop our transfers; the result comes once they stopped."""
        if req.failure is not None:
            return
        req.failure = reason
        req.stop_deadline = self.clock() + self.config.abort_timeout
        self._abort_pending(h for s, h in req.reads.items() if s not in req.done)
        eng = self._engines.get(req.engine)
        if eng is None:
            return
        for s in req.sources:
            # Pull: tell every source to release now. Push: ask every writer to stop (its Abort is the ack).
            if (self.mode == "push" and s in req.quiet) or s in eng.lost:
                continue
            if not eng.clients[s].send(m.Abort(self.engine_id, self.rank, req.request_id, reason[:4000])):
                self.stats["send_failures"] += 1

    def _stop(self, req: _Pending, eng: SourceEngine) -> None:
        now = self.clock()
        if self.mode == "pull":
            pending = self._still_pending(req.reads, skip=req.done)
            if not pending:
                self._finish(req, ok=False, reason=req.failure or "failed")
            elif now > req.stop_deadline:
                self._finish(req, ok=False, quiesced=False,
                             reason=f"{req.failure}; reads from prefill ranks {pending} did not stop after abort")
            return
        noisy = sorted(set(req.sources) - req.quiet - eng.lost)
        if not noisy:
            self._finish(req, ok=False, reason=req.failure or "failed")
        elif now > req.stop_deadline:
            self._finish(req, ok=False, quiesced=False,
                         reason=f"{req.failure}; prefill ranks {noisy} did not confirm their writes stopped within "
                                f"{self.config.abort_timeout:.1f} s")

    def _finish(self, req: _Pending, ok: bool, reason: str, quiesced: bool = True) -> None:
        if self._active.pop(req.request_id, None) is None:
            return
        self._owners.release(req.request_id)
        now = self.clock()
        ann = next(iter(req.announced.values()), None)
        first = req.first_post if req.first_post is not None else now
        last = req.last_done if req.last_done is not None else now
        res = RequestResult(req.request_id, ok, reason, req.engine, self.rank,
                            int(req.num_tokens if req.num_tokens is not None else (ann.num_tokens if ann else 0)),
                            ann.first_token if ann else None, req.nbytes, req.nruns, now - req.started,
                            max(0.0, last - first), quiesced)
        self._finished[req.request_id] = res
        self._bounded(self._finished)
        self._out.append(res)
        self.stats["ok" if ok else "failed"] += 1

    def _verify(self, req: _Pending) -> str | None:
        """"" when what landed matches the sources' checksums, a reason when not, None to wait."""
        if req.num_cached_tokens:
            self.stats["checksums_skipped"] += 1  # the sources sum rows [0, n); we hold a cached prefix
            return ""
        if set(req.announced) < set(req.sources):
            return None
        missing = sorted(s for s in req.sources if req.announced[s].checksum is None)
        if missing:
            return (f"integrity check impossible: prefill ranks {missing} sent no checksum (checksum=True here; "
                    f"enable ConnectorConfig(checksum=True) on the prefill engine too)")
        expected = sum(req.announced[s].checksum or 0 for s in req.sources) & ((1 << 64) - 1)
        ann = req.announced[req.sources[0]]
        n = req.num_tokens if req.num_tokens is not None else ann.num_tokens
        try:
            actual = destination_checksums([self.cache], Request(ann.block_ids, req.block_ids, n, 0))[0]
        except Exception as e:  # noqa: BLE001
            return f"integrity check failed to run: {type(e).__name__}: {e}"
        self.stats["checksums_verified"] += 1
        if actual != expected:
            self.stats["checksum_mismatches"] += 1
            return (f"integrity check failed on decode rank {self.rank}: the landed bytes hash to {actual:#018x}, "
                    f"prefill ranks {list(req.sources)} sent {expected:#018x} (corrupted or misplaced in transfer)")
        return ""

    def _timeout_reason(self, req: _Pending, now: float) -> str:
        budget = req.deadline - req.started
        missing = sorted(set(req.sources) - req.done)
        if self.mode == "push":
            what = f"no WriteDone from prefill ranks {missing}"
        else:
            unannounced = sorted(set(missing) - set(req.announced))
            reading = sorted(set(missing) & set(req.reads))
            parts = []
            if unannounced:
                parts.append(f"no RequestReady from prefill ranks {unannounced}")
            if reading:
                parts.append(f"reads from prefill ranks {reading} still pending")
            what = "; ".join(parts) or f"prefill ranks {missing} not done"
        return f"timed out after {budget:.1f} s: {what}"

    # -- periodic ---------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        now = self.clock()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_every
        self._expire_unclaimed()
        self._forget_idle()
        while self._expected and next(iter(self._expected.values()))[1] <= now:
            self._expected.popitem(last=False)
            self.stats["expectations_expired"] += 1
        for eng in self._engines.values():
            expected = [rid for rid, (e, expiry) in self._expected.items() if e == eng.engine_id and expiry > now]
            for s, client in eng.clients.items():
                if s in eng.lost:
                    continue
                rids = [r.request_id for r in self._active.values()
                        if r.engine == eng.engine_id and r.failure is None and s not in r.done] + expected
                self.stats["heartbeats_sent"] += self._name_requests(client, rids)

    def _refresh_claims(self) -> None:
        """Name again, every `CLAIM_REFRESH_S`, each received request to the source ranks that have
        not announced it yet: a prefill rank leases a request nobody named to it only to the engine
        that claims it, and a lost first claim otherwise waits for the next periodic heartbeat."""
        now = self.clock()
        if now < self._next_claim_refresh:
            return
        self._next_claim_refresh = now + CLAIM_REFRESH_S
        for eng in self._engines.values():
            for s, client in eng.clients.items():
                if s in eng.lost:
                    continue
                rids = [r.request_id for r in self._active.values() if r.engine == eng.engine_id
                        and r.failure is None and s in r.sources and s not in r.announced and s not in r.done]
                self.stats["claims_refreshed"] += self._name_requests(client, rids)

    def _name_requests(self, client: SideChannelClient, rids: list[str]) -> int:
        """Heartbeats naming `rids` to one source rank, in chunks; returns how many were sent."""
        sent = 0
        for i in range(0, len(rids), m.MAX_REQUESTS_PER_HEARTBEAT):
            sent += client.send(m.Heartbeat(self.engine_id, self.rank, tuple(rids[i:i + m.MAX_REQUESTS_PER_HEARTBEAT])))
        return sent

    def _expire_unclaimed(self) -> None:
        """Forget announcements nobody claimed within their lease (an `expect`ed one is kept:
        our heartbeats extend its lease). Runs at heartbeat cadence: it scans the buffer."""
        now = self.clock()
        for rid, (since, anns) in list(self._unclaimed.items()):
            if rid in self._expected:
                continue
            ttl = self.config.announcement_ttl or min((a.lease_seconds for a in anns.values()),
                                                      default=self.config.lease_seconds)
            if now - since >= ttl:
                del self._unclaimed[rid]
                self.stats["announcements_expired"] += 1

    def _transport_notifications(self) -> None:
        for msg in self._notifications(m.WriteDone, self._source_agent):
            self._on_write_done(msg)

    def _source_agent(self, engine: str, rank: int) -> str | None:
        eng = self._engines.get(engine)
        return eng.agents.get(rank) if eng is not None else None

    # -- helpers ----------------------------------------------------------------------------------
    def _engine_for(self, engine_id: str | None) -> str:
        if engine_id is not None:
            if engine_id not in self._engines:
                known = ", ".join(self._engines) or "none"
                raise InvalidRequest(f"prefill engine {engine_id!r} is not connected to decode rank {self.rank} "
                                     f"(connected: {known})")
            return engine_id
        if len(self._engines) != 1:
            raise InvalidRequest(f"decode rank {self.rank} is connected to {len(self._engines)} prefill engines; "
                                 f"name one with engine_id=")
        return next(iter(self._engines))

    def _drain(self) -> list[RequestResult]:
        out, self._out = self._out, []
        return out


__all__ = ["Consumer", "RequestResult"]

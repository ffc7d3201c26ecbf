"""The scheduler side of KVBridgePoolConnector: lookups off the scheduler's path, loads and stores queued.

Why a thread: a lookup is a Mooncake RPC, and Mooncake's RPCs have no deadline (a stopped master
blocks them, a dead one costs 90 s of client retries). vLLM's scheduler may answer "not yet"
(`get_num_new_matched_tokens` -> None, asked again next step), so lookups go to this side's
`PoolThread`, every waiting request's of one step in one call (`pool.lookups.BatchedLookups`),
waited for inline a few milliseconds per step, not per request (an answer in time costs no step),
and otherwise polled on later steps until `lookup_timeout_ms`, after which it is a miss and the
breaker opens. While the breaker is open every lookup is a miss at once and no store is queued;
a probe (a new client and one existence check, never a request's lookup) closes it again.

Recurrent state (vLLM's `align` mode) is stored from vLLM's boundary-state offers, not from block
tables: an align-mode mamba table is not positionally stable (interior entries are nulled, the
block two steps back freed), so vLLM hands each step's cached boundary states out with their exact
blocks (`kv_connector_block_state.boundary_state_offloads`). Those ending on a pool block are
queued one step later, once the step that computes them has run, as a running request's store
(dropped if vLLM hands the block out again first); those still pending when the request ends, from
the blocks it holds. A load writes the checkpoint where the hit ends into the reader's block there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvbridge.integrations.vllm.pool_config import PoolJob, PoolMetadata, announce, one_line, vllm_staging
from kvbridge.errors import IncompatibleEngines
from kvbridge.integrations.vllm.pool_identity import request_group_keys, tenant_of
from kvbridge.integrations.vllm.pool_metrics import StatsTally
from kvbridge.integrations.vllm.registration import group_order
from kvbridge.offload.lookup import group_windows, request_hits
from kvbridge.offload.scheduling import NULL, load_job, storable_keys, store_job, whole_blocks
from kvbridge.pool.background import Call, PoolThread, Prober
from kvbridge.pool.breaker import Breaker
from kvbridge.pool.lookups import BatchedLookups
from kvbridge.pool.store import PoolUnavailable, StoreClient, prepare_process
from kvbridge.pool.tier import PoolIndex
from kvbridge.routing.events import POOL_OWNER

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvbridge.integrations.vllm.pool_connector import KVBridgePoolConnector

logger = init_logger(f"vllm.{__name__}")
INLINE_WAIT_S = 0.02
"""How long one scheduler step's lookups wait inline, all of them together, before answering "not
yet": a healthy store answers in less (`BatchedLookups`)."""
MAX_EVENTS = 4096
"""Store announcements kept between two engine steps (`PoolSettings.kv_events`); oldest dropped."""
MAX_ANNOUNCED_TOKENS = 1 << 16
"""Longest prefix a store announces (the relay takes 2^20 tokens in one event; a longer prompt's
stores go unannounced: a missed credit, never a false one)."""
ANSWER_KEPT_S = 10.0
"""How long a lookup's answer stands for a request vLLM asks about again at each step while it
cannot schedule it (no free blocks): one round trip and one count per request, not per step, and
a fresh look after a long wait (the store may have evicted, or gained, its blocks since)."""


class PoolScheduler:
    def __init__(self, conn: KVBridgePoolConnector):
        self.conn = conn
        s = conn.settings
        self.bt = conn.config.block_tokens
        self.factor = self.bt // conn.block_size
        spec = conn.spec
        self.windows = group_windows(spec)  # full: None, sliding: its window, recurrent: one token
        self.state = frozenset(spec.recurrent_groups())
        self.vllm_groups, sizes = group_order(conn._kv_cache_config, conn.block_size)
        if len(self.vllm_groups) != len(self.windows) or set(sizes) != {conn.block_size}:
            raise IncompatibleEngines(f"KVBridgePoolConnector needs every KV-cache group in blocks of {conn.block_size} "
                                      f"tokens; vLLM's {len(sizes)} groups use {sorted(set(sizes))}")
        self.lookup_timeout = s.lookup_timeout_ms / 1000
        prepare_process(s.store_config(lend=False))  # on the engine's thread, before any pool thread
        self._client: StoreClient | None = None  # thread-only
        self._index: PoolIndex | None = None  # thread-only
        self._thread = PoolThread("kvbridge-pool-scheduler", max_queue=4096)
        self.tally = StatsTally()
        self.breaker = Breaker(1.0, s.max_backoff_s, on_change=announce(logger, s.master, "scheduler", self.tally))
        # With a host tier, lookups of it alone (the store away) have a thread of their own: a call to
        # a hung master holds `_thread` for as long as the master is stopped.
        self._host_thread = PoolThread("kvbridge-pool-host-lookups", max_queue=4096) if conn.config.host_bytes else None
        self._index_lock = threading.Lock()  # the index is built by whichever thread needs it first
        self._lookups = BatchedLookups(self._thread, self._hits, INLINE_WAIT_S, self._host_thread)  # one call, one wait per step
        self._prober = Prober(self._thread, self.breaker, self._probe_store, self.lookup_timeout)
        # answered: keys per group, tokens, when, and whether the store was asked (else the host tier alone)
        self._pending: dict[str, tuple[list[list[bytes]], int, float, bool]] = {}
        self._loaded: set[str] = set()  # requests a load was scheduled for (until they finish)
        # Tokens of each live request that an engine step has run on: its KV is in its blocks then.
        # A request finished before any step ran it (aborted while its KV was still arriving from a
        # prefill engine) holds blocks of nothing: storing them would poison the pool.
        self._reached: dict[str, int] = {}
        # Stores as blocks fill: each running request (vLLM's own object, whose tokens grow as it
        # decodes), its block ids per group as the step outputs hand them out, the pool blocks
        # queued so far, and the requests any store was queued for (their blocks are held at the end).
        self._live: dict[str, Request] = {}
        self._blocks: dict[str, list[list[int]]] = {}
        self._stored_upto: dict[str, int] = {}
        self._store_queued: set[str] = set()
        self._local_hit: dict[str, int] = {}  # the local prefix-cache hit vLLM last asked a lookup about
        self._allocated: set[int] = set()  # blocks handed out this schedule to be written
        # Boundary states vLLM offered (per request: kvbridge group, block, boundary tokens) whose
        # step has not run yet: queued at the next schedule, or at the end from the blocks held.
        self._offers: dict[str, list[tuple[int, int, int]]] = {}
        self._running_stores = True  # off for good if the blocks handed out cannot be told
        self._meta = PoolMetadata()
        self._events: deque = deque(maxlen=MAX_EVENTS)  # KV events of stores queued (`settings.kv_events`)

    # -- on the pool thread -------------------------------------------------------------------------
    def _ensure_index(self, connect: bool = True) -> PoolIndex:
        """The scheduler's index, and with `connect` its client, built once (`StoreClient` says why
        it is kept). With a host tier the index goes on without a client while the store is away
        (it answers from the host tier) and the next probe tries again."""
        with self._index_lock:
            if self._index is None:
                self._index = PoolIndex(self.conn.spec, None, self.conn.config, vllm_staging)
        if self._index.client is None and connect:
            try:
                self._client = self._index.client = StoreClient(self.conn.settings.store_config(lend=False))
            except PoolUnavailable:
                if not self.conn.config.host_bytes:
                    raise
        return self._index

    def _hits(self, call: Call, keys: list[bytes], remote: bool = True) -> tuple[list[bool], bool]:
        """Per key whether it is in the pool, and whether the store answered; `remote=False` while
        the breaker is open: the host tier alone. A block the store did not answer about is a miss
        (what the host tier holds is still a hit)."""
        index = self._ensure_index(connect=remote)
        answer = index.hits(keys, remote=remote)
        return [a is True for a in answer], index.client is not None and all(a is not None for a in answer)

    def _probe_store(self, call: Call) -> None:
        client = self._ensure_index().client
        if client is None or not client.answers():
            raise PoolUnavailable(f"Mooncake Store at {self.conn.settings.master} did not answer")

    # -- on the engine's scheduler ------------------------------------------------------------------
    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            return self._lookup(request, num_computed_tokens)
        except Exception as e:  # noqa: BLE001 - a cache's error is a miss, never a failed request
            logger.warning("KVBridgePoolConnector: lookup of %s failed, a miss: %s", request.request_id, one_line(e))
            self._forget_lookup(request.request_id)
            return 0, False

    def _lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        self._local_hit[rid] = num_computed_tokens
        if not self.conn.settings.load or rid in self._loaded:
            return 0, False  # one load per request: after a refused one, vLLM recomputes (no retry loop)
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # vLLM reads no cache for it (prompt log-probs, ...) and would drop a hit: none asked
        tokens = list(request.all_token_ids)
        usable = (len(tokens) - 1) // self.bt  # vLLM computes at least the last token itself
        if usable * self.bt <= num_computed_tokens:
            self._forget_lookup(rid)
            return 0, False
        if rid in self._pending:  # answered at an earlier step, and vLLM could not schedule it then
            _, tokens_hit, at, remote = self._pending[rid]
            if time.monotonic() - at < ANSWER_KEPT_S:
                if tokens_hit <= num_computed_tokens or (remote and not self.breaker.is_closed):
                    return 0, False
                return tokens_hit - num_computed_tokens, self.conn.settings.load_async
            del self._pending[rid]  # long waited: the store may have evicted or gained blocks since
        if not self._lookups.asked(rid):
            remote = self.breaker.is_closed  # the store away: with a host tier, that tier alone is asked
            if not (remote or self.conn.config.host_bytes):
                self.tally.add(lookups_skipped=1)
                return 0, False
            keys = [k for ks in request_group_keys(request, tokens[:usable * self.bt], self.bt, len(self.windows))
                    for k in ks]  # every group's keys, group after group
            if not self._lookups.ask(rid, keys, remote):
                return 0, False
            self.tally.add(lookups=1, queried_tokens=usable * self.bt - num_computed_tokens)
            self._lookups.wait(rid)  # what is left of this step's inline wait
        got = self._lookups.answer(rid)
        if got is None:
            if not self._lookups.asked(rid):  # its call was refused (the pool thread's queue full): a miss
                return 0, False
            if self._lookups.age(rid) < self.lookup_timeout:
                return None, False  # vLLM asks again at its next step
            remote = self._lookups.remote(rid)
            self._forget_lookup(rid)
            self.tally.add(lookup_timeouts=1)
            if remote:
                self.breaker.failure(f"no answer to a lookup within {self.conn.settings.lookup_timeout_ms} ms")
            return 0, False
        flat, answer, answered, remote = got.keys, got.present, got.answered, got.remote
        if got.error is not None:
            if remote:
                self.breaker.failure(one_line(got.error))
            return 0, False
        if remote and answered:
            self.breaker.success()
        elif remote:
            self.breaker.failure(f"Mooncake Store at {self.conn.settings.master} did not answer a lookup")
        per = len(flat) // len(self.windows)
        keys = [flat[g * per:(g + 1) * per] for g in range(len(self.windows))]
        present = dict(zip(flat, answer))
        # Full groups need every block of the prefix, sliding ones the blocks their window still sees.
        tokens_hit = request_hits(keys, self.windows, self.bt, len(tokens), present.get) or 0
        hits = tokens_hit // self.bt
        logger.debug("KVBridgePoolConnector: %s: %d of %d pool blocks usable, %d tokens computed here", rid, hits,
                     per, num_computed_tokens)
        # Kept until vLLM allocates the request's blocks: a request it cannot schedule yet (no free
        # blocks, a LoRA slot) is asked about again at every step, and is answered from this, not
        # with another round trip and another count.
        self._pending[rid] = ([ks[:hits] for ks in keys], tokens_hit, time.monotonic(), remote)
        if tokens_hit <= num_computed_tokens:
            return 0, False
        self.tally.add(hit_tokens=tokens_hit - num_computed_tokens)
        # Synchronous by default: the worker loads at the start of the very step that computes the
        # rest of the prompt (an asynchronous load costs two more engine steps before the request
        # runs, which on a busy CPU engine cost more than the tokens it saved).
        return tokens_hit - num_computed_tokens, self.conn.settings.load_async

    def _storing(self) -> bool:
        """Whether stores are queued: while the store answers, or with a host tier always (the
        worker puts into the host tier alone while the store is away)."""
        return self.breaker.is_closed or bool(self.conn.config.host_bytes)

    def _forget_lookup(self, rid: str) -> None:
        self._lookups.forget(rid)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called for every request vLLM schedules from its waiting queue (new or resumed, in a
        MultiConnector too): its blocks past the local prefix-cache hit are written from now on.
        Never raises: a load it cannot plan is one the worker fails (vLLM then recomputes)."""
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - a cache's error must never reach the scheduler
            logger.warning("KVBridgePoolConnector: %s not noted, its stores are off: %s", request.request_id,
                           one_line(e))
            self._stop_running_stores(e)
            if num_external_tokens and request.request_id not in {j.request_id for j in self._meta.loads}:
                # vLLM counts these tokens as coming: the worker fails every block of the request.
                try:
                    ids = [int(b) for group in blocks.get_block_ids() for b in group if int(b) != 0]
                except Exception:  # noqa: BLE001 - nothing left to tell vLLM which blocks to recompute
                    ids = []
                self._meta.loads.append(PoolJob(request.request_id, [], ids, (), ()))

    def _after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._live[request.request_id] = request
        fresh = self._local_hit.pop(request.request_id, 0) // self.conn.block_size  # not asked: all of them
        try:
            for t in self._tables(blocks.get_block_ids()):
                self._allocated.update(t[fresh:])
        except Exception as e:  # noqa: BLE001 - without the list, no store of a running request is safe
            self._stop_running_stores(e)
        pending = self._pending.pop(request.request_id, None)
        if not num_external_tokens or pending is None:
            return
        keys, tokens_hit, _, _ = pending
        self._loaded.add(request.request_id)
        # What it loads is in the pool already: stores as its blocks fill start after it.
        self._stored_upto[request.request_id] = tokens_hit // self.bt
        bs = self.conn.block_size
        local = tokens_hit - num_external_tokens
        tables = [t[: tokens_hit // bs] for t in self._tables(blocks.get_block_ids())]
        try:
            on_device = [[i < local // bs for i in range(len(t))] for t in tables]
            load_keys, gpu = load_job(tables, keys, tokens_hit, bs, self.factor, on_device, self.state)
            job = PoolJob(request.request_id, load_keys, gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices,
                          tenant=tenant_of(request))
        except Exception as e:  # noqa: BLE001 - vLLM counts these tokens as coming: the worker must fail them
            logger.warning("KVBridgePoolConnector: load of %s not planned, recomputing: %s", request.request_id,
                           one_line(e))
            job = PoolJob(request.request_id, [], [b for t in tables for b in t[local // bs:] if b != NULL], (), ())
        self._meta.loads.append(job)

    def _tables(self, block_ids: tuple[list[int], ...]) -> list[list[int]]:
        """vLLM's block ids per group in kvbridge's group order, its null block (id 0: the block
        pool's first, standing for blocks a sliding window no longer holds) as `NULL`."""
        if len(block_ids) != len(self.vllm_groups):
            raise IncompatibleEngines(f"{len(block_ids)} block-id groups where the KV cache has {len(self.vllm_groups)}")
        return [[NULL if int(b) == 0 else int(b) for b in block_ids[v]] for v in self.vllm_groups]

    def finished(self, request: Request, block_ids: tuple[list[int], ...]) -> bool:
        """Queue the store of the request's full pool blocks, per group those still on the device
        (each rank puts those of its objects the store lacks); True: hold its blocks until the
        ranks have copied them out (always when a store was queued while it ran: the ranks
        report its blocks free once those are done, and vLLM frees only blocks it held)."""
        held = request.request_id in self._store_queued
        try:
            return self._finished(request, block_ids) or held
        except Exception as e:  # noqa: BLE001 - a store that cannot be queued is dropped
            logger.warning("KVBridgePoolConnector: store of %s dropped: %s", request.request_id, one_line(e))
            return held
        finally:
            self._store_queued.discard(request.request_id)

    def _finished(self, request: Request, block_ids: tuple[list[int], ...]) -> bool:
        rid = request.request_id
        reached = self._reached.pop(rid, 0)
        self._stored_upto.pop(rid, None)
        self._local_hit.pop(rid, None)
        self._live.pop(rid, None)
        self._blocks.pop(rid, None)
        self._loaded.discard(rid)
        self._pending.pop(rid, None)
        self._forget_lookup(rid)
        offers = self._offers.pop(rid, [])
        if not self.conn.settings.store or not self._storing():
            return False
        # Every full block, those queued while it ran too: a store of a running request's blocks
        # is dropped when one of them is handed out again, and the worker puts only what the
        # store lacks (its stores run in order: those queued earlier are in by then).
        n = min(reached, int(request.num_computed_tokens), len(request.all_token_ids)) // self.bt
        # A window's pool blocks only where it still holds all of their device blocks (`whole_blocks`).
        tables = self._tables(block_ids)
        held = [(g, b, at) for g, b, at in offers if at <= n * self.bt and b in tables[g]]  # its step has run
        queued = self._queue_states(request, held, running=False)
        tables = [whole_blocks(t, self.factor) if w else t for t, w in zip(self._token_tables(tables), self.windows)]
        return self._queue_store(request, tables, 0, n, running=False) or queued

    def _token_tables(self, tables: list[list[int]]) -> list[list[int]]:
        """`tables` with the recurrent groups' blanked: their stores come from vLLM's offers."""
        return [[NULL] * len(t) if g in self.state else t for g, t in enumerate(tables)]

    def _queue_states(self, request: Request, offers: list[tuple[int, int, int]], running: bool) -> bool:
        """Queue the store of the boundary states `offers` (group, block, boundary tokens): each
        the checkpoint of the pool block ending at its boundary; True if a job was queued."""
        if not offers:
            return False
        offers = sorted(set(offers))
        upto = max(at for _, _, at in offers)
        keys = request_group_keys(request, list(request.all_token_ids)[:upto], self.bt, len(self.windows))
        sizes, first, ids, want = [0] * len(keys), [0] * len(keys), [], []
        for g, block, at in offers:
            if not sizes[g]:
                first[g] = at // self.conn.block_size - 1
            sizes[g] += 1
            ids.append(block)
            want.append(keys[g][at // self.bt - 1])
        self._meta.stores.append(PoolJob(request.request_id, want, ids, tuple(sizes), tuple(first), running,
                                         tenant_of(request)))
        self._store_queued.add(request.request_id)
        if running:
            self.tally.add(running_blocks_queued=len(want))
        return True

    def _take_offers(self, output: SchedulerOutput) -> None:
        """This step's boundary-state offers that end on a pool block, kept until its step has run."""
        state = getattr(output, "kv_connector_block_state", None)
        offered = getattr(state, "boundary_state_offloads", None) or {}
        ours = {v: g for g, v in enumerate(self.vllm_groups) if g in self.state}
        for rid, entries in offered.items():
            keep = [(ours[int(v)], int(b), int(at)) for v, b, at in entries
                    if int(v) in ours and at > 0 and at % self.bt == 0 and int(b) != 0]
            if keep and rid in self._live:
                self._offers.setdefault(rid, []).extend(keep)

    def _queue_store(self, request: Request, tables: list[list[int]], start: int, n: int, running: bool) -> bool:
        """Queue the store of pool blocks `[start, n)` of every group whose device blocks are in
        `tables` (`NULL` where a group no longer holds one); True if a job was queued. `running`:
        the request runs on, its blocks are not held for the store (see `PoolJob.running`)."""
        n = min([n] + [len(t) // self.factor for t in tables])
        if n <= start:
            return False
        keys = request_group_keys(request, list(request.all_token_ids)[: n * self.bt], self.bt, len(tables))
        to_store = [k for g, t in enumerate(tables) for k in storable_keys(t, keys[g], self.factor, start, n)]
        if not to_store:
            return False
        gpu = store_job(tables, keys, to_store, self.factor)
        rid = request.request_id
        self._meta.stores.append(PoolJob(rid, to_store, gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices,
                                         running, tenant_of(request)))
        if self.conn.settings.kv_events:
            self._announce(request, keys[0][:n], n)
        self._store_queued.add(rid)
        if running:
            self.tally.add(running_blocks_queued=len(to_store))
        return True

    def scheduled(self, output: SchedulerOutput) -> None:
        """Note each scheduled request's blocks and how far its KV will be computed once this step
        has run; queue the stores of pool blocks earlier steps filled; tell the workers which
        blocks this step hands out (`PoolMetadata.allocated`). Never raises: on an error, stores
        while requests run are off and the workers drop those in flight (`drop_running`)."""
        try:
            self._lookups.step_ended()  # what waited for a call goes now, in one
            self._scheduled(output)
        except Exception as e:  # noqa: BLE001 - a cache's error must never reach the scheduler
            self._stop_running_stores(e)
            self._meta.drop_running = True

    def _scheduled(self, output: SchedulerOutput) -> None:
        cached = output.scheduled_cached_reqs
        try:
            for r in output.scheduled_new_reqs:
                self._note_blocks(r.req_id, r.block_ids, True)
            for rid, ids in zip(cached.req_ids, cached.new_block_ids):
                resumed = rid in cached.resumed_req_ids
                tables = self._note_blocks(rid, ids, resumed)
                if not resumed:  # a running request's new blocks are all fresh (resumed ones: `after_alloc`)
                    for t in tables:
                        self._allocated.update(t)
        except Exception as e:  # noqa: BLE001 - see after_alloc
            self._stop_running_stores(e)
        self._allocated.discard(NULL)
        self._meta.allocated, self._allocated = sorted(self._allocated), set()
        self._meta.drop_running = not self._running_stores
        ran, self._offers = self._offers, {}
        self._take_offers(output)
        if self._running_stores and self.conn.settings.store and self._storing():
            handed_out = set(self._meta.allocated)
            for rid, offers in ran.items():  # the steps that computed these states have run
                request = self._live.get(rid)
                offers = [o for o in offers if o[1] not in handed_out]  # freed and given out again already
                if request is not None:
                    try:
                        self._queue_states(request, offers, running=True)
                    except Exception as e:  # noqa: BLE001 - a store that cannot be queued is dropped
                        logger.warning("KVBridgePoolConnector: store of %s's states dropped: %s", rid, one_line(e))
            for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
                try:
                    self._store_filled(rid, computed)
                except Exception as e:  # noqa: BLE001 - a store that cannot be queued is dropped
                    logger.warning("KVBridgePoolConnector: store of %s's filled blocks dropped: %s", rid, one_line(e))
                    self._stored_upto.pop(rid, None)
                    self._blocks.pop(rid, None)  # no more stores while it runs; its final one still comes
        n = output.num_scheduled_tokens
        for r in output.scheduled_new_reqs:
            self._reached[r.req_id] = max(self._reached.get(r.req_id, 0), r.num_computed_tokens + n.get(r.req_id, 0))
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self._reached[rid] = max(self._reached.get(rid, 0), computed + n.get(rid, 0))

    def _stop_running_stores(self, e: Exception) -> None:
        if self._running_stores:
            logger.warning("KVBridgePoolConnector: stores while requests run are off (requests are stored when "
                           "they finish): %s", one_line(e))
        self._running_stores = False
        self._blocks.clear()

    def _note_blocks(self, rid: str, ids: tuple[list[int], ...] | None, replace: bool) -> list[list[int]]:
        """Keep a live request's block ids per group up to date; returns the ones the step added."""
        if ids is None:
            return []
        tables = self._tables(ids)
        if rid in self._live and self._running_stores:
            mine = self._blocks.get(rid)
            if replace:
                self._blocks[rid] = [list(t) for t in tables]
            elif mine is not None:  # none: its table was dropped (or never whole), its new blocks alone are not one
                for have, new in zip(mine, tables):
                    have += new
        return tables

    def _store_filled(self, rid: str, computed: int) -> None:
        """Queue the store of the pool blocks of running request `rid` that earlier steps filled,
        once it has decoded a pool block's worth of tokens (a long decode is stored as it goes, as
        vLLM's OffloadingConnector does): only tokens an executed step ran on (`_reached` before
        this step), never beyond its last sampled token."""
        request, tables = self._live.get(rid), self._blocks.get(rid)
        if request is None or tables is None or request.num_output_tokens < self.bt:
            return  # a short reply is stored once, when it ends: one job, not two
        done = min(self._reached.get(rid, 0), int(computed), len(request.all_token_ids) - 1)
        n, start = done // self.bt, self._stored_upto.get(rid, 0)
        if n <= start:
            return
        # A sliding window's blocks before its reach are vLLM's to free (and hand out again) at
        # any schedule: device block i once (i + 1) * block_size <= computed - window + 1 (vLLM's
        # skipped tokens; this schedule freed with `computed`, a later one's frees come with the
        # blocks it hands out). A window's pool block is read only while all its device blocks are held.
        edge, bs = max(int(computed), self._reached.get(rid, 0)), self.conn.block_size
        view = [whole_blocks([NULL if (i + 1) * bs <= edge - w + 1 else b for i, b in enumerate(t)], self.factor)
                if w else t for t, w in zip(self._token_tables(tables), self.windows)]
        self._queue_store(request, view, start, n, running=True)
        self._stored_upto[rid] = n

    def _announce(self, request: Request, keys: list[bytes], n: int) -> None:
        """One vLLM `BlockStored` for the request's first `n` pool blocks (the whole chain from its
        first block: a relay anchors a chain only there), as vLLM writes its own: token ids, the
        LoRA name on every block and the salt on the first (`to_event_extra_keys`)."""
        from vllm.distributed.kv_events import BlockStored

        if n * self.bt > MAX_ANNOUNCED_TOKENS:  # each store sends the chain from its start: bounded
            return
        lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
        salt = getattr(request, "cache_salt", None)
        extras = [tuple(x for x in (lora, salt if i == 0 else None) if x) or None for i in range(n)]
        self._events.append(BlockStored(
            block_hashes=[bytes(k) for k in keys], parent_block_hash=None,
            token_ids=[int(t) for t in list(request.all_token_ids)[: n * self.bt]], block_size=self.bt,
            lora_id=None, medium="CPU", lora_name=lora, extra_keys=extras if any(extras) else None,
            ownership=POOL_OWNER))

    def take_events(self) -> list:
        """The KV events of stores queued since the last call (vLLM publishes them with its own)."""
        out = list(self._events)
        self._events.clear()
        return out

    def take_meta(self) -> PoolMetadata:
        meta, self._meta = self._meta, PoolMetadata()
        return meta

    def close(self) -> None:
        self._prober.close()
        if self._host_thread is not None:
            self._host_thread.close(timeout=5.0)
        self._thread.close(timeout=5.0)
        if self._thread.current is None and self._client is not None:
            self._client.close()


__all__ = ["PoolScheduler"]

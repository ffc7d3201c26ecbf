"""The worker side of KVBridgePoolConnector: one engine rank's loads and stores, on threads, with deadlines.

Why threads: a store or load is several Mooncake RPCs, and a master that is stopped blocks them
for as long as it is stopped. Every job runs on one of this rank's two `PoolThread`s, and
touches device memory only through its call's gate (`pool.background`), so the step that waits for a load waits
at most `load_timeout_ms` (then the load's blocks are reported failed and recomputed, and the
late answer never reaches them), and a store holds its blocks at most `store_timeout_ms`. The
store client and each thread's tier are built on the threads at first use (a dead master costs the thread,
never the engine, its connection attempt) and kept: Mooncake's client finds a restarted master
by itself, and a new one would hold the GIL while a stopped master does not answer. No pool error leaves this
module: a load that cannot complete is failed blocks for vLLM, a store that cannot is dropped.

Why two threads: a load is on a request's path (the step, or the request, waits for it), a store
on nobody's. Loads have their own thread and staging, so a load never queues behind the stores
of requests that finished before it; the store thread runs at a lower priority (`STORE_NICE`),
so that on a host whose cores the forward keeps busy its copies and seals take the gaps between
forwards instead of a core from the forward's threads (a store that falls behind is dropped at
`store_timeout_ms`, a later writer stores it).

Why four with a host tier (issue 42.3): a call to a hung master holds its thread until the master
answers, so nothing that needs only this host's memory may queue behind one. The load and store
threads then never call the store: a load whose blocks the host tier holds runs on the load
thread, one that needs the store on the fetch thread (with the breaker's probes); a store seals
into the host tier on the store thread, and what it sealed is put into the store from there on
the put thread. A hung master holds the fetch and put threads only: host-tier loads hit and
stores reach the host tier while it hangs; puts that fall behind are dropped (`puts_dropped`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from kvbridge.errors import IncompatibleEngines
from kvbridge.integrations.vllm.layout import unified_page
from kvbridge.integrations.vllm.pool_config import PoolJob, PoolMetadata, announce, one_line, vllm_staging
from kvbridge.integrations.vllm.pool_metrics import StatsTally
from kvbridge.integrations.vllm.registration import check_cpu_mla_layout, spec_and_layout
from kvbridge.pool.background import Call, PoolThread, Prober
from kvbridge.pool.breaker import Breaker
from kvbridge.pool.store import PoolUnavailable, StoreClient, prepare_process
from kvbridge.pool.tier import HostEntry, PoolTier, TierResult
from kvbridge.transport.cache import RankCache

if TYPE_CHECKING:
    from kvbridge.integrations.vllm.pool_connector import KVBridgePoolConnector

logger = init_logger(f"vllm.{__name__}")
MAX_FINISHED_IDS = 1 << 16
PUT_STAGING_BLOCKS = 4
"""The put tier's staging and wire buffer, in pool blocks: puts go a wire buffer's worth at a time."""
STORE_NICE = 10
"""How far the store thread steps aside (nice +10: about a tenth of a forward thread's share of a
contended core; an idle core it takes whole)."""
TIER_COUNTS = ("objects_put", "objects_got", "bytes_put", "bytes_got", "seal_failures", "missing", "removed",
               "host_objects_put", "host_objects_got", "put_failures")


def layer_region(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A layer's cache as the `nbytes` bytes its layout addresses from the tensor's first byte: the
    tensor itself when it is that, else those bytes of its storage (vLLM's hybrid allocator hands
    each layer a view, a page apart per block, into one allocation every group shares;
    registration checked its shape and block stride against the layout)."""
    if t.is_contiguous() and t.numel() * t.element_size() == nbytes:
        return t
    storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    start = t.storage_offset() * t.element_size()
    if start + nbytes > storage.numel():
        raise IncompatibleEngines(f"a KV cache tensor {tuple(t.shape)} at byte {start} of its {storage.numel()}-byte "
                                  f"allocation cannot hold the {nbytes} bytes its layout addresses")
    return storage[start:start + nbytes]


class Moved(NamedTuple):
    """What a host-tier load that missed returns: the fetch thread's call now carrying it."""

    call: Call


def _moved(call: Call) -> Call | None:
    """The call a finished load moved to (`Moved`), or None."""
    result = call.result if call.error is None else None
    return result.call if isinstance(result, Moved) else None


class PoolWorker:
    """One engine rank: its store client and tier on its own thread (see the module)."""

    def __init__(self, conn: KVBridgePoolConnector, rank: int, tp_size: int):
        self.conn, self.rank, self.tp_size = conn, rank, tp_size
        s = conn.settings
        self.load_timeout, self.store_timeout = s.load_timeout_ms / 1000, s.store_timeout_ms / 1000
        self.release_s = s.release_ms / 1000
        self._putting: list[tuple[str, Call]] = []  # stores that released their blocks, still putting

        self._caches: dict[str, torch.Tensor] = {}
        self._tiers: dict[str, PoolTier] = {}  # "load" and "store", each used by its own thread only
        self._client: StoreClient | None = None  # one per rank, shared by both threads
        self._client_lock = threading.Lock()
        prepare_process(s.store_config(lend=s.segment_mib > 0))  # on the engine's thread, before any pool thread
        self._load_thread = PoolThread(f"kvbridge-pool-load{rank}", max_queue=1024)
        self._store_thread = PoolThread(f"kvbridge-pool-store{rank}", max_queue=1024)
        self._split = s.host_mib > 0  # the store's calls on threads of their own (see the module)
        self._fetch_thread = PoolThread(f"kvbridge-pool-fetch{rank}", max_queue=1024) if self._split else self._load_thread
        self._put_thread = PoolThread(f"kvbridge-pool-put{rank}", max_queue=1024) if self._split else None
        self._new_puts: deque[Call] = deque()  # put calls the store thread queued, not yet seen by the engine's thread
        self._puts: list[Call] = []  # put calls in flight (their outcome goes to the breaker)
        self.tally = StatsTally()
        self.breaker = Breaker(1.0, s.max_backoff_s, on_change=announce(logger, s.master, f"rank {rank}", self.tally))
        self._prober = Prober(self._fetch_thread, self.breaker, self._probe_store, self.load_timeout)
        self._stores: dict[str, list[tuple[Call, frozenset[int]]]] = {}  # in flight, with the blocks each reads
        self._loads: dict[str, tuple[Call, PoolJob]] = {}  # asynchronous loads in flight
        self._stored: set[str] = set()  # stores done, dropped or given up: their blocks may go
        self._finished: OrderedDict[str, float] = OrderedDict()  # recent finished ids (bounded): when each ended
        self._res = KVConnectorTransferResults()
        self._failed_blocks: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec, layout, names = spec_and_layout(self.conn._vllm_config, self.conn._kv_cache_config, kv_caches,
                                              self.tp_size, prefix_states=True)
        if spec.has_recurrent:  # the unified page given, so each group's layers are addressed alone as in the whole
            layout = msgspec.structs.replace(layout, page_bytes=unified_page(spec, layout, self.rank))
        if spec.fingerprint() != self.conn.spec.fingerprint() or spec.num_layers != self.conn.spec.num_layers:
            raise IncompatibleEngines(f"KVBridgePoolConnector: the registered cache ({spec.describe()}) differs from "
                                      f"the one the scheduler derived from the configs ({self.conn.spec.describe()})")
        if spec.is_mla:
            check_cpu_mla_layout(self.conn._vllm_config, names[0], kv_caches[names[0]])
        if hasattr(torch.cpu, "_init_amx") and torch.cpu._is_amx_tile_supported():
            # vLLM CPU 0.32 leaves Linux's AMX tile permission to the first oneDNN call that uses
            # tiles. A fresh instance whose first prefill started from a pool hit ran vLLM's own AMX
            # attention kernel first and died on an illegal instruction (a tiny bfloat16 llama,
            # measured; after one prefill of its own it served). Asking for it is harmless.
            if not torch.cpu._init_amx():
                logger.warning("KVBridgePoolConnector rank %d: Linux refused AMX tiles to this process; vLLM's "
                               "AMX attention kernel may stop it on its first prefill", self.rank)
        self._caches = kv_caches
        # The VllmCpuLayout itself: its addressing places K transposed per head (a plain
        # EngineLayout of the same fields describes other bytes, and same-shape round trips hid it).
        self._names, self._spec, self._layout = names, spec, layout

    # -- on the pool thread ---------------------------------------------------------------------------
    def _ensure_tier(self, kind: str, connect: bool = True) -> PoolTier:
        """The rank's tier of `kind`, with the store client when `connect` (see `_connect`).
        Built at first use: another connector (MultiConnector) may re-point the cache tensors at
        registration; the tensors themselves are what vLLM computes into."""
        tier = self._tiers.get(kind)
        if tier is not None:
            if tier.client is None and connect:
                self._connect()
            return tier
        client = self._connect() if connect else (self._client if self._calls_store(kind) else None)
        need = self._layout.addressing(self._spec, self.rank).region_nbytes
        cache = RankCache(self._spec, self._layout, self.rank,
                          [layer_region(self._caches[n], nbytes) for n, nbytes in zip(self._names, need)])
        # Serial copies: numba's parallel (OpenMP) runtime in a vLLM CPU worker changed the
        # thread count its attention kernels check ("thread_num 1 vs. 2") and killed the engine.
        config = self.conn.config
        if kind == "put":  # it copies sealed objects from the host tier: its staging is never used
            config = msgspec.structs.replace(config, staging_blocks=min(config.staging_blocks, PUT_STAGING_BLOCKS))
        tier = self._tiers[kind] = PoolTier(cache, client, config, parallel=False, staging=vllm_staging)
        if kind == "store":
            self._store_thread.lower_priority(STORE_NICE)
        elif kind == "put":
            assert self._put_thread is not None
            self._put_thread.lower_priority(STORE_NICE)
        elif kind == "load":
            logger.info("KVBridgePoolConnector rank %d: %s; pool at %s, %d-token blocks, writes %d and reads %d "
                        "objects per block", self.rank, self._layout.describe(), self.conn.settings.master,
                        self.conn.config.block_tokens, len(tier.writes[0]), len(tier.reads[0]))
        return tier

    def _connect(self) -> StoreClient | None:
        """The rank's store client, built once and given to every tier built before it. With a host
        tier the rank goes on without one while the store is away (its tiers use the host tier
        alone) and tries again at each probe; without one that is an error (the breaker opens)."""
        with self._client_lock:  # the client (and the threads Mooncake starts) at normal priority
            if self._client is None:
                try:
                    self._client = StoreClient(self.conn.settings.store_config(lend=self.conn.settings.segment_mib > 0))
                except PoolUnavailable:
                    if not self.conn.config.host_bytes:
                        raise
                    return None
            client = self._client
            for kind, tier in list(self._tiers.items()):  # under the lock: the fetch and put threads both attach
                if tier.client is None and self._calls_store(kind):
                    tier.attach(client)
        return client

    def _calls_store(self, kind: str) -> bool:
        """Whether the tier of `kind` ever calls the store (with a host tier only the fetch and
        put tiers do: the others get no client, nor a registered wire buffer)."""
        return not self._split or kind in ("fetch", "put")

    def _drop_tiers(self) -> None:
        tiers, client, self._tiers, self._client = list(self._tiers.values()), self._client, {}, None
        for tier in tiers:
            tier.close()
        if client is not None:
            client.close()

    def _job(self, call: Call, kind: str, job: PoolJob, remote: bool = True) -> TierResult:
        """One load or store; `remote=False` while the breaker is open: the host tier alone.
        `kind` "load" and "store" on their threads; with a host tier, "fetch" (a load that needs
        the store) on the fetch thread, and a store's put queued on the put thread (`_put`)."""
        calls_store = self._calls_store(kind)  # with a host tier only the fetch thread's loads (and puts)
        tier = self._ensure_tier(kind, connect=remote and calls_store)  # the store away: no client built now
        client = tier.client if remote and calls_store else None
        before, counts = client.unreachable if client else 0, dict(tier.stats)
        if kind == "store":
            res = tier.store(job.gpu(), job.keys, call.device_access, skip_present=True, tenant=job.tenant,
                             still_allowed=call.still_allowed, device_done=call.device_released.set,
                             remote=client is not None)
            if self._split and remote and res.sealed:  # its put on the put thread
                self._queue_put(res.sealed)
        else:
            res = tier.load(job.keys, job.gpu(), call.device_access, tenant=job.tenant, remote=client is not None)
            if kind == "load" and self._split and remote and not res.ok and self.breaker.is_closed:
                # The host tier held the blocks when the load was queued and lost some since (an
                # eviction, a bad seal): the store may hold them. Not waited for here: the engine's
                # side follows the load to the fetch thread (`_moved`).
                moved = self._fetch_thread.submit(self._job, "fetch", job, True)
                if moved is not None:
                    return Moved(moved)  # type: ignore[return-value]
        self.tally.add(**{k: tier.stats[k] - counts[k] for k in TIER_COUNTS},
                       **{f"{'store' if kind == 'store' else 'load'}_seconds": res.seconds})
        if client is not None and client.unreachable != before:  # the client is kept: see `StoreClient`
            raise PoolUnavailable(f"Mooncake Store at {self.conn.settings.master} stopped answering during a {kind}")
        return res

    def _queue_put(self, sealed: list[HostEntry]) -> None:
        """On the store thread: hand what a store sealed into the host tier to the put thread."""
        assert self._put_thread is not None
        call = self._put_thread.submit(self._put, sealed)
        if call is None:  # behind (a hung master): the host tier holds them, other hosts recompute them
            self.tally.add(puts_dropped=1)
        else:
            self._new_puts.append(call)

    def _put(self, call: Call, sealed: list[HostEntry]) -> TierResult:
        """On the put thread: put into the store what a store sealed into the host tier."""
        tier = self._ensure_tier("put")
        if tier.client is None:
            raise PoolUnavailable(f"Mooncake Store at {self.conn.settings.master} is away")
        before, counts = tier.client.unreachable, dict(tier.stats)
        res = tier.put_sealed(sealed)
        self.tally.add(**{k: tier.stats[k] - counts[k] for k in TIER_COUNTS}, store_seconds=res.seconds)
        if tier.client.unreachable != before:
            raise PoolUnavailable(f"Mooncake Store at {self.conn.settings.master} stopped answering during a put")
        return res

    def _probe_store(self, call: Call) -> None:
        client = self._ensure_tier("fetch" if self._split else "load").client
        if client is None or not client.answers():
            raise PoolUnavailable(f"Mooncake Store at {self.conn.settings.master} did not answer")

    # -- on the engine's step ---------------------------------------------------------------------------
    def drop_overwritten(self, meta: PoolMetadata) -> None:
        """Before the step's forward (vLLM's `handle_preemptions`, and again at `run`): drop every
        store of a running request (`PoolJob.running`) still reading a block this step hands out
        or loads into. Such a request's blocks are not held for its stores; vLLM frees them when it
        preempts the request or its window slides past them, and may give them to another request
        at any later schedule. A finished request's store reads blocks vLLM holds: never dropped.
        Never raises (a cache's error must not reach the engine); if it cannot tell, it drops them all."""
        if not self._stores:
            return
        try:
            written = set(meta.allocated).union(*(j.block_ids for j in meta.loads))
            drop_all = meta.drop_running
        except Exception as e:  # noqa: BLE001
            logger.warning("KVBridgePoolConnector rank %d: %s; dropping running requests' stores", self.rank,
                           one_line(e))
            written, drop_all = set(), True
        if not (written or drop_all):
            return
        for rid, calls in list(self._stores.items()):
            keep = []
            for call, blocks in calls:
                if not blocks or (blocks.isdisjoint(written) and not drop_all):
                    keep.append((call, blocks))
                else:
                    call.abandon(wait=False)  # a copy in progress is dropped (`still_allowed`), never waited for
                    self.tally.add(stores_dropped=1)
            self._set_stores(rid, keep)

    def _set_stores(self, rid: str, calls: list[tuple[Call, frozenset[int]]]) -> None:
        """`rid`'s stores in flight; with none left its blocks may go (`_stored`)."""
        if calls:
            self._stores[rid] = calls
            self._stored.discard(rid)
        else:
            self._stores.pop(rid, None)
            self._stored.add(rid)

    def run(self, meta: PoolMetadata) -> None:
        """At the step's start: queue the stores, run (or queue) the loads; never raises."""
        self.drop_overwritten(meta)
        if not (meta.loads or meta.stores):
            return
        try:
            for job in meta.stores:
                call = self._submit("store", job)
                calls = self._stores.get(job.request_id, [])
                if call is None:  # the pool is away or the thread is behind: a cache drops, it never waits
                    self.tally.add(stores_dropped=1)
                else:
                    calls = [*calls, (call, frozenset(job.block_ids) if job.running else frozenset())]
                self._set_stores(job.request_id, calls)
            for job in meta.loads:
                if not job.keys:  # the scheduler could not plan it (said in its log): recompute
                    self._fail_load(job, "not planned")
                    continue
                call = self._submit("load", job)
                if call is None:
                    self._fail_load(job, "the pool is unavailable")
                elif self.conn.settings.load_async:
                    self._loads[job.request_id] = (call, job)
                elif call.wait(self.load_timeout) and (moved := _moved(call)) is not None:
                    if moved.wait(max(0.0, self.load_timeout - call.age())):
                        self._settle_load(moved, job)
                    else:
                        self._give_up_load(moved, job)
                elif call.done.is_set():
                    self._settle_load(call, job)
                else:
                    self._give_up_load(call, job)
        except Exception as e:  # noqa: BLE001 - a cache's error must never reach a request or the engine
            logger.warning("KVBridgePoolConnector rank %d: %s; recomputing this step's loads", self.rank, one_line(e))
            for job in meta.loads:
                self._fail_load(job, one_line(e))

    def _submit(self, kind: str, job: PoolJob) -> Call | None:
        """Queue `job` on its kind's thread; None before registration, when that thread is behind,
        or while the store is away (breaker open) without a host tier. With one, a job queued while
        the store is away uses the host tier alone (`_job`'s `remote`): its engines go on sharing."""
        remote = self.breaker.is_closed
        if not (self._caches and (remote or self.conn.config.host_bytes)):
            return None
        if kind == "store":
            return self._store_thread.submit(self._job, kind, job, remote)
        if self._split and remote and not self._on_host(job):
            return self._fetch_thread.submit(self._job, "fetch", job, remote)
        return self._load_thread.submit(self._job, kind, job, remote)  # the host tier's alone (`_remote`)

    def _on_host(self, job: PoolJob) -> bool:
        """Whether the host tier holds all `job` reads now (asked on the engine's thread: the
        arena's lock, no call to the store). Before any tier exists: no (the fetch thread)."""
        try:
            tier = next((t for t in list(self._tiers.values()) if t.host is not None), None)  # all map the same arenas
            return tier is not None and tier.on_host(job.keys)
        except Exception as e:  # noqa: BLE001 - a cache's error must not reach the engine
            logger.warning("KVBridgePoolConnector rank %d: %s", self.rank, one_line(e))
            return False

    def _remote(self, call: Call) -> bool:
        """Whether `call` asked the store (only those say anything about it to the breaker): a
        put always, a load or store when submitted with `remote` and not the host tier's alone."""
        if call.fn == self._put:
            return True
        kind, remote = call.args[0], bool(call.args[2]) if len(call.args) > 2 else True
        return remote and not (self._split and kind in ("load", "store"))

    def _give_up_load(self, call: Call, job: PoolJob) -> None:
        call.abandon()  # from here on the late answer never reaches the blocks
        self.tally.add(timeouts=1)
        if self._remote(call):
            self.breaker.failure(f"a load took over {self.conn.settings.load_timeout_ms} ms")
        self._fail_load(job, "no answer in time")

    def _settle_load(self, call: Call, job: PoolJob) -> None:
        if call.error is not None:
            if isinstance(call.error, PoolUnavailable) and self._remote(call):
                self.breaker.failure(one_line(call.error))
            self._fail_load(job, one_line(call.error))
            return
        if self._remote(call):
            self.breaker.success()
        res: TierResult = call.result
        if not res.ok:
            self._fail_load(job, "; ".join(res.reasons)[:500])
            return
        self.tally.add(loads=1)
        if self.conn.settings.load_async:
            self._res.finished_recving.add(job.request_id)

    def _fail_load(self, job: PoolJob, why: str) -> None:
        logger.warning("KVBridgePoolConnector rank %d: load of %s refused, recomputing: %s", self.rank,
                       job.request_id, why)
        self.tally.add(load_failures=1)
        if self.conn.settings.load_async:
            self._res.failed_recving.add(job.request_id)
            self._res.finished_recving.add(job.request_id)
        if len(self.conn.spec.groups) == 1:  # several groups: vLLM takes only the request (and dies on block ids)
            self._failed_blocks.update(job.block_ids)  # vLLM recomputes from the first of them

    def _settle_stores(self) -> None:
        for rid, calls in list(self._stores.items()):
            self._set_stores(rid, [(c, b) for c, b in calls if not self._settled(rid, c) and not self._released(rid, c)])
        self._putting = [(rid, c) for rid, c in self._putting if not self._settled(rid, c)]
        while self._new_puts:
            self._puts.append(self._new_puts.popleft())
        self._puts = [c for c in self._puts if not self._settled("", c)]

    def _released(self, rid: str, call: Call) -> bool:
        """Whether a finished request's store no longer needs its blocks (issue 42.3): it read them
        all (it goes on putting into the store from the host tier: settled later, `_putting`), or
        it did not within `release_ms` of its request's end (it is dropped: whatever the master
        does, a finished request's blocks are released within that bound)."""
        if call.device_released.is_set():
            self._putting.append((rid, call))
            return True
        if rid not in self._finished:  # a running request's blocks are not held for its stores
            return False
        ended = self._finished[rid] or time.monotonic()
        if time.monotonic() - max(ended, call.submitted) <= self.release_s:
            return False
        call.abandon(wait=False)  # nothing it reads from here on is put: the blocks may go
        self.tally.add(stores_dropped=1)
        return True

    def _settled(self, rid: str, call: Call) -> bool:
        remote = self._remote(call)
        if call.done.is_set():
            if call.error is not None:
                if remote:
                    self.breaker.failure(one_line(call.error))
                else:  # the host tier's: the breaker is the store's, yet it must be seen
                    logger.warning("KVBridgePoolConnector rank %d: store of %s failed: %s", self.rank, rid or "(put)",
                                   one_line(call.error))
            elif not call.result.ok:
                logger.warning("KVBridgePoolConnector rank %d: store of %s incomplete: %s", self.rank, rid or "(put)",
                               "; ".join(call.result.reasons)[:500])
            else:
                if remote:
                    self.breaker.success()
                if call.fn != self._put:
                    self.tally.add(stores=1)
        elif call.age() > self.store_timeout:
            call.abandon(wait=False)  # nothing it reads from here on is put: the blocks may go
            self.tally.add(timeouts=1, **{"puts_dropped" if call.fn == self._put else "stores_dropped": 1})
            if remote:
                self.breaker.failure(f"a store took over {self.conn.settings.store_timeout_ms} ms")
        else:
            return False
        return True

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        for rid in finished_req_ids:
            self._finished[rid] = time.monotonic()  # when it ended: its stores' release bound runs from here
        while len(self._finished) > MAX_FINISHED_IDS:
            self._finished.popitem(last=False)
        try:
            for rid, (call, job) in list(self._loads.items()):
                if call.done.is_set() and (moved := _moved(call)) is not None:
                    self._loads[rid] = (moved, job)  # followed to the fetch thread; its deadline runs on
                    continue
                if call.done.is_set():
                    self._settle_load(call, job)
                elif call.age() > self.load_timeout:
                    self._give_up_load(call, job)
                else:
                    continue
                del self._loads[rid]
            self._settle_stores()
        except Exception as e:  # noqa: BLE001 - see run
            logger.warning("KVBridgePoolConnector rank %d: %s", self.rank, one_line(e))
        res, self._res = self._res, KVConnectorTransferResults()
        done = {r for r in self._stored if r in self._finished}  # vLLM accepts a finished send only of a
        res.finished_sending |= done                               # request it told us finished
        self._stored -= done
        for r in done:
            del self._finished[r]
        return res

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def close(self) -> None:
        self._prober.close()
        for calls in self._stores.values():
            for call, _ in calls:
                call.abandon()
        for call, _ in self._loads.values():
            call.abandon()
        for call in [*self._puts, *self._new_puts]:
            call.abandon()
        threads = {self._store_thread, self._load_thread, self._fetch_thread, self._put_thread} - {None}
        end = time.monotonic() + 10.0  # one deadline for all: a hung master holds two of them
        for thread in threads:
            thread.close(timeout=max(0.1, end - time.monotonic()))
        if all(thread.current is None for thread in threads):
            self._drop_tiers()


__all__ = ["PoolWorker"]

"""One device rank's door to a shared pool: store the blocks it computed, load the blocks it needs.

A job is what vLLM's offloading worker gets (a `GPULoadStoreSpec` plus the offload keys of its
blocks, in group order), cut into chunks of at most `staging_blocks` pool blocks. A chunk goes
through this rank's canonical staging pool:

* store: the offload worker copies the device blocks into staging slots (the planner writes the
  bytes this rank is the source of), then every object this rank writes is encrypted and sealed
  (`pool.seal`, under its tenant's key): with a host tier straight into this host's shared
  memory (`pool.host_tier`), every chunk before any call to the store, and then put into the
  store from there; without one into the rank's wire buffer, one run per object, and put from
  there, zero copy;
* load: blocks the host tier holds whole are opened straight out of it into staging; the others'
  objects are fetched into the wire buffer (and kept on the host tier for its next reader). Only
  when every object of the chunk is present, of the right size and opens under its tenant's key
  does the offload worker copy the chunk into the device blocks. Anything else leaves the device
  untouched and reports the chunk's blocks as not loaded, so the engine recomputes them.

Only the wire buffer is registered with the store: plaintext never leaves the process.

The scheduler side (`pool.index.PoolIndex`) answers whether a block is complete in the pool:
every object of it exists. Objects appear one by one as ranks finish, and vanish one by one when
the store evicts them, so a block is complete only when all are there.

Length: a rank's store and load through both tiers share its staging views, wire buffer, chunking
and counters; split in two, each half would reach into the other's state.
"""

from __future__ import annotations

import time
import weakref
from functools import partial
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.offload.keys import OffloadKey
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvbridge.offload.worker import OffloadWorker
from kvbridge.pool.config import PoolConfig, StagingLayout, job_chunks, object_layout
from kvbridge.pool.host_tier import HostTier, HostWrite
from kvbridge.pool.index import PoolIndex
from kvbridge.pool.objects import ObjectId
from kvbridge.pool.seal import SEAL_BYTES, open_into, seal_all, seal_into, tenant_key
from kvbridge.pool.store import RPC_CODES, StoreClient
from kvbridge.transport.cache import RankCache

HostEntry = tuple[int, OffloadKey, ObjectId, int, int]
"""An object a store sealed into the host tier: (block index in the job, block key, object, arena
slot, slot generation)."""
DeviceAccess = Callable[[], AbstractContextManager[bool]]
"""A gate around every touch of device memory: yields False when the caller stopped waiting."""


def _always() -> AbstractContextManager[bool]:
    return nullcontext(True)


def _yes() -> bool:
    return True


def _nothing() -> None:
    return None


@dataclass
class TierResult:
    """One store or load: per block key whether it reached its destination, and the figures."""

    done: list[bool]
    objects: int = 0
    bytes: int = 0
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)
    sealed: list[HostEntry] = field(default_factory=list)
    """What a store sealed into the host tier and did not put into the store (`put_sealed` does)."""

    @property
    def ok(self) -> bool:
        return all(self.done)


class PoolTier:
    """Stores and loads the blocks of one device rank through a shared pool (see the module).

    `parallel=False` inside an engine process (see `OffloadWorker`): copies stay in one thread."""

    def __init__(self, cache: RankCache, client: StoreClient | None, config: PoolConfig, parallel: bool = True,
                 staging: StagingLayout | None = None):
        from kvbridge.errors import ConfigError

        if client is None and not config.host_bytes:
            raise ConfigError("a pool tier needs a store client, a host tier (host_bytes), or both")
        self.spec, self.device, self.rank = cache.spec, cache.layout, cache.rank
        self.config, self.client = config, client
        self.layout = object_layout(self.spec, config, config.staging_blocks, staging)
        self.staging = self.layout.pool
        self.factor = self.layout.check_device(self.device)
        self._state_groups = frozenset(self.spec.recurrent_groups())  # their block indices name checkpoints
        self.writes = [sorted(s) for s in self.layout.written_by(self.device, self.rank)]
        self._writes_set = [frozenset(w) for w in self.writes]
        self.reads = [sorted(s) for s in self.layout.read_by(self.device, self.rank)]
        self.worker = OffloadWorker([cache], self.staging, parallel=parallel)
        self._regions = self.staging.byte_regions()
        self.host = HostTier(self.layout, config.secret, config.host_bytes, config.host_dir) if config.host_bytes else None
        self._per_block = max((sum(self.layout.nbytes(o) + SEAL_BYTES for o in g) for g in self.layout.group_objects),
                              default=0)
        self.client = None
        self._wire = torch.zeros(1, dtype=torch.uint8)
        self._wire_np, self._wire_base = self._wire.numpy(), self._wire.data_ptr()
        self._unregister = weakref.finalize(self, _nothing)
        self._view_cache: dict[tuple[int, ObjectId], list[np.ndarray]] = {}
        if client is not None:
            self.attach(client)
        self.stats = {"objects_put": 0, "objects_got": 0, "bytes_put": 0, "bytes_got": 0, "seal_failures": 0,
                      "missing": 0, "put_failures": 0, "removed": 0, "host_objects_put": 0, "host_objects_got": 0}

    def attach(self, client: StoreClient) -> None:
        """Use `client` from now on (a host tier's engine starts without one while the store is
        away, `PoolTier(cache, None, ...)`): its wire buffer is made and registered now."""
        if self.client is not None:
            raise ValueError("this pool tier already has a store client")
        # The wire buffer: a chunk's objects back to back as the store holds them (payload
        # encrypted, then its seal), each one run; sized for a chunk of the largest group.
        wire = torch.zeros(max(1, self.config.staging_blocks * self._per_block), dtype=torch.uint8)
        client.register(wire.data_ptr(), wire.numel())
        self.client, self._wire = client, wire
        self._wire_np, self._wire_base = wire.numpy(), wire.data_ptr()
        # Unregistered when the tier goes, closed or not: Mooncake refuses to register memory that
        # overlaps a stale registration, and freed staging is soon reused.
        self._unregister = weakref.finalize(self, _unregister, client, [(self._wire_base, wire.numel())])

    # -- bytes of objects in staging ----------------------------------------------------------------------
    def _views(self, slot: int, obj: ObjectId) -> list[np.ndarray]:
        """An object's plaintext in staging slot `slot`, adjacent pieces merged, built once per
        (slot, object): the staging layout never changes, and building views per object and call
        was a third of a load's time."""
        cached = self._view_cache.get((slot, obj))
        if cached is not None:
            return cached
        runs: list[list[int]] = []
        for r, off, n in self.layout.pieces(slot, obj):
            if runs and runs[-1][0] == r and runs[-1][1] + runs[-1][2] == off:
                runs[-1][2] += n
            else:
                runs.append([r, off, n])
        views = self._view_cache[(slot, obj)] = [self._regions[r][off:off + n].numpy() for r, off, n in runs]
        return views

    def _place(self, entries: Sequence[tuple[int, ObjectId]]) -> list[tuple[int, int]]:
        """(wire offset, stored bytes) of each (slot, object) of one call, back to back."""
        out, at = [], 0
        for slot, obj in entries:
            n = sum(int(v.nbytes) for v in self._views(slot, obj)) + SEAL_BYTES
            out.append((at, n))
            at += n
        return out

    def _wire_runs(self, spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        return [[(self._wire_base + off, n)] for off, n in spans]

    def _run_worker(self, job) -> bool:
        job_id = self.worker.submit(job)
        self.worker.wait([job_id])
        return all(r.success for r in self.worker.get_finished() if r.job_id == job_id)

    def _unreadable_now(self, entries: list[tuple[int, ObjectId, str]]) -> dict[str, tuple[int, ObjectId]]:
        """Of (slot, object, name) that a load could not read, those still unreadable: each is got
        into its staging slot (the store's copy overwrites it after), so a writer that was only slow
        keeps its objects. Not those the master did not answer about."""
        if not entries:
            return {}
        spans = self._place([(slot, o) for slot, o, _ in entries])
        codes = self.client.get([n for *_, n in entries], self._wire_runs(spans))
        return {n: (slot, o) for (slot, o, n), c, (_, want) in zip(entries, codes, spans)
                if c != want and c not in RPC_CODES}

    # -- store ---------------------------------------------------------------------------------------------
    def store(self, gpu: GPULoadStoreSpec, keys: Sequence[OffloadKey], device_access: DeviceAccess = _always,
              skip_present: bool = False, tenant: bytes = b"", still_allowed: Callable[[], bool] = _yes,
              device_done: Callable[[], None] = _nothing, remote: bool = True) -> TierResult:
        """Put the objects this rank writes of every block of the job; `done[i]`: all of key i's are in
        (in the host tier, or in the store). `device_done()` is called once the job reads no more
        device memory (its blocks may be released while it goes on putting).

        With a host tier, objects are sealed straight into it (those another engine of the host
        holds or is writing are left to it), and the store gets a copy of what this call sealed.
        `device_access` gates each read of the device (see `pool.background`); `skip_present`
        first asks the store which of this rank's objects exist and puts only the others (an
        object is never overwritten: a bad one is removed by the load that finds it, and one this
        rank's client could not read where the store lists it is removed and put again here).
        `tenant` (vLLM's cache_salt) picks the key its objects are encrypted under.
        `still_allowed`, asked after each device read, says whether the caller kept waiting during
        it (`Call.still_allowed`): one abandoned meanwhile may have read blocks being rewritten, so
        nothing of that read is put. `remote=False` leaves the store alone (it is away, or a
        thread of its own puts: `put_sealed` of `TierResult.sealed`): the host tier only, and
        without one nothing is stored."""
        if self.host is not None:
            return self._store_via_host(gpu, keys, device_access, skip_present, tenant, still_allowed, device_done,
                                        remote)
        if not remote or self.client is None:
            device_done()
            return TierResult([False] * len(keys), reasons=["no host tier, and the store is away"])
        try:
            return self._store_direct(gpu, keys, device_access, skip_present, tenant, still_allowed)
        finally:
            device_done()

    def _store_direct(self, gpu: GPULoadStoreSpec, keys: Sequence[OffloadKey], device_access: DeviceAccess,
                      skip_present: bool, tenant: bytes, still_allowed: Callable[[], bool]) -> TierResult:
        """Without a host tier: chunk by chunk, device -> staging -> seal -> put."""
        t0 = time.perf_counter()
        tkey = tenant_key(self.config.secret, tenant)
        result = TierResult([])
        for chunk, chunk_keys in job_chunks(gpu, keys, self.layout, self.factor, self.config.staging_blocks):
            mine = [self.writes[self.layout.group_of(key)] for key in chunk_keys]
            wanted = [list(objs) for objs in mine]
            stale: dict[str, tuple[int, ObjectId]] = {}
            if skip_present:
                flat = [(slot, o, n) for slot, (key, objs) in enumerate(zip(chunk_keys, wanted))
                        for o, n in zip(objs, self.layout.keys(key, objs))]  # one block name per block
                names = [n for *_, n in flat]
                listed = {n for n, e in zip(names, self.client.exists(names)) if e is True}
                # Listed, but unreadable when this rank last loaded them (a dead writer's memory) and still
                # now: replaced below. Every note of these names ends here.
                noted = set(self.client.take_unreadable(names))
                stale = self._unreadable_now([(slot, o, n) for slot, o, n in flat if n in listed and n in noted])
                wanted = [[] for _ in chunk_keys]
                for slot, o, n in flat:
                    if n not in listed or n in stale:
                        wanted[slot].append(o)
                if not any(wanted):
                    result.done += [True] * len(chunk_keys)
                    continue
            if any(f % self.factor for g, f in enumerate(chunk.block_indices) if g not in self._state_groups):
                # a skipped head: no stale bytes in objects
                for r in self._regions:
                    r.zero_()
            with device_access() as allowed:
                copied = allowed and self._run_worker((chunk, CPULoadStoreSpec(range(len(chunk_keys)))))
            allowed = allowed and still_allowed()
            copied = copied and allowed
            if not copied:
                self.client.note_unreadable(list(stale))  # for the next store of them
                result.done += [False] * len(chunk_keys)
                result.reasons.append("device -> staging copy failed" if allowed else "abandoned (deadline)")
                continue
            if stale:  # removed only now, with their bytes in staging: a put of a name still there would change nothing
                kept = [n for n, c in zip(stale, self.client.remove(list(stale))) if c != 0]
                self.stats["removed"] += len(stale) - len(kept)
                self.client.note_unreadable(kept)
                for n in kept:
                    slot, o = stale[n]
                    wanted[slot].remove(o)
            names, owner, spans = self._seal_chunk(tkey, chunk_keys, wanted)
            codes = self.client.put(names, self._wire_runs(spans)) if names else []
            bad = {owner[i] for i, c in enumerate(codes) if c != 0}
            self.stats["put_failures"] += sum(c != 0 for c in codes)
            if bad:
                result.reasons.append(f"{sum(c != 0 for c in codes)} puts failed (Mooncake codes "
                                      f"{sorted({c for c in codes if c != 0})[:4]})")
            put = [i for i, c in enumerate(codes) if c == 0]
            nbytes = sum(spans[i][1] - SEAL_BYTES for i in put)  # payload only
            result.objects += len(put)
            result.bytes += nbytes
            self.stats["objects_put"] += len(put)
            self.stats["bytes_put"] += nbytes
            result.done += [slot not in bad for slot in range(len(chunk_keys))]
        result.seconds = time.perf_counter() - t0
        return result

    def _store_via_host(self, gpu: GPULoadStoreSpec, keys: Sequence[OffloadKey], device_access: DeviceAccess,
                        skip_present: bool, tenant: bytes, still_allowed: Callable[[], bool],
                        device_done: Callable[[], None], remote: bool) -> TierResult:
        """With a host tier: first every chunk device -> staging -> sealed into the host tier (no
        call to the store, so a hung master never holds the device blocks), then `device_done()`,
        then what this call sealed is put into the store from the host tier, for the other hosts."""
        t0 = time.perf_counter()
        tkey = tenant_key(self.config.secret, tenant)
        result = TierResult([])
        sealed: list[HostEntry] = []
        assert self.host is not None
        try:
            for chunk, chunk_keys in job_chunks(gpu, keys, self.layout, self.factor, self.config.staging_blocks):
                base = len(result.done)
                mine = [self.writes[self.layout.group_of(key)] for key in chunk_keys]
                host = self.host.claim(chunk_keys, mine)
                if not host.targets:  # the host's engines hold it all, or no slot is free of a writer
                    HostTier.publish(host)
                    result.done += [c is not None for c in host.claims]
                    continue
                def everything(host=host) -> frozenset:
                    return frozenset((i, o) for i, o, _ in host.targets)

                if any(f % self.factor for g, f in enumerate(chunk.block_indices) if g not in self._state_groups):
                    for r in self._regions:  # a skipped head: no stale bytes in objects
                        r.zero_()
                try:
                    with device_access() as allowed:
                        copied = allowed and self._run_worker((chunk, CPULoadStoreSpec(range(len(chunk_keys)))))
                    allowed = allowed and still_allowed()
                    if not (copied and allowed):
                        HostTier.publish(host, everything())
                        result.done += [False] * len(chunk_keys)
                        result.reasons.append("device -> staging copy failed" if allowed else "abandoned (deadline)")
                        continue
                    names = self._host_names(chunk_keys, host)
                    seal_all([partial(seal_into, tkey, name, self._views(i, o), view)
                              for name, (i, o, view) in zip(names, host.targets)],
                             sum(v.nbytes for *_, v in host.targets))
                except BaseException:
                    HostTier.publish(host, everything())
                    raise
                HostTier.publish(host)
                self.stats["host_objects_put"] += len(host.targets)
                result.done += [c is not None for c in host.claims]
                sealed += [(base + i, chunk_keys[i], o, host.claims[i].slot, host.claims[i].gen)
                           for i, o, _ in host.targets]
        finally:
            device_done()
        if self.client is not None and remote and sealed:
            self._put_from_host(sealed, skip_present, result)
        else:
            result.sealed = sealed
        result.seconds = time.perf_counter() - t0
        return result

    def _host_names(self, chunk_keys: Sequence[OffloadKey], host: HostWrite) -> list[str]:
        """Store names of `host.targets`, one block name per block (a MAC each)."""
        per_block = {i: dict(zip(objs, self.layout.keys(chunk_keys[i], objs))) for i, objs in enumerate(host.objects)
                     if objs}
        return [per_block[i][o] for i, o, _ in host.targets]

    def put_sealed(self, sealed: Sequence[HostEntry], skip_present: bool = True) -> TierResult:
        """Put into the store what a store with `remote=False` sealed into the host tier
        (`TierResult.sealed`), from the host tier: with its own tier and thread, so that a hung
        master holds only the puts, never the next store's device copies (issue 42.3)."""
        if self.client is None or self.host is None:
            return TierResult([], reasons=["no store client or no host tier"])
        t0 = time.perf_counter()
        result = TierResult([])
        failed = self.stats["put_failures"]
        self._put_from_host(list(sealed), skip_present, result)
        result.done = [self.stats["put_failures"] == failed]  # one entry: every put of the call went in
        result.seconds = time.perf_counter() - t0
        return result

    def on_host(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether the host tier holds every object this rank reads of every block of `keys` now
        (a load of them needs no store: the worker runs it where a hung master cannot hold it)."""
        if self.host is None:
            return False
        groups: dict[int, list[OffloadKey]] = {}
        for key in keys:
            groups.setdefault(self.layout.group_of(key), []).append(key)
        return all(hit is not None for g, ks in groups.items() for hit in self.host.find(ks, [self.reads[g]] * len(ks)))

    def _put_from_host(self, sealed: list[HostEntry], skip_present: bool, result: TierResult) -> None:
        """Put objects this call sealed into the host tier into the store too, copied from the host
        tier through the wire buffer a buffer's worth at a time; one the host tier evicted
        meanwhile is not put (its slot no longer holds it)."""
        assert self.client is not None and self.host is not None
        names = [self.layout.keys(key, [o])[0] for _, key, o, _, _ in sealed]
        if skip_present:
            listed = {n for n, e in zip(names, self.client.exists(names)) if e is True}
            stale = [n for n in self.client.take_unreadable(names) if n in listed]  # a dead writer's: replaced
            if stale:
                self.stats["removed"] += sum(c == 0 for c in self.client.remove(stale))
            listed -= set(stale)
            keep = [i for i, n in enumerate(names) if n not in listed]
            sealed, names = [sealed[i] for i in keep], [names[i] for i in keep]
        capacity = self._wire.numel()
        at = 0
        while at < len(sealed):
            batch, used, spans = [], 0, []
            while at < len(sealed):
                _, key, o, slot, gen = sealed[at]
                view = self.host.views(key, slot, [o])[0]
                if used + view.nbytes > capacity and batch:
                    break
                self._wire_np[used:used + view.nbytes] = view
                if self.host.arena(key).still(slot, gen):
                    batch.append(at)
                    spans.append((used, view.nbytes))
                    used += view.nbytes
                at += 1
            codes = self.client.put([names[i] for i in batch], self._wire_runs(spans)) if batch else []
            failed = sum(c != 0 for c in codes)
            self.stats["put_failures"] += failed
            if failed:
                result.reasons.append(f"{failed} puts failed (Mooncake codes {sorted({c for c in codes if c != 0})[:4]}); "
                                      f"the host tier holds them")
            ok = [i for i, c in zip(batch, codes) if c == 0]
            nbytes = sum(self.layout.nbytes(sealed[i][2]) for i in ok)
            result.objects += len(ok)
            result.bytes += nbytes
            self.stats["objects_put"] += len(ok)
            self.stats["bytes_put"] += nbytes

    def _seal_chunk(self, tkey: bytes, chunk_keys: Sequence[OffloadKey], wanted: list[list[ObjectId]]
                    ) -> tuple[list[str], list[int], list[tuple[int, int]]]:
        """Seal the objects `wanted` of a chunk from staging into the wire buffer, back to back;
        returns their names, their blocks and their wire spans."""
        names, owner, entries = [], [], []
        for slot, key in enumerate(chunk_keys):
            for obj, name in zip(wanted[slot], self.layout.keys(key, wanted[slot])):
                names.append(name)
                entries.append((slot, obj))
                owner.append(slot)
        spans = self._place(entries)
        seal_all([partial(seal_into, tkey, name, self._views(slot, obj), self._wire_np[off:off + n])
                  for name, (slot, obj), (off, n) in zip(names, entries, spans)], sum(n for _, n in spans))
        return names, owner, spans

    # -- load ----------------------------------------------------------------------------------------------
    def load(self, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec, device_access: DeviceAccess = _always,
             tenant: bytes = b"", remote: bool = True) -> TierResult:
        """Fetch, check and copy into the device; `done[i]`: key i's bytes are on the device.

        Blocks the host tier holds are opened straight out of it; the rest come from the store,
        and what came is put into the host tier for the host's next reader. An object that exists
        but is not what its name promises (another size, a seal that does not check) is removed,
        so that the next writer stores it again: garbage put by anyone costs one recompute, never
        a blocked prefix. `device_access` gates the copy into the device (see `pool.background`);
        `tenant` as for `store`; `remote=False`: the host tier only (the store is away)."""
        t0 = time.perf_counter()
        tkey = tenant_key(self.config.secret, tenant)
        result = TierResult([])
        for chunk, chunk_keys in job_chunks(gpu, keys, self.layout, self.factor, self.config.staging_blocks):
            reads = [self.reads[self.layout.group_of(key)] for key in chunk_keys]
            why, missing = self._open_from_host(tkey, chunk_keys, reads)
            if missing and (self.client is None or not remote):
                why = f"{len(missing)} of {len(chunk_keys)} blocks not in the host tier (no store behind it now)"
            elif missing:
                why = self._load_remote(tkey, chunk_keys, reads, missing)
            if not why:
                with device_access() as allowed:
                    if not allowed:
                        why = "abandoned (deadline)"
                    elif not self._run_worker((CPULoadStoreSpec(range(len(chunk_keys))), chunk)):
                        why = "staging -> device copy failed"
            if why:
                result.done += [False] * len(chunk_keys)
                result.reasons.append(why)
                continue
            nbytes = sum(self.layout.nbytes(o) for objs in reads for o in objs)  # payload only
            result.done += [True] * len(chunk_keys)
            result.objects += sum(len(objs) for objs in reads)
            result.bytes += nbytes
            self.stats["bytes_got"] += nbytes
        result.seconds = time.perf_counter() - t0
        return result

    def _open_from_host(self, tkey: bytes, chunk_keys: Sequence[OffloadKey], reads: list[list[ObjectId]]
                        ) -> tuple[str, list[int]]:
        """Open into staging every block of the chunk the host tier holds whole; returns ('', the
        slots left for the store). An object that fails its tag is forgotten by the host tier and
        its block left for the store."""
        if self.host is None:
            return "", list(range(len(chunk_keys)))
        found = self.host.find(chunk_keys, reads)
        work, items, nbytes = [], [], 0
        for slot, (key, hit) in enumerate(zip(chunk_keys, found)):
            if hit is None:
                continue
            _, aslot, _ = hit
            names = self.layout.keys(key, reads[slot])
            for obj, name, view in zip(reads[slot], names, self.host.views(key, aslot, reads[slot])):
                work.append(partial(open_into, tkey, name, view, self._views(slot, obj)))
                items.append((slot, obj))
                nbytes += view.nbytes
        verdicts = seal_all(work, nbytes)
        failed: dict[int, list[ObjectId]] = {}
        for (slot, obj), bad in zip(items, verdicts):
            if bad:
                failed.setdefault(slot, []).append(obj)
        for slot, objs in failed.items():
            _, aslot, gen = found[slot]
            self.host.forget(chunk_keys[slot], aslot, gen, objs)
            self.stats["seal_failures"] += len(objs)
        self.stats["host_objects_got"] += len(items) - sum(len(v) for v in failed.values())
        return "", [slot for slot, hit in enumerate(found) if hit is None or slot in failed]

    def _load_remote(self, tkey: bytes, chunk_keys: Sequence[OffloadKey], reads: list[list[ObjectId]],
                     slots: list[int]) -> str:
        """Get the blocks `slots` of the chunk from the store into staging; '' or why not. What
        opened is put into the host tier (its sealed bytes, as got)."""
        assert self.client is not None
        names, entries, writes = [], [], []
        for slot in slots:
            key = chunk_keys[slot]
            mine = self._writes_set[self.layout.group_of(key)]
            for obj, name in zip(reads[slot], self.layout.keys(key, reads[slot])):
                writes.append(obj in mine)
                names.append(name)
                entries.append((slot, obj))
        spans = self._place(entries)
        runs, want = self._wire_runs(spans), [n for _, n in spans]
        codes = self.client.get(names, runs) if names else []
        why = ""
        readable, unreadable, bad_objects = [], [], []
        for i, (name, code) in enumerate(zip(names, codes)):
            if code != want[i]:
                unreadable.append(i)
                why = why or f"object {name} unreadable (Mooncake code {code}, expected {want[i]} bytes)"
            else:
                readable.append(i)
        if unreadable:  # missing, unreachable, or there with another size: only the last is garbage
            sizes = self.client.sizes([names[i] for i in unreadable])
            wrong = [names[i] for i, n in zip(unreadable, sizes) if n is not None and n != want[i]]
            # Listed at their size, yet unreadable: this rank's next store of those it writes replaces them.
            self.client.note_unreadable([names[i] for i, n in zip(unreadable, sizes)
                                         if n == want[i] and writes[i] and codes[i] not in RPC_CODES])
            self.stats["missing"] += len(unreadable) - len(wrong)
            bad_objects += wrong
        self.client.take_unreadable([names[i] for i in readable])  # readable again: no note of them stays
        verdicts = seal_all([partial(open_into, tkey, names[i], self._wire_np[spans[i][0]:spans[i][0] + spans[i][1]],
                                     self._views(*entries[i])) for i in readable],
                            sum(spans[i][1] for i in readable))
        opened = set()
        for i, bad in zip(readable, verdicts):
            if bad:
                self.stats["seal_failures"] += 1
                bad_objects.append(names[i])
                why = why or f"object {names[i]} refused: {bad}"
            else:
                opened.add(i)
        if bad_objects:
            self.stats["removed"] += sum(c == 0 for c in self.client.remove(bad_objects))
        self.stats["objects_got"] += len(readable)
        if self.host is not None and opened:
            self._keep_on_host(chunk_keys, entries, spans, opened)
        return why

    def _keep_on_host(self, chunk_keys: Sequence[OffloadKey], entries: list[tuple[int, ObjectId]],
                      spans: list[tuple[int, int]], opened: set[int]) -> None:
        """Put objects got from the store (sealed, in the wire buffer) into the host tier."""
        assert self.host is not None
        at = {entries[i]: spans[i] for i in opened}
        slots = sorted({entries[i][0] for i in opened})
        host = self.host.claim([chunk_keys[s] for s in slots],
                               [[o for (s2, o) in at if s2 == s] for s in slots])
        for j, obj, view in host.targets:
            off, n = at[(slots[j], obj)]
            view[:] = self._wire_np[off:off + n]
        HostTier.publish(host)

    def close(self) -> None:
        """Stop the worker, unregister the wire buffer (the client may serve other tiers) and unmap
        the host tier (its arenas stay for the host's other engines)."""
        self.worker.shutdown()
        self._unregister()
        self._view_cache.clear()
        if self.host is not None:
            self.host.close()


def _unregister(client: StoreClient | None, spans: list[tuple[int, int]]) -> None:
    for address, nbytes in spans:
        client.unregister(address, nbytes)


__all__ = ["DeviceAccess", "PoolConfig", "PoolIndex", "PoolTier", "TierResult", "job_chunks", "object_layout"]

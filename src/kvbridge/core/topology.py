"""TransferTopology: the one place that answers "which rank talks to which, and how".

Built once per local rank, it holds the local engine and every remote engine registered at
handshake (`EngineTransferInfo`, frozen). Incompatible peers are refused at registration with
an error naming both values, never at request time. Its predicates keep vLLM's meanings so that
code written against vLLM's `TransferTopology` reads the same:

* `tp_ratio` > 0 when local TP >= remote TP (several local ranks share one remote rank),
  < 0 when the remote is larger (each local rank gathers from |ratio| remote ranks);
  defined for divisible pairs only, as in vLLM (kvbridge still plans the others).
* `is_kv_replicated`: remote TP > KV heads. Equality is sharding, not replication.
* `handshake_target_ranks`: remote ranks whose share overlaps the local rank's.
* `source_ranks`: remote ranks actually read when the remote is the source: one per distinct
  head (GQA dedup), one for MLA.
All of it derives from `shard`, which the planner uses too.
"""

from __future__ import annotations

import msgspec

from typing import Literal

from kvbridge.core.blocks import check_prefix_caching
from kvbridge.errors import IncompatibleEngines, KVBridgeError, ShardingError
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Plan, Request, plan_request
from kvbridge.core.shard import HeadSlice, assign_sources, head_range, overlapping_ranks
from kvbridge.core.spec import ModelSpec


class EngineTransferInfo(msgspec.Struct, frozen=True):
    """What kvbridge knows of one engine: its id, cache layout and model geometry."""

    engine_id: str
    layout: EngineLayout
    spec: ModelSpec

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.layout.kernel_blocks_per_block


class TransferTopology:
    """Topology of one local rank against any number of remote engines."""

    def __init__(self, engine_id: str, spec: ModelSpec, layout: EngineLayout, tp_rank: int = 0, *,
                 prefix_caching: bool = False, block_ids: Literal["logical", "kernel"] = "logical"):
        """`block_ids="kernel"` declares that peers exchange vLLM's kernel-granular id lists; with
        a hybrid model, prefix caching and different kernel ratios that is refused at registration."""
        layout.check_model(spec, f"local engine {engine_id!r}")
        if not 0 <= tp_rank < layout.tp_size:
            raise ShardingError(f"local TP rank {tp_rank} outside TP size {layout.tp_size}")
        self.engine_id, self.spec, self.tp_rank = engine_id, spec, tp_rank
        self.prefix_caching, self.block_ids = prefix_caching, block_ids
        self.local = EngineTransferInfo(engine_id, layout, spec)
        self._remotes: dict[str, EngineTransferInfo] = {}

    # -- registration -------------------------------------------------------------------------
    def register_remote_engine(self, engine_id: str, layout: EngineLayout,
                               spec: ModelSpec | None = None) -> EngineTransferInfo:
        """Validate and store a remote engine; idempotent for an identical re-registration."""
        if engine_id == self.engine_id:
            raise KVBridgeError(f"cannot register the local engine {engine_id!r} as a remote engine")
        spec = spec or self.spec
        info = EngineTransferInfo(engine_id, layout, spec)
        known = self._remotes.get(engine_id)
        if known is not None:
            if known.spec != spec:
                known.spec.check_compatible(spec, f"registered {engine_id!r}", f"re-registered {engine_id!r}")
            if known != info:
                raise IncompatibleEngines(
                    f"engine {engine_id!r} is already registered as {known.layout.describe()}; "
                    f"it now reports {layout.describe()} (a restarted peer needs a new engine id)")
            return known
        self.spec.check_compatible(spec, "local", f"remote {engine_id!r}")
        layout.check_model(spec, f"remote engine {engine_id!r}")
        if self.block_ids == "kernel":
            check_prefix_caching(self.local.kernel_blocks_per_block, info.kernel_blocks_per_block,
                                 spec.has_recurrent, self.prefix_caching)
        self._remotes[engine_id] = info
        return info

    def get_engine_info(self, engine_id: str) -> EngineTransferInfo:
        if engine_id == self.engine_id:
            return self.local
        try:
            return self._remotes[engine_id]
        except KeyError:
            known = ", ".join(sorted(self._remotes)) or "none"
            raise KVBridgeError(f"unknown engine {engine_id!r} (registered: {known})") from None

    @property
    def remote_engine_ids(self) -> tuple[str, ...]:
        return tuple(self._remotes)

    # -- vLLM-compatible predicates -----------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.local.tp_size

    @property
    def total_num_kv_heads(self) -> int:
        return self.spec.total_kv_heads

    @property
    def is_mla(self) -> bool:
        return self.spec.is_mla

    def tp_ratio(self, engine_id: str) -> int:
        """Local TP / remote TP when local >= remote, else -(remote / local)."""
        local, remote = self.tp_size, self.get_engine_info(engine_id).tp_size
        if local >= remote:
            if local % remote:
                raise ShardingError(
                    f"Local tensor parallel size {local} is not divisible by remote tensor parallel size "
                    f"{remote}; tp_ratio is defined for divisible pairs only (kvbridge still plans this pair)")
            return local // remote
        if remote % local:
            raise ShardingError(
                f"Remote tensor parallel size {remote} is not divisible by local tensor parallel size "
                f"{local}; tp_ratio is defined for divisible pairs only (kvbridge still plans this pair)")
        return -(remote // local)

    def is_kv_replicated(self, engine_id: str) -> bool:
        """Remote TP exceeds the KV head count (equality is NOT replication)."""
        return self.get_engine_info(engine_id).tp_size > self.total_num_kv_heads

    def replicates_kv_cache(self, engine_id: str) -> bool:
        return self.is_mla or self.is_kv_replicated(engine_id)

    @property
    def local_replicates_kv_cache(self) -> bool:
        return self.is_mla or self.tp_size > self.total_num_kv_heads

    def handshake_target_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Remote ranks this rank handshakes with (and notifies)."""
        return overlapping_ranks(self.tp_size, self.tp_rank, self.get_engine_info(engine_id).tp_size)

    # -- what is read -------------------------------------------------------------------------
    def head_slices(self, engine_id: str, layer: int | None = None) -> tuple[HeadSlice, ...]:
        """Heads of an attention layer (default: the first) read from each remote rank."""
        if layer is None:
            layer = next((i for i, x in enumerate(self.spec.layers) if not x.is_recurrent), 0)
        return self.component_slices(engine_id, layer, 0)

    def component_slices(self, engine_id: str, layer: int, comp: int) -> tuple[HeadSlice, ...]:
        """Units of one component (a head, a Mamba group ...) read from each remote rank."""
        spec_layer = self.spec.layers[layer]
        c = spec_layer.components[comp]
        return assign_sources(c.heads, self.get_engine_info(engine_id).tp_size, self.tp_size, self.tp_rank,
                              spec_layer.replicated)

    def _ranks(self, engine_id: str, recurrent: bool | None) -> tuple[int, ...]:
        ranks = {s.src_rank for li, layer in enumerate(self.spec.layers)
                 if recurrent is None or layer.is_recurrent == recurrent
                 for ci in range(len(layer.components)) for s in self.component_slices(engine_id, li, ci)}
        return tuple(sorted(ranks))

    def source_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Remote ranks actually read when the remote engine is the source of a transfer."""
        return self._ranks(engine_id, None)

    def attention_source_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Remote ranks read for attention: one per distinct head (GQA dedup), one for MLA."""
        return self._ranks(engine_id, False)

    def recurrent_source_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Remote ranks read for recurrent state: every rank whose state slice overlaps ours."""
        return self._ranks(engine_id, True)

    def reader_ranks(self, engine_id: str) -> tuple[int, ...]:
        """Remote ranks that read from this rank when the local engine is the source (push targets)."""
        remote = self.get_engine_info(engine_id)
        return tuple(d for d in range(remote.tp_size) if any(
            s.src_rank == self.tp_rank for layer in self.spec.layers for c in layer.components
            for s in assign_sources(c.heads, self.tp_size, remote.tp_size, d, layer.replicated)))

    def local_head_range(self, layer: int = 0) -> tuple[int, int]:
        spec_layer = self.spec.layers[layer]
        return head_range(spec_layer.components[0].heads, self.tp_size, self.tp_rank, spec_layer.replicated)

    # -- planning -----------------------------------------------------------------------------
    def plan_pull(self, engine_id: str, request: Request) -> Plan:
        """Runs this rank reads from the remote (source) engine."""
        remote = self.get_engine_info(engine_id)
        return plan_request(self.spec, remote.layout, self.local.layout, request, dst_ranks=[self.tp_rank])

    def plan_push(self, engine_id: str, request: Request) -> Plan:
        """Runs this rank writes into the remote (destination) engine."""
        remote = self.get_engine_info(engine_id)
        plan = plan_request(self.spec, self.local.layout, remote.layout, request,
                            dst_ranks=self.reader_ranks(engine_id))
        return plan.select(plan.src_rank == self.tp_rank)

    def describe(self) -> str:
        lines = [f"local {self.engine_id!r} rank {self.tp_rank}: {self.local.layout.describe()}; "
                 f"{self.spec.describe()}"]
        for eid, info in self._remotes.items():
            try:
                ratio: int | str = self.tp_ratio(eid)
            except ShardingError:
                ratio = "n/a (non-divisible)"
            slices = ", ".join(f"rank {s.src_rank} heads [{s.start},{s.stop})" for s in self.head_slices(eid))
            state = (f"; recurrent state from {list(self.recurrent_source_ranks(eid))}"
                     if self.spec.has_recurrent else "")
            lines.append(
                f"remote {eid!r}: {info.layout.describe()}; tp_ratio {ratio}; replicated "
                f"{self.is_kv_replicated(eid)}; handshake {list(self.handshake_target_ranks(eid))}; "
                f"reads {slices}{state}")
        return "\n".join(lines)

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

Pipeline and context parallel. Ranks are flat (`EngineLayout.rank_coords`: TP fastest, then PCP,
then PP; equal to the TP rank when PP = PCP = 1). A remote engine is registered once and keeps
one `StageInfo` per PP stage (vLLM keys remote engines by engine id and PP rank, with the stage's
layer window). `read_sources` says which remote (tp, pp, cp) ranks this rank reads and which
layers; `handshake_target_ranks` widens vLLM's TP group to every remote stage whose layers
overlap ours and every remote PCP rank, plus any rank read or reading (DCP spreads a head's
tokens over its replicas). The TP-level predicates (`tp_ratio`, `is_kv_replicated`,
`component_slices`) keep vLLM's meanings in TP coordinates.
"""

from __future__ import annotations

import msgspec

from math import lcm
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from kvbridge.core.blocks import check_prefix_caching
from kvbridge.errors import IncompatibleEngines, InvalidRequest, KVBridgeError, ShardingError
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Plan, Request, pair_conversions, plan_request, source_slices
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

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def stages(self) -> tuple[StageInfo, ...]:
        """One entry per PP stage: its layer window and flat ranks."""
        lay, n = self.layout, self.spec.num_layers
        return tuple(StageInfo(self.engine_id, p, *lay.stage_layers(n, p),
                               tuple(lay.flat_rank(t, p, c) for c in range(lay.pcp_size) for t in range(lay.tp_size)))
                     for p in range(lay.pp_size))


class StageInfo(NamedTuple):
    """One PP stage of an engine: vLLM's remote engine entry (engine id, PP rank, layer window)."""

    engine_id: str
    pp_rank: int
    start_layer: int
    end_layer: int
    ranks: tuple[int, ...]


class RemoteRead(NamedTuple):
    """A remote rank a local rank reads from (or that reads from it), and the layers involved."""

    rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    layers: tuple[int, ...]


def cp_pairs(src: EngineLayout, dst: EngineLayout) -> frozenset[tuple[int, int]]:
    """(source CP rank, destination CP rank) pairs that share some token (a token's owner
    repeats every `interleave * cp_size` tokens on each side)."""
    period = lcm(src.cp_interleave * src.cp_size, dst.cp_interleave * dst.cp_size)
    t = np.arange(period)
    return frozenset(zip(((t // src.cp_interleave) % src.cp_size).tolist(),
                         ((t // dst.cp_interleave) % dst.cp_size).tolist()))


def reads(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int) -> dict[int, set[int]]:
    """Source rank -> layers that destination rank `d` reads from it (any request)."""
    cp = dst.rank_coords(d).cp
    pairs = cp_pairs(src, dst)
    out: dict[int, set[int]] = {}
    for c in range(src.cp_size):
        for sl in source_slices(spec, src, dst, d, c):
            recurrent = spec.layers[sl.layer].is_recurrent
            if (c == cp % src.cp_size) if recurrent else (c, cp) in pairs:
                out.setdefault(sl.src_rank, set()).add(sl.layer)
    return out


class TransferTopology:
    """Topology of one local rank against any number of remote engines."""

    def __init__(self, engine_id: str, spec: ModelSpec, layout: EngineLayout, tp_rank: int = 0, *,
                 prefix_caching: bool = False, block_ids: Literal["logical", "kernel"] = "logical",
                 converts: bool = False):
        """`tp_rank` is the local rank, flat (the TP rank when PP = PCP = 1, see `EngineLayout`).

        `converts`: the executor converts KV dtypes on its copy path (the local executor does); a
        byte-moving transport leaves it False, and a peer whose KV dtype or scales differ is then
        refused at registration instead of receiving reinterpreted bytes.

        `block_ids="kernel"` declares that peers exchange vLLM's kernel-granular id lists; with
        a hybrid model, prefix caching and different kernel ratios that is refused at registration."""
        layout.check_model(spec, f"local engine {engine_id!r}")
        if not 0 <= tp_rank < layout.world_size:
            raise ShardingError(f"local TP rank {tp_rank} outside {layout.describe_ranks()}")
        self.engine_id, self.spec, self.rank = engine_id, spec, tp_rank
        self.coords = layout.rank_coords(tp_rank)
        self.tp_rank, self.pp_rank = self.coords.tp, self.coords.pp
        self.layers = layout.stage_layers(spec.num_layers, self.pp_rank)
        self.prefix_caching, self.block_ids, self.converts = prefix_caching, block_ids, converts
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
        if not self.converts and pair_conversions(self.spec, layout, self.local.layout):
            raise IncompatibleEngines(
                f"KV dtype or scales differ: local {self.local.layout.kv_dtype or self.spec.dtype}, remote "
                f"{engine_id!r} {layout.kv_dtype or spec.dtype} (or their k/v scales); this transport moves bytes "
                f"only: convert with the local executor (converts=True) or run both sides in one KV dtype")
        if self.block_ids == "kernel":
            check_prefix_caching(self.local.kernel_blocks_per_block, info.kernel_blocks_per_block,
                                 spec.has_recurrent, self.prefix_caching)
        self._remotes[engine_id] = info
        return info

    def unregister_remote_engine(self, engine_id: str) -> bool:
        """Forget a remote engine (it left, or its TTL ran out); False when it was not registered."""
        return self._remotes.pop(engine_id, None) is not None

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

    def remote_stages(self, engine_id: str) -> tuple[StageInfo, ...]:
        """The remote engine's PP stages (vLLM's per-(engine, pp_rank) entries)."""
        return self.get_engine_info(engine_id).stages()

    def get_stage(self, engine_id: str, pp_rank: int) -> StageInfo:
        stages = self.remote_stages(engine_id)
        if not 0 <= pp_rank < len(stages):
            raise KVBridgeError(f"engine {engine_id!r} has {len(stages)} PP stages, not a stage {pp_rank}")
        return stages[pp_rank]

    def overlapping_stages(self, engine_id: str) -> tuple[StageInfo, ...]:
        """Remote stages holding some layer of this rank's stage."""
        lo, hi = self.layers
        return tuple(s for s in self.remote_stages(engine_id) if s.start_layer < hi and lo < s.end_layer)

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
        """Remote ranks this rank handshakes with (and notifies): vLLM's TP group, in every remote
        stage overlapping our layers and every remote PCP rank, plus every rank read or reading."""
        remote = self.get_engine_info(engine_id).layout
        ranks = {remote.flat_rank(q, s.pp_rank, c) for q in overlapping_ranks(self.tp_size, self.tp_rank, remote.tp_size)
                 for s in self.overlapping_stages(engine_id) for c in range(remote.pcp_size)}
        if remote.world_size == remote.tp_size and self.local.layout.world_size == self.tp_size and \
                remote.dcp_size == self.local.layout.dcp_size == 1:
            return tuple(sorted(ranks))  # TP only: vLLM's set, which contains every read
        return tuple(sorted(ranks | set(self.source_ranks(engine_id)) | set(self.reader_ranks(engine_id))))

    def read_sources(self, engine_id: str) -> tuple[RemoteRead, ...]:
        """Remote ranks this rank reads when the remote engine is the source, with the layers."""
        remote = self.get_engine_info(engine_id).layout
        return tuple(RemoteRead(q, *(lambda c: (c.tp, c.pp, c.cp))(remote.rank_coords(q)), tuple(sorted(layers)))
                     for q, layers in sorted(reads(self.spec, remote, self.local.layout, self.rank).items()))

    # -- what is read -------------------------------------------------------------------------
    def head_slices(self, engine_id: str, layer: int | None = None) -> tuple[HeadSlice, ...]:
        """Heads of an attention layer (default: the first) read from each remote rank."""
        if layer is None:
            layer = next((i for i, x in enumerate(self.spec.layers) if x.is_attention),
                         next(i for i, x in enumerate(self.spec.layers) if x.components))
        return self.component_slices(engine_id, layer, 0)

    def component_slices(self, engine_id: str, layer: int, comp: int) -> tuple[HeadSlice, ...]:
        """Units of one component (a head, a Mamba group ...) read from each remote rank."""
        spec_layer = self.spec.layers[layer]
        c = spec_layer.components[comp]
        return assign_sources(c.heads, self.get_engine_info(engine_id).tp_size, self.tp_size, self.tp_rank,
                              spec_layer.replicated)

    def _ranks(self, engine_id: str, recurrent: bool | None) -> tuple[int, ...]:
        return tuple(r.rank for r in self.read_sources(engine_id)
                     if recurrent is None or any(self.spec.layers[li].is_recurrent == recurrent for li in r.layers))

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
        remote = self.get_engine_info(engine_id).layout
        return tuple(d for d in range(remote.world_size)
                     if self.rank in reads(self.spec, self.local.layout, remote, d))

    def local_head_range(self, layer: int = 0) -> tuple[int, int]:
        spec_layer = self.spec.layers[layer]
        if not spec_layer.components:
            raise InvalidRequest(f"layer {layer} is stateless: it holds no heads")
        return head_range(spec_layer.components[0].heads, self.tp_size, self.tp_rank, spec_layer.replicated)

    # -- planning -----------------------------------------------------------------------------
    def plan_pull(self, engine_id: str, request: Request) -> Plan:
        """Runs this rank reads from the remote (source) engine."""
        remote = self.get_engine_info(engine_id)
        return plan_request(self.spec, remote.layout, self.local.layout, request, dst_ranks=[self.rank])

    def plan_push(self, engine_id: str, request: Request) -> Plan:
        """Runs this rank writes into the remote (destination) engine."""
        remote = self.get_engine_info(engine_id)
        plan = plan_request(self.spec, self.local.layout, remote.layout, request,
                            dst_ranks=self.reader_ranks(engine_id))
        return plan.select(plan.src_rank == self.rank)

    def describe(self) -> str:
        where = (f" (tp {self.tp_rank}, pp {self.pp_rank}, cp {self.coords.cp}; layers {self.layers[0]}-"
                 f"{self.layers[1] - 1})" if self.local.layout.world_size > self.tp_size
                 or self.local.layout.cp_size > 1 else "")
        lines = [f"local {self.engine_id!r} rank {self.rank}{where}: {self.local.layout.describe()}; "
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
            if info.layout.world_size > info.tp_size or info.layout.cp_size > 1 or self.local.layout.world_size > \
                    self.tp_size or self.local.layout.cp_size > 1:
                lines += [f"  reads rank {r.rank} (tp {r.tp_rank}, pp {r.pp_rank}, cp {r.cp_rank}) layers "
                          f"{layer_spans(r.layers)}" for r in self.read_sources(eid)]
        return "\n".join(lines)


def layer_spans(layers: Sequence[int]) -> str:
    """'0-3, 6' for (0, 1, 2, 3, 6)."""
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)

"""transformers caches <-> the paged rank caches of an engine (TP x PP x CP).

A plan is only right if a model that decodes from the moved cache produces exactly what it
would have produced without the move. This is the bridge that experiment needs: `export_cache`
writes a batch-1 prefill `DynamicCache` into the prefill engine's paged rank caches (each rank
its head shard of the layers of its PP stage and the token positions of its CP rank, through the
layout's addressing, as a serving engine's attention kernel would), `import_cache` rebuilds a
`DynamicCache` from the decode engine's ranks (each head and position from the first rank that
holds it), `replica_mismatches` compares the replicas bit for bit (`cache_compare` the caches).
Block-id lists may be clipped to a sliding window, as vLLM sends them. A sliding MLA layer (dots3) is a
`DynamicSlidingWindowLayer` holding the two MLA tensors for the last `window - 1` tokens.

A transformers cache layer that holds attention K/V and recurrent state together (Zamba2's
shared-attention layers, Falcon-H1: `LinearAttentionAnd...AttentionLayer`) is two layers of the
spec, the attention part then the recurrent part (`layer_map`); so is a layer with a sparse-attention
indexer key cache (`DynamicIndexedLayer`: DeepSeek-V3.2), the attention then the indexer keys
`[1, tokens, index_head_dim]`, one replicated row per token. An indexed layer without an indexer of
its own (HY-V4's "shared" layers reuse an earlier layer's selection) holds K/V only and is one.

Attention K/V go by token position; recurrent state (`hf_states` maps it to spec components)
goes to the request's recurrent slot, the last block id of the recurrent group. Export writes
every component of every prefill rank there; import takes each unit from the first decode rank
that holds it and rebuilds the transformers cache as a prefill would have left it
(`has_previous_state` set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import CacheLayerMixin, DynamicIndexedLayer, LinearAttentionCacheLayerMixin

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import full_block_ids
from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.proofs.hf_compressed import compressed_parts, is_compressed, part_rows, restore, state_tensors
from kvbridge.proofs.hf_states import hf_state_tensors, per_component_states, state_components
from kvbridge.proofs.kv_dtype import to_engine, to_model
from kvbridge.proofs.own_cache import empty_cache
from kvbridge.transport.cache import TORCH_DTYPES, RankCache

BlockIds = tuple[tuple[int, ...], ...]


def _is_linear(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _is_attention(layer: Any) -> bool:
    return isinstance(layer, CacheLayerMixin)


def _is_hybrid(layer: Any) -> bool:
    return _is_linear(layer) and _is_attention(layer)


def _is_indexed(layer: Any) -> bool:
    return isinstance(layer, DynamicIndexedLayer)


def _is_second_part(cache: DynamicCache, hf: tuple[int, ...], li: int) -> bool:
    """True for the spec layer that is the indexer part of an indexed cache layer."""
    return li > 0 and hf[li - 1] == hf[li] and _is_indexed(cache.layers[hf[li]])


def _indexer_keys(layer: Any, li: int, num_tokens: int, spec: ModelSpec) -> torch.Tensor:
    """The indexer keys as one head `[1, tokens, dim]`, after checking them against the spec."""
    keys = getattr(layer, "indexer_keys", None)
    lspec = spec.layers[li]
    if keys is None or not getattr(layer, "is_indexer_initialized", False):
        raise InvalidRequest(f"layer {li}: the indexer key cache is empty; run a prefill with use_cache=True first")
    if keys.dim() != 3 or tuple(keys.shape) != (1, num_tokens, lspec.key_dim) or lspec.value_dim:
        raise ConfigError(f"layer {li}: indexer keys {tuple(keys.shape)}, the spec's indexer layer keeps "
                          f"[1, {num_tokens}, {lspec.key_dim}] (one replicated row per token)")
    if normalize_dtype(str(keys.dtype)) != spec.dtype:
        raise ConfigError(f"layer {li}: indexer key dtype {keys.dtype}, spec dtype {spec.dtype}")
    return keys


def _is_indexer_spec(lspec: LayerSpec) -> bool:
    """An indexer key layer as the spec describes it: one replicated row per token, no values (the
    transformers view of an MLA attention layer always has its rope part as values)."""
    return lspec.kind == "mla" and not lspec.value_dim


def layer_map(cache: DynamicCache, spec: ModelSpec, what: str = "cache has") -> tuple[int, ...]:
    """The transformers cache layer of each spec layer: one each, except that a layer holding K/V
    and recurrent state together stands for two spec layers (attention, then recurrent), and so does
    an indexed layer with an indexer of its own (attention, then indexer keys). An indexed layer that
    reuses another layer's selection (HY-V4's "shared" layers) writes no indexer keys: the spec has
    its attention alone, and that is how the two are told apart. A compressed layer (DeepSeek-V4)
    stands for its window, its compressors and its open window (`hf_compressed`)."""
    out: list[int] = []
    for i, layer in enumerate(cache.layers):
        li = len(out)
        if is_compressed(layer):
            out += [i] * compressed_parts(layer)
            continue
        if _is_indexed(layer) and li < spec.num_layers and _is_indexer_spec(spec.layers[li]):
            raise ConfigError(f"layer {li} describes MLA as one latent row (the engine view); transformers keeps "
                              f"the latent and the rope part apart: build the spec with view='transformers'")
        two = _is_hybrid(layer) or (_is_indexed(layer) and li + 1 < spec.num_layers
                                    and _is_indexer_spec(spec.layers[li + 1]))
        out += [i, i] if two else [i]
    if len(out) != spec.num_layers:
        twice = (f" ({len(out)} once attention+state and indexed layers count twice)"
                 if len(out) != len(cache.layers) else "")
        raise ConfigError(f"{what} {len(cache.layers)} layers{twice}, the rank caches have {spec.num_layers}")
    for li, i in enumerate(out):
        if _is_hybrid(cache.layers[i]) and (li + 1 < len(out) and out[li + 1] == i) != spec.layers[li].is_attention:
            raise ConfigError(f"layer {li}: transformers cache layer {i} ({type(cache.layers[i]).__name__}) holds "
                              f"K/V and state; the spec needs its attention part, then its recurrent part")
        if _is_indexed(cache.layers[i]) and not spec.layers[li].is_attention:
            raise ConfigError(f"layer {li}: transformers cache layer {i} holds K/V and indexer keys; the spec says "
                              f"{spec.layers[li].kind!r}")
    return tuple(out)


def _check_no_indexer(cache: DynamicCache, hf: tuple[int, ...], li: int) -> None:
    """A cache layer the spec gives no indexer layer must hold no indexer keys."""
    layer = cache.layers[hf[li]]
    has_part = li + 1 < len(hf) and hf[li + 1] == hf[li]
    if _is_indexed(layer) and not has_part and getattr(layer, "is_indexer_initialized", False):
        raise ConfigError(f"layer {li}: transformers cache layer {hf[li]} holds indexer keys, but the spec has no "
                          f"indexer layer after it")


def _check_layer_kind(layer: Any, lspec: LayerSpec, li: int) -> None:
    """The transformers cache layer must hold what the spec says: K/V, recurrent state, both (one
    part each in the spec), or nothing (a stateless layer is transformers' `DummyLayer`)."""
    if lspec.is_stateless != (not _is_linear(layer) and not _is_attention(layer)):
        raise ConfigError(f"layer {li}: the spec says {lspec.kind!r} but transformers caches it as "
                          f"{type(layer).__name__}")
    if _is_hybrid(layer) or is_compressed(layer):  # parts of both kinds (`layer_map`)
        return
    if lspec.is_recurrent and not _is_linear(layer):
        raise ConfigError(f"layer {li}: the spec says recurrent ({lspec.recurrent_type}) but transformers caches it "
                          f"as {type(layer).__name__}")
    if not lspec.is_recurrent and _is_linear(layer):
        raise ConfigError(f"layer {li}: the spec says {lspec.kind!r} attention but transformers caches it as "
                          f"{type(layer).__name__} (recurrent state)")


def _cached_length(layer: Any) -> int:
    """Tokens the layer has seen (a sliding layer's cumulative length, not what it still holds)."""
    return int(getattr(layer, "cumulative_length", None) or layer.get_seq_length())


def _check_layer(layer: Any, spec: ModelSpec, li: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's [H, T, D] key and value tensors, after checking them against the spec."""
    lspec = spec.layers[li]
    if lspec.kind == "mla" and not lspec.value_dim:
        raise ConfigError(f"layer {li} describes MLA as one latent row (the engine view); transformers keeps the "
                          f"latent and the rope part apart: build the spec with view='transformers'")
    if lspec.kind not in ("full", "sliding", "mla"):
        raise ConfigError(f"layer {li} is a {lspec.kind!r} layer; the transformers bridge moves attention "
                          f"K/V (full, sliding, MLA latent) here")
    _check_layer_kind(layer, lspec, li)
    if bool(getattr(layer, "is_sliding", False)) != (lspec.window is not None):  # sliding K/V or sliding MLA
        raise ConfigError(f"layer {li}: transformers cache layer {type(layer).__name__} "
                          f"(is_sliding={getattr(layer, 'is_sliding', False)}) but the spec says {lspec.kind!r} "
                          f"with window {lspec.window}")
    if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", True):
        raise InvalidRequest(f"layer {li} of the cache is empty; run a prefill with use_cache=True first")
    keys, values = layer.keys, layer.values
    if keys.dim() != 4 or keys.shape[0] != 1:
        raise InvalidRequest(f"layer {li}: expected keys [1, heads, tokens, dim] (batch 1), got {tuple(keys.shape)}")
    want_k = (lspec.num_kv_heads, lspec.key_dim)
    want_v = (lspec.num_kv_heads, lspec.value_dim)
    if (keys.shape[1], keys.shape[3]) != want_k or (values.shape[1], values.shape[3]) != want_v:
        raise ConfigError(f"layer {li}: cache keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match "
                          f"the spec's {lspec.num_kv_heads} heads of dim {lspec.key_dim}/{lspec.value_dim}")
    if keys.dtype != values.dtype or normalize_dtype(str(keys.dtype)) != spec.dtype:
        raise ConfigError(f"layer {li}: cache dtype {keys.dtype}/{values.dtype}, spec dtype {spec.dtype}")
    seen = _cached_length(layer)
    if seen != num_tokens:
        raise InvalidRequest(f"layer {li} has seen {seen} tokens, the request says {num_tokens}")
    held = keys.shape[2]
    first = lspec.tokens_kept(num_tokens)
    if held != num_tokens - first or values.shape[2] != held:
        raise ConfigError(
            f"layer {li} ({lspec.kind}, window {lspec.window}, sliding_window "
            f"{getattr(layer, 'sliding_window', None)} in transformers) holds {held} of {num_tokens} tokens, "
            f"kvbridge keeps {num_tokens - first} (positions from {first})")
    return keys[0], values[0]



def _check_caches(caches: Sequence[RankCache], spec: ModelSpec, block_ids: BlockIds) -> None:
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    for rc in caches:
        if rc.spec.fingerprint() != rc.layout.engine_spec(spec).fingerprint():
            raise ConfigError(f"rank {rc.rank} cache was allocated for another geometry ({rc.spec.describe()})")


def _holds(rc: RankCache, li: int) -> bool:
    """Whether the rank holds layer `li` (its PP stage) with at least one head or unit."""
    return int(rc.addr.region[li, 0]) >= 0 and int(rc.addr.heads[li].max()) > 0


def _owned(rc: RankCache, spec: ModelSpec, li: int, positions: np.ndarray) -> np.ndarray:
    """Mask of the positions whose K/V the rank's CP rank holds."""
    if rc.layout.cp_size == 1:
        return np.ones(len(positions), dtype=bool)
    cp = rc.layout.rank_coords(rc.rank).cp
    return rc.layout.row_layout(spec).token_owner(positions, spec.layer_group[li]) == cp  # positions may be rows


def _ids(rc: RankCache, spec: ModelSpec, block_ids: BlockIds, li: int, num_tokens: int) -> np.ndarray:
    """The layer's group's block ids over all positions (a clipped window list padded in front)."""
    g = spec.layer_group[li]
    return full_block_ids(rc.layout, g, block_ids[g], num_tokens)


def _state_slot(spec: ModelSpec, layout: EngineLayout, block_ids: BlockIds, li: int) -> int:
    """A request's recurrent slot: the last block id of the layer's group (vLLM puts placeholders before it)."""
    ids = block_ids[spec.layer_group[li]]
    if not ids:
        raise InvalidRequest(f"layer {li}: the recurrent group has no block ids")
    if not 0 <= ids[-1] < layout.num_blocks:
        raise InvalidRequest(f"layer {li}: state block id {ids[-1]} outside [0, {layout.num_blocks})")
    return int(ids[-1])


def export_tokens(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache], block_ids: BlockIds,
                  num_tokens: int, start: int = 0, stop: int | None = None) -> None:
    """Write the attention K/V of positions `[start, stop)` (default all) of a batch-1 prefill cache
    of `num_tokens` tokens into paged rank caches; positions before a sliding window are skipped.

    Each rank gets its own head shard of every attention layer, through the layout's addressing,
    the way a serving engine's attention kernel would have written them.
    """
    hf = layer_map(cache, spec)
    _check_caches(caches, spec, block_ids)
    stop = num_tokens if stop is None else stop
    if not 0 <= start <= stop <= num_tokens:
        raise InvalidRequest(f"need 0 <= start <= stop <= {num_tokens}, got {start} and {stop}")
    for li in range(spec.num_layers):
        if not spec.layers[li].is_attention:
            _check_layer_kind(cache.layers[hf[li]], spec.layers[li], li)
            continue
        lspec = spec.layers[li]
        if is_compressed(cache.layers[hf[li]]):
            kv: tuple[torch.Tensor, ...] = (part_rows(cache.layers[hf[li]], li - hf.index(hf[li]), lspec, li,
                                                      num_tokens),)
        elif _is_second_part(cache, hf, li):
            kv = (_indexer_keys(cache.layers[hf[li]], li, num_tokens, spec),)
        else:
            kv = _check_layer(cache.layers[hf[li]], spec, li, num_tokens)
            _check_no_indexer(cache, hf, li)
        # positions are rows: one per token, or one per complete window of a compressed layer
        first = lspec.tokens_kept(lspec.rows(num_tokens))
        lo, hi = max(first, lspec.rows(start)), lspec.rows(stop)
        if lo >= hi:
            continue
        for rc in caches:
            if not _holds(rc, li):
                continue
            positions = np.arange(lo, hi, dtype=np.int64)
            mine = _owned(rc, spec, li, positions)
            positions, index = positions[mine], torch.from_numpy(positions[mine] - first)
            if not len(positions):
                continue
            ids = _ids(rc, spec, block_ids, li, num_tokens)
            for ci, tensor in enumerate(kv):
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                rows = to_engine(tensor[h0:h0 + nh, index].transpose(0, 1), rc, li, ci, spec.dtype)
                rc.write_tokens(li, ci, ids, positions, rows)


def export_states(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache], block_ids: BlockIds) -> None:
    """Write every recurrent layer's state into each rank's shard of each component, at the
    request's slot (the last block id of the layer's group)."""
    hf = layer_map(cache, spec)
    _check_caches(caches, spec, block_ids)
    for li in range(spec.num_layers):
        if not spec.layers[li].is_recurrent:
            continue
        _check_layer_kind(cache.layers[hf[li]], spec.layers[li], li)
        layer = cache.layers[hf[li]]
        comps = state_tensors(layer, spec.layers[li]) if is_compressed(layer) else state_components(layer, spec, li)
        for rc in caches:
            if not _holds(rc, li):
                continue
            slot = _state_slot(spec, rc.layout, block_ids, li)
            for ci, full in enumerate(comps):
                u0, nu = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                rc.write_state(li, ci, slot, full[u0:u0 + nu])


def export_cache(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache], block_ids: BlockIds,
                 num_tokens: int) -> None:
    """Write a batch-1 prefill cache into the prefill engine's paged rank caches: attention K/V at
    the positions each layer keeps (`[tokens_kept(N), N)`) and recurrent state at its slot."""
    export_tokens(cache, spec, caches, block_ids, num_tokens)
    export_states(cache, spec, caches, block_ids)


def _check_rank_order(caches: Sequence[RankCache]) -> None:
    if not caches:
        raise InvalidRequest("no rank caches to import from")
    layout = caches[0].layout
    if [c.rank for c in caches] != list(range(layout.world_size)):
        got = [c.rank for c in caches]
        raise InvalidRequest(f"need the {layout.world_size} rank caches in rank order, got ranks {got}")


def gather_kv(caches: Sequence[RankCache], block_ids: BlockIds,
              num_tokens: int) -> list[tuple[torch.Tensor, ...] | None]:
    """Every attention layer's global `[H, N, D]` keys and values (the indexer keys alone for an
    indexer layer) from the decode ranks (None for recurrent and stateless layers).

    Each head is read from the first rank that holds it; positions before a sliding window are
    zeros (the engine does not keep them and transformers drops them).
    """
    _check_rank_order(caches)
    spec = caches[0].spec
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    dtype = TORCH_DTYPES[spec.dtype]  # attention K/V as the engine stores them
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for li, lspec in enumerate(spec.layers):
        if not lspec.is_attention:
            out.append(None)
            continue
        rows_held = lspec.rows(num_tokens)  # tokens, or complete windows of a compressed layer
        positions = np.arange(lspec.tokens_kept(rows_held), rows_held, dtype=np.int64)
        pair = []
        for ci, comp in enumerate(lspec.components):
            full = torch.zeros(comp.heads, rows_held, comp.dim, dtype=dtype, device=caches[0].regions[0].device)
            have = np.zeros((comp.heads, len(positions)), dtype=bool)  # (head, position) already read
            for rc in caches:
                if not _holds(rc, li):
                    continue
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                mine = np.flatnonzero(_owned(rc, spec, li, positions))
                fresh = ~have[h0:h0 + nh][:, mine]  # [nh, mine]
                if not fresh.any():
                    continue
                rows = rc.read_tokens(li, ci, _ids(rc, spec, block_ids, li, num_tokens), positions[mine])
                for h in np.flatnonzero(fresh.any(axis=1)):
                    take = mine[fresh[h]]
                    full[h0 + h, torch.from_numpy(positions[take])] = rows[torch.from_numpy(fresh[h]), h]
                    have[h0 + h, take] = True
            if not have.all():
                heads = np.flatnonzero(~have.all(axis=1)).tolist()
                raise InvalidRequest(f"layer {li} component {ci}: heads {heads} not held for every position by any rank")
            pair.append(full)
        out.append(tuple(pair))
    return out


def gather_states(caches: Sequence[RankCache], block_ids: BlockIds) -> dict[int, list[torch.Tensor]]:
    """Every recurrent layer's state components `[units, dim]` from the decode ranks, each unit from
    the first rank that holds it, at the request's slot."""
    _check_rank_order(caches)
    spec = caches[0].spec
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    out: dict[int, list[torch.Tensor]] = {}
    for li, lspec in enumerate(spec.layers):
        if not lspec.is_recurrent:
            continue
        comps = []
        for ci, comp in enumerate(lspec.components):
            full = torch.zeros(comp.heads, comp.dim, dtype=TORCH_DTYPES[spec.component_dtype(comp)],
                               device=caches[0].regions[0].device)
            have = np.zeros(comp.heads, dtype=bool)
            for rc in caches:
                if not _holds(rc, li):
                    continue
                u0, nu = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                need = [u for u in range(u0, u0 + nu) if not have[u]]
                if need:
                    rows = rc.read_state(li, ci, _state_slot(spec, rc.layout, block_ids, li))
                    full[need] = rows[[u - u0 for u in need]]
                    have[need] = True
            if not have.all():
                raise InvalidRequest(f"layer {li} {comp.name}: units {np.flatnonzero(~have).tolist()} on no rank")
            comps.append(full)
        out[li] = comps
    return out


def replica_mismatches(caches: Sequence[RankCache], block_ids: BlockIds, num_tokens: int) -> list[str]:
    """Heads (or state units) that two decode ranks both hold but with different bytes."""
    spec = caches[0].spec
    out = []
    for li, lspec in enumerate(spec.layers):
        rows_held = lspec.rows(num_tokens)
        positions = np.arange(lspec.tokens_kept(rows_held), rows_held, dtype=np.int64)
        if lspec.is_stateless or (not lspec.is_recurrent and not len(positions)):
            continue
        for ci, comp in enumerate(lspec.components):
            seen: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (unit, CP rank) -> first holder's rows
            for rc in caches:
                if not _holds(rc, li):
                    continue
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                cp = 0 if lspec.is_recurrent else rc.layout.rank_coords(rc.rank).cp
                if lspec.is_recurrent:
                    rows = rc.read_state(li, ci, _state_slot(spec, rc.layout, block_ids, li), as_int=True)
                else:
                    mine = positions[_owned(rc, spec, li, positions)]
                    ids = _ids(rc, spec, block_ids, li, num_tokens)
                    rows = rc.read_tokens(li, ci, ids, mine, as_int=True).transpose(0, 1)
                for h in range(h0, h0 + nh):
                    if (h, cp) not in seen:
                        seen[h, cp] = (rc.rank, rows[h - h0])
                    elif not torch.equal(seen[h, cp][1], rows[h - h0]):
                        what = f"{comp.name} unit" if lspec.is_recurrent else f"comp {ci} head"
                        out.append(f"layer {li} {what} {h}: rank {rc.rank} differs from rank {seen[h, cp][0]}")
    return out


def import_cache(caches: Sequence[RankCache], block_ids: BlockIds, num_tokens: int,
                 config: PretrainedConfig, model_dtype: str | None = None) -> DynamicCache:
    """A `DynamicCache` for `config` holding the decode ranks' paged cache of `num_tokens` tokens.

    Sliding layers get all N positions (zeros before the window) so that their cumulative length
    is N, which is what transformers uses for positions and masks; the layer crops itself.
    An engine that stores K/V in another dtype or with scales (fp8) is read back as model values
    (`element * scale` in `model_dtype`), which is lossy by nature (`kv_dtype`).
    Recurrent layers get their conv and recurrent state through transformers' own prefill path
    (`update_conv_state` / `update_recurrent_state`), which also marks `has_previous_state`, so
    the next forward continues with the single-token update exactly as after a prefill.
    """
    _check_rank_order(caches)
    spec = caches[0].spec
    cache = empty_cache(config, spec)
    if not cache.layers and (spec.has_recurrent or any(x.is_stateless for x in spec.layers)):
        raise ConfigError(f"config makes a cache of {len(cache.layers)} layers, the rank caches have {spec.num_layers}")
    hf = layer_map(cache, spec, "config makes a cache of") if cache.layers else tuple(range(spec.num_layers))
    states = gather_states(caches, block_ids)
    kvs = gather_kv(caches, block_ids, num_tokens)
    for li, kv in enumerate(kvs):
        lspec = spec.layers[li]
        if cache.layers:
            _check_layer_kind(cache.layers[hf[li]], lspec, li)
        if cache.layers and is_compressed(cache.layers[hf[li]]):
            if hf.index(hf[li]) == li:  # the whole layer at its first part, from all its parts
                last = li + compressed_parts(cache.layers[hf[li]]) - 1
                parts = [kvs[j][0] if model_dtype is None else  # type: ignore[index]
                         to_model(kvs[j][0], caches[0].layout, j, 0, spec.dtype, model_dtype)  # type: ignore[index]
                         for j in range(li, last)]
                restore(cache.layers[hf[li]], parts[0], parts[1:], states[last], spec.layers[last], num_tokens)
            continue
        if kv is not None and cache.layers and _is_second_part(cache, hf, li):
            cache.layers[hf[li]].update_indexer(kv[0])  # [1 head, N, D] is [batch 1, N, D]
            continue
        if kv is not None:
            if model_dtype is not None:
                kv = tuple(to_model(t, caches[0].layout, li, ci, spec.dtype, model_dtype) for ci, t in enumerate(kv))
            cache.update(kv[0][None], kv[1][None], hf[li])
            continue
        if lspec.is_stateless:  # transformers' DummyLayer: nothing to put back
            continue
        if per_component_states(lspec):  # one recurrent state per component (RWKV), each continuing
            for si, comp in enumerate(states[li]):
                cache.update_recurrent_state(comp.reshape(1, -1), hf[li], state_idx=si)
                cache.layers[hf[li]].has_previous_state[si] = True
            continue
        convs, rec = hf_state_tensors(lspec, states[li])
        for si, conv in enumerate(convs):
            cache.update_conv_state(conv, hf[li], state_idx=si, conv_kernel_size=lspec.conv_rows)
        if rec is not None:
            cache.update_recurrent_state(rec, hf[li])
        if not convs:  # no conv update marks it: a state-only layer (lightning) continues from its state
            cache.layers[hf[li]].has_previous_state[0] = True
    for li, lspec in enumerate(spec.layers):
        layer = cache.layers[hf[li]]
        if spec.layers[li].is_stateless or (is_compressed(layer) and hf.index(hf[li]) != li):
            continue
        if spec.layers[li].is_recurrent:
            if not all(cache.layers[hf[li]].has_previous_state.values()):
                raise InvalidRequest(f"imported layer {li} did not take its recurrent state")
            continue
        if _is_second_part(cache, hf, li):
            _indexer_keys(layer, li, num_tokens, spec)
            continue
        if layer.get_seq_length() != num_tokens:
            raise InvalidRequest(f"imported layer {li} reports {layer.get_seq_length()} tokens, expected {num_tokens}")
        if bool(getattr(layer, "is_sliding", False)) != (lspec.window is not None):
            raise ConfigError(f"layer {li}: config builds {type(layer).__name__}, spec says {lspec.kind!r} "
                              f"with window {lspec.window}")
    if any(x.is_attention for x in spec.layers) and cache.get_seq_length() != num_tokens:
        raise InvalidRequest(f"imported cache reports {cache.get_seq_length()} tokens, expected {num_tokens}")
    return cache


__all__ = ["BlockIds", "export_cache", "export_states", "export_tokens", "gather_kv", "gather_states", "import_cache",
           "layer_map", "replica_mismatches"]

"""The proof of a KV dtype conversion: every destination element is the reference conversion of its source.

A bf16 or fp32 prefill feeding an fp8 decode (or an fp8 engine on either side) cannot be
bit-exact with a `transformers` model run in the model's dtype: quantizing loses bits, by nature.
So for such a pair the proof is element-wise instead: the prefill engine's cache holds the model's
K/V quantized the way a serving engine's cache write does it (`value / scale`, saturated, cast;
vLLM's scaled fp8 convention, `transport.convert`), and after the move every element each decode
rank holds must equal torch's own conversion of the prefill element it came from, with the two
sides' scales (or the same bits when type and scales agree). The decode then continues from the
dequantized cache (`element * scale` in the model's dtype) and its tokens are reported, not
required to equal `generate`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Conversion, Request, full_block_ids
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.cache import RankCache
from kvbridge.transport.convert import convert_elements


def is_lossy(spec: ModelSpec, *layouts: EngineLayout) -> bool:
    """Whether an engine stores attention K/V other than as the model computes them (dtype or scales)."""
    return any(layout.engine_spec(spec).dtype != spec.dtype or layout.kv_scales for layout in layouts)


def _scale(layout: EngineLayout, li: int, ci: int, head: int) -> float:
    scales = layout.scales(li, ci)
    return scales[head % len(scales)]


def to_engine(rows: torch.Tensor, rc: RankCache, li: int, ci: int, model_dtype: str) -> torch.Tensor:
    """The model's K/V rows `[T, local_heads, D]` as the rank's cache stores them (quantized per head)."""
    engine_dtype = rc.spec.component_dtype(rc.spec.layers[li].components[ci])
    scales = rc.layout.scales(li, ci)
    if engine_dtype == model_dtype and scales == (1.0,):
        return rows
    h0 = int(rc.addr.first_head[li, ci])
    return torch.stack([convert_elements(rows[:, j], Conversion(model_dtype, engine_dtype, 1.0,
                                                                _scale(rc.layout, li, ci, h0 + j)))
                        for j in range(rows.shape[1])], dim=1)


def to_model(full: torch.Tensor, layout: EngineLayout, li: int, ci: int, engine_dtype: str,
             model_dtype: str) -> torch.Tensor:
    """A layer component's global elements `[H, N, D]` as model values (`element * scale`)."""
    if engine_dtype == model_dtype and layout.scales(li, ci) == (1.0,):
        return full
    return torch.stack([convert_elements(full[h], Conversion(engine_dtype, model_dtype,
                                                             _scale(layout, li, ci, h), 1.0))
                        for h in range(full.shape[0])])


def conversion_mismatches(spec: ModelSpec, src: Sequence[RankCache], dst: Sequence[RankCache],
                          request: Request) -> tuple[list[str], int]:
    """Decode elements that are not the reference conversion of their prefill element; and how many
    elements were checked (every attention element the decode ranks hold for the moved positions)."""
    from kvbridge.proofs.cache_compare import as_bits  # (hf_cache imports this module: import here)
    from kvbridge.proofs.hf_cache import gather_kv
    n, cached = request.num_tokens, request.num_cached_tokens
    source = gather_kv(src, request.src_block_ids, n)
    s_layout, s_spec = src[0].layout, src[0].spec
    out: list[str] = []
    checked = 0
    for rc in dst:
        coords = rc.layout.rank_coords(rc.rank)
        for li, lspec in enumerate(spec.layers):
            if lspec.is_recurrent or int(rc.addr.region[li, 0]) < 0:
                continue
            g = spec.layer_group[li]
            kept = lspec.moved_positions(n, cached)  # tokens, or rows of a layer keeping one per several tokens
            positions = np.arange(kept.start, kept.stop, dtype=np.int64)
            if rc.layout.cp_size > 1:
                positions = positions[rc.layout.row_layout(spec).token_owner(positions, g) == coords.cp]
            if not len(positions):
                continue
            ids = full_block_ids(rc.layout, g, request.dst_block_ids[g], n)
            for ci, comp in enumerate(lspec.components):
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                got = rc.read_tokens(li, ci, ids, positions)  # [T, nh, D]
                sd = s_spec.component_dtype(s_spec.layers[li].components[ci])
                dd = rc.spec.component_dtype(rc.spec.layers[li].components[ci])
                for j in range(nh):
                    h = h0 + j
                    elements = source[li][ci][h, torch.from_numpy(positions)]
                    conv = Conversion(sd, dd, _scale(s_layout, li, ci, h), _scale(rc.layout, li, ci, h))
                    want = elements if (sd, conv.src_scale) == (dd, conv.dst_scale) else convert_elements(elements, conv)
                    bad = int((as_bits(want) != as_bits(got[:, j])).sum())
                    checked += want.numel()
                    if bad:
                        out.append(f"rank {rc.rank} layer {li} {comp.name} head {h}: {bad} of {want.numel()} elements "
                                   f"are not the {sd}->{dd} conversion of their source")
    return out, checked


def describe_conversion(spec: ModelSpec, src: EngineLayout, dst: EngineLayout) -> str:
    """E.g. 'float32 -> float8_e4m3fn (per-head scales on decode)'."""
    def side(layout: EngineLayout) -> str:
        return layout.engine_spec(spec).dtype

    def scales(layout: EngineLayout, name: str) -> str:
        if not layout.kv_scales:
            return ""
        per_head = any(len(comp) > 1 for layer in layout.kv_scales for comp in layer)
        return f"{'per-head' if per_head else 'per-tensor'} scales on {name}"

    notes = ", ".join(x for x in (scales(src, "prefill"), scales(dst, "decode")) if x)
    return f"{side(src)} -> {side(dst)}" + (f" ({notes})" if notes else "")


__all__ = ["conversion_mismatches", "describe_conversion", "is_lossy", "to_engine", "to_model"]

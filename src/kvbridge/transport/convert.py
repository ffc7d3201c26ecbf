"""KV dtype conversion on the copy path: the runs of a plan that carry a conversion id.

The planner marks a run with a `Conversion` when its component's element type or scale differs
between the sides (`core.plan`). Here each such run is read as source elements, converted
element by element with torch's own cast, and written as destination elements, so a bf16
prefill feeds an fp8 decode (and back) without any pass over the rest of the cache. The rule is
vLLM's scaled fp8 convention (a stored element means `element * scale`): the value
`(src.float() * src_scale) / dst_scale`, saturated to the finite range when the destination is
fp8 (as vLLM's quantization clamps), cast to the destination type. Not bit-exact with a model run
in the destination dtype, by nature: it is the reference conversion of each source element.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvbridge.core.plan import Conversion, Plan
from kvbridge.transport.cache import TORCH_DTYPES

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_CANONICAL_NAN = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F, torch.float16: 0x7E00,
                  torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}


def convert_elements(x: torch.Tensor, conv: Conversion) -> torch.Tensor:
    """Source elements -> destination elements under `conv` (the reference conversion)."""
    dst = TORCH_DTYPES[conv.dst_dtype]
    # The scales as float32 tensors on x's device, not Python numbers: CUDA divides by a host
    # scalar as a multiplication by its reciprocal, which rounds differently from the division
    # the CPU does (an H200 wrote 92 of a request's fp8 bytes one step off the reference).
    src_scale, dst_scale = (torch.tensor(v, dtype=torch.float32, device=x.device)
                            for v in (conv.src_scale, conv.dst_scale))
    value = (x.to(torch.float32) * src_scale) / dst_scale
    if dst in _FP8:
        limit = torch.finfo(dst).max
        value = value.clamp(-limit, limit)
    # One bit pattern for every NaN: a cast keeps or drops a NaN's sign and payload by device (a
    # negative fp8 NaN became 0xFF on the CPU and 0x7F on an H200), and the bytes must not depend
    # on the device that converted.
    if dst not in _CANONICAL_NAN:  # an integer type holds no NaN
        return value.to(dst)
    bits = value.to(dst).view(_BITS[dst.itemsize])
    return torch.where(value.isnan(), _CANONICAL_NAN[dst], bits).view(dst)


def _element_index(offsets: np.ndarray, lengths: np.ndarray, itemsize: int) -> torch.Tensor:
    counts = torch.from_numpy(lengths // itemsize)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.repeat_interleave(torch.from_numpy(offsets // itemsize), counts) + within


def convert_runs(src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor], sr: np.ndarray,
                 dr: np.ndarray, plan: Plan) -> np.ndarray:
    """Execute the converting runs of `plan` (byte regions, flat region indices `sr`, `dr`, already
    bounds-checked); returns the mask of the runs it did, for the caller to copy the rest."""
    mask = plan.convert >= 0
    for k in np.unique(plan.convert[mask]):
        conv = plan.conversions[int(k)]
        s_type, d_type = TORCH_DTYPES[conv.src_dtype], TORCH_DTYPES[conv.dst_dtype]
        s_size, d_size = s_type.itemsize, d_type.itemsize
        sel = plan.convert == k
        pair = sr[sel] * len(dst_regions) + dr[sel]
        for key in np.unique(pair):
            runs = np.flatnonzero(sel)[pair == key]
            src = src_regions[int(key // len(dst_regions))].view(s_type)
            dst = dst_regions[int(key % len(dst_regions))].view(d_type)
            s_idx = _element_index(plan.src_offset[runs], plan.src_length[runs], s_size).to(src.device)
            d_idx = _element_index(plan.dst_offset[runs], plan.length[runs], d_size).to(dst.device)
            dst[d_idx] = convert_elements(src[s_idx], conv).to(dst.device)
    return mask


__all__ = ["convert_elements", "convert_runs"]

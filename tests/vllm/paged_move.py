"""Shared by the vLLM layout tests: execute a plan between two engines held as flat per-layer
tensors (each layer's region from its first page to its last block's end) and return what the
destination holds."""

from __future__ import annotations

import torch

from kvbridge.core.plan import Plan
from kvbridge.transport.cache import RankCache
from kvbridge.transport.local import LocalExecutor


def execute_between(spec, src, dst, plan: Plan, src_engine: list[list[torch.Tensor]],
                    dst_shapes: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """`plan` from `src_engine` (per rank, per layer) into zeroed tensors shaped like `dst_shapes`."""
    got = [[torch.zeros_like(t) for t in ts] for ts in dst_shapes]

    def cache(layout, r, tensors):
        sizes = layout.addressing(spec, r).region_nbytes
        return RankCache(spec, layout, r, [t.view(torch.uint8)[:size] for t, size in zip(tensors, sizes)])

    LocalExecutor([cache(src, r, t) for r, t in enumerate(src_engine)],
                  [cache(dst, r, t) for r, t in enumerate(got)]).execute(plan)
    return got

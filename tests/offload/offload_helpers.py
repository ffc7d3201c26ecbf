"""Shared helpers for the offload tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import torch

from kvbridge.layout import RankCache


def snapshot(caches: list[RankCache]) -> list[torch.Tensor]:
    return [r.clone() for c in caches for r in c.byte_regions()]


def kernel_rows(layout, block: int) -> list[int]:
    """Kernel blocks of one logical block."""
    k = layout.kernel_blocks_per_block
    return list(range(block * k, block * k + k))

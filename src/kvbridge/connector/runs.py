"""Planner output -> transport `Runs`, from the point of view of the agent that posts them.

A `Plan` names both sides absolutely (source rank/region/offset, destination region/offset).
A transport speaks relative to the posting agent: `local_*` is always the poster's memory and
`remote_*` the peer's. So a decode rank that *reads* (pull) has the destination as local, and
a prefill rank that *writes* (push) has the source as local. Keeping that flip in one function
is what stops a pull from silently turning into a write of garbage over the source.
"""

from __future__ import annotations

import numpy as np

from kvbridge.core.plan import Plan
from kvbridge.transport.base import Op, Runs


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def runs_for(plan: Plan, op: Op, src_rank: int) -> Runs:
    """The runs of `plan` that involve source rank `src_rank`, as the poster of `op` sees them.

    `op="read"`: the poster is the destination rank (the plan must hold one destination rank).
    `op="write"`: the poster is `src_rank`.
    """
    sel = plan.src_rank == src_rank
    if op == "read":
        if len(plan) and np.any(plan.dst_rank != plan.dst_rank[0]):
            raise ValueError("a read is posted by one destination rank; the plan holds several")
        return Runs(local_region=_i64(plan.dst_region[sel]), local_offset=_i64(plan.dst_offset[sel]),
                    remote_region=_i64(plan.src_region[sel]), remote_offset=_i64(plan.src_offset[sel]),
                    length=_i64(plan.length[sel]))
    if op == "write":
        return Runs(local_region=_i64(plan.src_region[sel]), local_offset=_i64(plan.src_offset[sel]),
                    remote_region=_i64(plan.dst_region[sel]), remote_offset=_i64(plan.dst_offset[sel]),
                    length=_i64(plan.length[sel]))
    raise ValueError(f"op must be 'read' or 'write', got {op!r}")


__all__ = ["runs_for"]

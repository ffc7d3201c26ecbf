"""Planning cost per request, beside the time the request's bytes take on a link.

A request is planned once per transfer, so its planning time is overhead on that transfer: we
report it cold (the engine pair's first request: templates and address tables built) and warm
(median per request with them cached), and the token-by-token reference planner measured in
the same run, as a percentage of the request's time on the link (`link_seconds`, the one
definition `kvbridge plan` uses too). The timed call builds the `Request` too
(normalizing the id lists is part of every request's cost).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.bench.results import BenchFigures
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Plan, Request, plan_request
from kvbridge.core.plan_template import clear_plan_caches
from kvbridge.core.spec import ModelSpec

DEFAULT_LINK_GBPS = 400.0
"""Gbit/s of each decode rank's link (one 400G NIC per GPU: 400 Gbit/s = 50 GB/s): the one default
of `kvbridge plan --link-gbps` and `kvbridge bench --link-gbps`."""

LINK_ASSUMPTION = ("every decode rank has its own link at --link-gbps, all ranks move in parallel, no protocol "
                   "overhead: a request takes as long as its busiest decode rank's bytes on the wire (the source's "
                   "bytes, before any KV dtype conversion)")
"""What `link_seconds` assumes, in words (printed by `plan`, kept in `bench`'s figures)."""


def wire_bytes_per_rank(plan: Plan) -> list[int]:
    """Bytes each destination rank reads from the sources for `plan`: the source's bytes
    (`src_length`), which differ from what it writes when a run converts a KV dtype."""
    world = plan.dst.world_size
    sums = np.bincount(plan.dst_rank, weights=plan.src_length, minlength=world) if len(plan) else np.zeros(world)
    return [int(x) for x in sums]


def link_seconds(rank_bytes: Iterable[int], link_gbps: float = DEFAULT_LINK_GBPS) -> float:
    """The one definition of a request's time at a link speed (`plan` and `bench`): every decode
    rank on its own link of `link_gbps` Gbit/s, all in parallel, no protocol overhead, so the
    busiest rank's bytes on the wire set the time."""
    return max(rank_bytes, default=0) / (link_gbps * 1e9 / 8)


@dataclass
class PlanningFigures(BenchFigures):
    plan_cold_seconds: float
    plan_warm_seconds: float
    plan_reference_seconds: float
    link_gbps: float
    link_seconds: float
    plan_link_percent: float  # warm planning / link transfer time, in percent


def bench_planning(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout,
                   src_ids: Sequence[Sequence[int]], dst_ids: Sequence[Sequence[int]], num_tokens: int,
                   link_gbps: float = DEFAULT_LINK_GBPS, samples: int = 51) -> PlanningFigures:
    """Cold once, then `samples` warm plans and `samples` reference plans (medians). The two run
    in separate loops: interleaved, each would pay for the memory the other just freed (page
    faults), which a server planning request after request does not."""
    def plan(templates: bool = True) -> Plan:
        return plan_request(spec, prefill, decode, Request(src_ids, dst_ids, num_tokens), templates=templates)

    clear_plan_caches()
    t0 = time.perf_counter()
    first = plan()
    cold = time.perf_counter() - t0
    warm: list[float] = []
    reference: list[float] = []
    for out, templates in ((warm, True), (reference, False)):
        for _ in range(samples):
            t0 = time.perf_counter()
            plan(templates)
            out.append(time.perf_counter() - t0)
    link = link_seconds(wire_bytes_per_rank(first), link_gbps)
    warm_s = statistics.median(warm)
    return PlanningFigures(plan_cold_seconds=cold, plan_warm_seconds=warm_s,
                           plan_reference_seconds=statistics.median(reference), link_gbps=link_gbps,
                           link_seconds=link, plan_link_percent=100 * warm_s / link if link else 0.0)

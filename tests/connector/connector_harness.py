"""Helpers for the connector tests: real transports, real ZMQ side channels, bounded loops.

`Cluster` puts P producers and D consumers in this process (each with its own transport agent
and sockets) and drives them from one loop, so lifecycle tests are deterministic and fast; the
multi-process tests use `kvbridge.proofs.connector_demo`'s engines instead. Nothing here imitates a
transport: every byte moves through the backend under test.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.connector.consumer import Consumer, RequestResult
from kvbridge.connector.producer import Producer
from kvbridge.connector.transports import allocate_cache, make_transport, unavailable_reason
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request
from kvbridge.core.spec import ModelSpec
from kvbridge.testing.reliability import close_endpoints
from kvbridge.proofs.verify import (clone_caches, expected_destination, fill_source, mismatch_report, random_bytes,
                             random_request)

SECRET = generate_secret()  # per test run, shared by both engines of every cluster here

SPEC = ModelSpec.uniform(2, 6, 16, "bfloat16", name="six-heads")  # TP 1, 2, 3, 6 all shard it


def disjoint_requests(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout, count: int, seed: int,
                      prefix: str = "r") -> dict[str, Request]:
    """`count` random requests (20-60 tokens) whose blocks are pairwise disjoint on both sides."""
    rng = random.Random(seed)
    out: dict[str, Request] = {}
    used_s: set[int] = set()
    used_d: set[int] = set()
    while len(out) < count:
        rq = random_request(spec, prefill, decode, rng.randint(20, 60), 0, rng)
        s = {b for g in rq.src_block_ids for b in g}
        d = {b for g in rq.dst_block_ids for b in g}
        if s & used_s or d & used_d:
            continue
        used_s |= s
        used_d |= d
        out[f"{prefix}{len(out)}"] = rq
    return out


def require(kind: str) -> None:
    """Skip with the backend's exact import error when it cannot be constructed here."""
    why = unavailable_reason(kind)
    if why is not None:
        pytest.skip(f"{kind} transport unavailable: {why}")


class Cluster:
    """P prefill-rank producers and D decode-rank consumers of one engine pair, in this process."""

    def __init__(self, prefill: EngineLayout, decode: EngineLayout, *, mode: str = "pull", transport: str = "shm",
                 spec: ModelSpec = SPEC, config: ConnectorConfig | None = None,
                 prefill_config: ConnectorConfig | None = None, seed: int = 0, prefill_id: str = "prefill",
                 decode_id: str = "decode", decode_spec: ModelSpec | None = None):
        self.spec, self.prefill, self.decode, self.mode = spec, prefill, decode, mode
        self.config = config or ConnectorConfig(lease_seconds=5, transfer_timeout=5, abort_timeout=1, secret=SECRET)
        self.released: list[tuple[int, str, str]] = []
        self.results: dict[tuple[int, str], RequestResult] = {}
        self.src = [allocate_cache(transport, spec, prefill, r, "test-p") for r in range(prefill.tp_size)]
        self.dst = [allocate_cache(transport, decode_spec or spec, decode, r, "test-d")
                    for r in range(decode.tp_size)]
        random_bytes(self.src, seed + 1)
        random_bytes(self.dst, seed + 2)
        self.producers: list[Producer] = []
        self.consumers: list[Consumer] = []
        try:
            for r in range(prefill.tp_size):
                t = make_transport(transport, f"{prefill_id}/{r}", timeout_s=self.config.transfer_timeout)
                self.producers.append(Producer(prefill_id, r, self.src[r], t, mode=mode,
                                               config=prefill_config or self.config,
                                               on_release=lambda rid, why, r=r: self.released.append((r, rid, why))))
            self.producers[0].set_peer_addresses([p.address for p in self.producers])
            for r in range(decode.tp_size):
                t = make_transport(transport, f"{decode_id}/{r}", timeout_s=self.config.transfer_timeout)
                self.consumers.append(Consumer(decode_id, r, self.dst[r], t, mode=mode, config=self.config))
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self.producers[0].address

    def connect(self, timeout: float = 5.0) -> list[str]:
        """Handshake every consumer (producers are pumped by a helper thread meanwhile)."""
        with pumping(self.producers):
            return [c.connect(self.address, timeout) for c in self.consumers]

    def step(self, timeout: float = 0.001) -> None:
        for p in self.producers:
            p.progress(timeout)
        for c in self.consumers:
            for res in c.progress(timeout):
                self.results[(c.rank, res.request_id)] = res

    def run_until(self, predicate: Callable[[], bool], timeout: float) -> float:
        """Step until `predicate()`; returns the seconds it took; fails the test on timeout."""
        t0 = time.monotonic()
        while not predicate():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"condition not reached within {timeout} s; results {self.results}, "
                                     f"released {self.released}")
            self.step()
        return time.monotonic() - t0

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()

    def releases_of(self, rid: str) -> list[tuple[int, str]]:
        return [(r, why) for r, x, why in self.released if x == rid]

    def done(self, rid: str, ranks: list[int] | None = None) -> bool:
        ranks = list(range(len(self.consumers))) if ranks is None else ranks
        return all((r, rid) in self.results for r in ranks)

    def close(self) -> None:
        close_endpoints(self.consumers, self.producers)


@contextlib.contextmanager
def pumping(producers: list[Producer], step: float = 0.002) -> Iterator[None]:
    """Progress `producers` on a helper thread while the body blocks (a handshake); bounded by the body."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for p in producers:
                p.progress(step)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class Workload:
    """Disjoint random block tables, source patterns written, destination expectation computed."""

    def __init__(self, cluster: Cluster, count: int, seed: int = 0, min_tokens: int = 1, max_tokens: int = 80,
                 fill: bool = True):
        rng = random.Random(seed)
        spec, pl, dl = cluster.spec, cluster.prefill, cluster.decode
        src_perm, dst_perm = list(range(pl.num_blocks)), list(range(dl.num_blocks))
        rng.shuffle(src_perm)
        rng.shuffle(dst_perm)
        self.requests: dict[str, Request] = {}
        si = di = 0
        for i in range(count):
            n = rng.randint(min_tokens, max_tokens)
            ns, nd = -(-n // pl.block_size), -(-n // dl.block_size)
            src = tuple(tuple(src_perm[si + g * ns: si + (g + 1) * ns]) for g in range(len(spec.groups)))
            dst = tuple(tuple(dst_perm[di + g * nd: di + (g + 1) * nd]) for g in range(len(spec.groups)))
            si += ns * len(spec.groups)
            di += nd * len(spec.groups)
            assert si <= pl.num_blocks and di <= dl.num_blocks, "layouts too small for the workload"
            self.requests[f"req-{seed}-{i}"] = Request(src, dst, n)
        if fill:
            for rq in self.requests.values():
                fill_source(cluster.src, rq.src_block_ids, rq.num_tokens)
        self.before = clone_caches(cluster.dst)
        self.cluster = cluster

    def receive(self, rids: list[str] | None = None, ranks: list[int] | None = None, **kw) -> None:
        for rid in rids or list(self.requests):
            rq = self.requests[rid]
            for c in self.cluster.consumers:
                if ranks is None or c.rank in ranks:
                    c.receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens, **kw)

    def add(self, rids: list[str] | None = None, ranks: list[int] | None = None, **kw) -> None:
        for rid in rids or list(self.requests):
            rq = self.requests[rid]
            for p in self.cluster.producers:
                if ranks is None or p.rank in ranks:
                    p.add_request(rid, rq.src_block_ids, rq.num_tokens, first_token=7, **kw)

    def mismatches(self, rids: list[str] | None = None) -> list[str]:
        """Differences between the decode caches and what exactly `rids` (default all) must produce."""
        expected = clone_caches(self.before)
        for rid in list(self.requests) if rids is None else rids:
            expected_destination(expected, self.requests[rid])
        return mismatch_report(self.cluster.dst, expected)


def snapshot(caches: list[RankCache]) -> list[np.ndarray]:
    return [r.numpy().copy() for c in caches for r in c.byte_regions()]

"""An engine's rank processes seen from the orchestrating parent: the demos' prefill and decode engines.

Each rank is a `connector.processes.RankProcess` (its own OS process, typed messages over a
pipe); these classes start them, broadcast commands, collect their events (releases, results)
and wait with deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvbridge.connector import processes as rp
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.messages import HandshakeRefused
from kvbridge.connector.processes import RankArgs, RankProcess, RankProcessError, stop_all
from kvbridge.connector.rank_host import Stopped
from kvbridge.connector.side_channel import format_address, parse_address
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec

Mode = str  # "pull" | "push"

DECODE_JOB = "kvbridge.proofs.decode_job:run_decode_job"
"""The proof decode rank 0 runs on its cache (`processes.Run`)."""


def host_of(address: str) -> str:
    return parse_address(address)[0]


class _Ranks:
    """One engine's rank processes, seen from the orchestrating parent."""

    def __init__(self, ctx: Any, role: str, transport: str, engine_id: str, spec: ModelSpec, layout: EngineLayout,
                 mode: Mode, config: ConnectorConfig, fill_seed: int, max_lifetime: float,
                 listen: Callable[[int], str] | None = None, host: str = "127.0.0.1"):
        self.engine_id, self.layout, self.spec = engine_id, layout, spec
        self.ranks = [RankProcess(RankArgs(role=role, engine_id=engine_id, rank=r, transport=transport, spec=spec,
                                           layout=layout, mode=mode, host=host, config=config,
                                           fill_seed=fill_seed + r, max_lifetime=max_lifetime,
                                           **({"listen": listen(r)} if listen else {})), ctx)
                      for r in range(layout.world_size)]

    def broadcast(self, request: Any, reply: type, timeout: float) -> list[Any]:
        """Send `request` to every rank, then wait for each one's `reply`."""
        for p in self.ranks:
            p.send(request)
        return [p.expect(reply, timeout) for p in self.ranks]

    def pump(self, timeout: float = 0.0) -> None:
        for p in self.ranks:
            p.pump(timeout / max(1, len(self.ranks)))
            self.collect(p)
            if p.error:
                raise RankProcessError(f"{p.name} failed: {p.error}")

    def collect(self, p: RankProcess) -> None:
        raise NotImplementedError

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.pump(0.02)
            if done():
                return True
            if time.monotonic() > deadline:
                return False


class PrefillEngine(_Ranks):
    """The prefill engine's rank processes."""

    def __init__(self, ctx: Any, transport: str, engine_id: str, spec: ModelSpec, layout: EngineLayout, mode: Mode,
                 listen: str, config: ConnectorConfig, fill_seed: int = 1, max_lifetime: float = 600.0):
        host = host_of(listen)
        super().__init__(ctx, "prefill", transport, engine_id, spec, layout, mode, config, fill_seed, max_lifetime,
                         listen=lambda r: listen if r == 0 else format_address(host, 0), host=host)
        self.address = ""
        self.releases: dict[int, list[tuple[str, str]]] = {r: [] for r in range(layout.world_size)}
        self.decode_engines: set[str] = set()

    def start(self, timeout: float) -> str:
        """Wait until every rank listens; give rank 0 the directory; returns the bootstrap address."""
        addresses = [p.expect(rp.Ready, timeout).address for p in self.ranks]
        self.ranks[0].call(rp.Directory(addresses), rp.DirectorySet, timeout)
        self.address = addresses[0]
        return self.address

    def load(self, shards: list[list[np.ndarray]], timeout: float) -> None:
        for p, regions in zip(self.ranks, shards):
            p.send(rp.Load(regions))
        for p in self.ranks:
            p.expect(rp.Loaded, timeout)

    def add(self, requests: list[rp.Lease], timeout: float) -> None:
        self.broadcast(rp.Add(requests), rp.Added, timeout)

    def collect(self, p: RankProcess) -> None:
        for ev in p.take(rp.Released):
            self.releases[p.args.rank].append((ev.request_id, ev.reason))
        for ev in p.take(rp.Handshake):
            self.decode_engines.add(ev.engine_id)

    def wait_handshake(self, timeout: float) -> None:
        if not self._wait(lambda: bool(self.decode_engines), timeout):
            raise RankProcessError(f"no decode engine connected to {self.address} within {timeout:.1f} s")

    def wait_released(self, ids: Sequence[str], timeout: float) -> bool:
        """True when every rank released every id (at least once) within `timeout`."""
        want = set(ids)
        return self._wait(lambda: all(want <= {rid for rid, _ in ev} for ev in self.releases.values()), timeout)

    def stop(self) -> dict[int, dict[str, int]]:
        stop_all(self.ranks)
        for p in self.ranks:
            self.collect(p)
        return {p.args.rank: dict(ev.stats) for p in self.ranks for ev in p.take(Stopped)[-1:]}


class DecodeEngine(_Ranks):
    """The decode engine's rank processes."""

    def __init__(self, ctx: Any, transport: str, engine_id: str, spec: ModelSpec, layout: EngineLayout, mode: Mode,
                 host: str, config: ConnectorConfig, fill_seed: int = 1001, max_lifetime: float = 600.0):
        super().__init__(ctx, "decode", transport, engine_id, spec, layout, mode, config, fill_seed, max_lifetime,
                         host=host)
        self.prefill_layouts: dict[str, EngineLayout] = {}
        self.results: dict[int, dict[str, dict[str, Any]]] = {r: {} for r in range(layout.world_size)}

    def start(self, timeout: float) -> None:
        for p in self.ranks:
            p.expect(rp.Ready, timeout)

    def connect(self, address: str, timeout: float) -> None:
        for p in self.ranks:
            p.send(rp.Connect(address, timeout))
        for p in self.ranks:
            got = p.expect((rp.Connected, rp.ConnectFailed), timeout + 5)
            if isinstance(got, rp.ConnectFailed):
                raise HandshakeRefused(f"decode rank {p.args.rank}: {got.error}")
            self.prefill_layouts[got.engine_id] = got.layout

    def receive(self, requests: list[rp.Incoming], timeout: float) -> None:
        self.broadcast(rp.Receive(requests), rp.Receiving, timeout)

    def collect(self, p: RankProcess) -> None:
        for ev in p.take(rp.Result):
            self.results[p.args.rank][ev.result.request_id] = msgspec.to_builtins(ev.result)

    def wait_results(self, ids: Sequence[str], timeout: float) -> bool:
        want = set(ids)
        return self._wait(lambda: all(want <= set(r) for r in self.results.values()), timeout)

    def regions(self, rank: int, timeout: float) -> list[np.ndarray]:
        return self.ranks[rank].call(rp.GetRegions(), rp.Regions, timeout).regions

    def decode(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Rank 0 gathers the other ranks' caches and decodes every request of `job`."""
        for p in self.ranks[1:]:
            p.send(rp.GetRegions())
        others = {p.args.rank: p.expect(rp.Regions, timeout).regions for p in self.ranks[1:]}
        return self.ranks[0].call(rp.Run(DECODE_JOB, job, others), rp.Ran, timeout).result

    def stop(self) -> None:
        stop_all(self.ranks)

"""Agents in another process: what the transport bench and tests use to put the two sides of a
transfer in two real processes.

`AgentHost` owns transport agents and the rank caches they registered and exposes plain
methods (create, alloc, metadata, connect, submit, wait, ...). `PeerProcess` runs an `AgentHost`
in a spawned child (`connector.rank_host`) and forwards each call as a typed message (one
Struct per method, its result converted to the method's return type), each with a deadline; the
same methods are called on a local `AgentHost` for the side in this process.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
import typing
from typing import Any, ClassVar, Union

import msgspec
import numpy as np
import torch

from kvbridge.connector.rank_host import Emit, HostProcess, one_line, random_fill

from kvbridge.core.layout import EngineLayout

from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.base import Handle, Runs, XferState

BACKENDS = {"shm": ("kvbridge.transport.shm", "ShmTransport"),
            "nixl": ("kvbridge.transport.nixl", "NixlTransport"),
            "mooncake": ("kvbridge.transport.mooncake", "MooncakeTransport")}


def create_transport(backend: str, name: str, **kwargs: Any):
    module, cls = BACKENDS[backend]
    return getattr(importlib.import_module(module), cls)(name, **kwargs)


class AgentHost:
    """Agents and their memory in one process."""

    def __init__(self) -> None:
        self.agents: dict[str, Any] = {}
        self.backend: dict[str, str] = {}
        self.caches: dict[str, RankCache] = {}
        self.before: dict[str, RankCache] = {}
        self.handles: dict[tuple[str, int], Handle] = {}
        self.scratch: dict[str, list[torch.Tensor]] = {}

    def pid(self) -> int:
        return os.getpid()

    def create(self, backend: str, name: str, **kwargs: Any) -> str:
        self.agents[name] = create_transport(backend, name, **kwargs)
        self.backend[name] = backend
        return name

    def alloc(self, name: str, spec: ModelSpec, layout: EngineLayout, rank: int, fill: str = "random",
              block_ids: tuple[tuple[int, ...], ...] | None = None, num_tokens: int = 0, seed: int = 0) -> int:
        """Allocate rank `rank`'s cache for agent `name` and register it; returns its region count.

        fill: "random" bytes, "pattern" (verify.fill_source over `block_ids`, `num_tokens`) on top
        of random bytes, or "const" (every byte `seed`).
        """
        from kvbridge.proofs import verify
        if self.backend[name] == "shm":
            from kvbridge.transport.shm import allocate_shared
            cache = allocate_shared(spec, layout, rank, name_prefix=name, fill=None)
        else:
            cache = RankCache.allocate(spec, layout, rank, fill=None)
        if fill == "const":
            for r in cache.byte_regions():
                r.fill_(seed)
        else:
            random_fill([cache], seed)
        if fill == "pattern":
            verify.fill_source([cache], block_ids, num_tokens)
        self.caches[name] = cache
        self.agents[name].register(cache.regions)
        return len(cache.regions)

    def alloc_bytes(self, name: str, nbytes: int, value: int) -> int:
        """A contiguous buffer of `nbytes` (every byte `value`) registered after the cache; its region index."""
        if self.backend[name] == "shm":
            from kvbridge.transport.shm import shared_bytes
            t = shared_bytes(nbytes, name)
        else:
            t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(value)
        self.scratch.setdefault(name, []).append(t)
        self.agents[name].register([t])
        return len(self.agents[name]._regions) - 1

    def check_bytes(self, name: str, index: int, value: int) -> bool:
        return bool((self.scratch[name][index] == value).all())

    def metadata(self, name: str) -> bytes:
        return self.agents[name].metadata()

    def connect(self, name: str, peer: str, metadata: bytes) -> None:
        self.agents[name].connect(peer, metadata)

    def set(self, name: str, **attrs: Any) -> None:
        for k, v in attrs.items():
            setattr(self.agents[name], k, v)

    def get(self, name: str, attr: str) -> Any:
        return getattr(self.agents[name], attr)

    def run_timed(self, batch: list[tuple[str, str, str, Runs]], timeout: float = 300.0) -> float:
        """Submit every (agent, peer, op, runs) at once, wait for all; seconds from first submit to last done."""
        t0 = time.perf_counter()
        hs = [(self.agents[a], self.agents[a].submit(peer, op, runs)) for a, peer, op, runs in batch]
        end = time.monotonic() + timeout
        for a, h in hs:  # sleeps on each completion: a polling thread would slow the posting ones
            if a.wait(h, end - time.monotonic()) == XferState.PENDING:
                raise TimeoutError(f"transfers still pending after {timeout} s")
        elapsed = time.perf_counter() - t0
        failed = [h.reason for _, h in hs if h.state != XferState.DONE]
        if failed:
            raise RuntimeError(f"transfer failed: {failed[0]}")
        return elapsed

    def run_at(self, batch: list[tuple[str, str, str, Runs]], start_at: float,
               timeout: float = 300.0) -> tuple[float, float]:
        """`run_timed` starting at `start_at` (CLOCK_MONOTONIC, shared by every process on the host).

        Returns (first submit, last done) on that clock, so a caller can time transfers posted by
        several processes at once as max(end) - min(start).
        """
        delay = start_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t0 = time.monotonic()
        self.run_timed(batch, timeout)
        return t0, time.monotonic()

    def submit(self, name: str, peer: str, op: str, runs: Runs, notify: bytes | None = None) -> int:
        h = self.agents[name].submit(peer, op, runs, notify)
        self.handles[(name, h.id)] = h
        return h.id

    def wait(self, name: str, ids: list[int], timeout: float = 60.0) -> list[tuple[str, str]]:
        """Wait until every handle is terminal or `timeout`; returns (state, reason) per handle."""
        agent, hs = self.agents[name], [self.handles[(name, i)] for i in ids]
        end = time.monotonic() + timeout
        return [(agent.wait(h, end - time.monotonic()).value, h.reason) for h in hs]

    def abort(self, name: str, hid: int) -> tuple[str, str]:
        h = self.handles[(name, hid)]
        self.agents[name].abort(h)
        return h.state.value, h.reason

    def notifications(self, name: str, count: int = 0, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        """Notifications received, waiting up to `timeout` until there are at least `count`."""
        out: list[tuple[str, bytes]] = []
        end = time.monotonic() + timeout
        while True:
            out.extend(self.agents[name].notifications())
            if len(out) >= count or time.monotonic() > end:
                return out
            time.sleep(0.002)

    def send_notification(self, name: str, peer: str, message: bytes) -> None:
        self.agents[name].send_notification(peer, message)

    def snapshot(self, name: str) -> None:
        from kvbridge.proofs.verify import clone_caches
        self.before[name] = clone_caches([self.caches[name]])[0]

    def verify(self, name: str, request: Request) -> list[str]:
        """Byte-exact check of this destination cache against the snapshot plus `request`'s tokens."""
        from kvbridge.proofs.verify import expected_destination, mismatch_report
        expected = self.before.pop(name)
        expected_destination([expected], request)
        return mismatch_report([self.caches[name]], [expected])

    def unchanged(self, name: str) -> list[str]:
        """Differences between the cache and its snapshot (a transfer that must not have landed)."""
        from kvbridge.proofs.verify import mismatch_report
        return mismatch_report([self.caches[name]], [self.before.pop(name)])

    def close_agent(self, name: str) -> None:
        self.agents[name].close()

    def close_all(self) -> None:
        for a in self.agents.values():
            a.close()
        self.agents.clear()
        self.caches.clear()
        self.scratch.clear()
        self.before.clear()
        self.handles.clear()


# -- the typed calls a `PeerProcess` sends: one Struct per `AgentHost` method, from its signature --
def _call_struct(method: Any) -> type:
    """A Struct tagged with the method's name whose fields are its parameters (typed by its
    annotations; `**kwargs` become `options`), with the method's return type as `returns`."""
    hints = typing.get_type_hints(method)
    fields: list[tuple] = []
    for name, param in list(inspect.signature(method).parameters.items())[1:]:
        if param.kind is param.VAR_KEYWORD:
            fields.append(("options", dict[str, Any], {}))
        elif param.default is param.empty:
            fields.append((name, hints[name]))
        else:
            fields.append((name, hints[name], param.default))
    struct = msgspec.defstruct("".join(w.title() for w in method.__name__.split("_")), fields,
                               tag=method.__name__, module=__name__)
    struct.returns = hints.get("return")
    return struct


class Crash(msgspec.Struct, tag="crash"):
    """Exit at once (code 17), as in a crash."""

    returns: ClassVar[Any] = None


FORWARDED = ("pid", "create", "alloc", "alloc_bytes", "check_bytes", "metadata", "connect", "set", "get", "run_timed",
             "run_at", "submit", "wait", "abort", "notifications", "send_notification", "snapshot", "verify",
             "unchanged", "close_agent")
CALLS: dict[str, type] = {name: _call_struct(getattr(AgentHost, name)) for name in FORWARDED} | {"crash": Crash}
Call = Union[tuple(CALLS.values())]


class Returned(msgspec.Struct, tag="returned"):
    value: Any = None


class Raised(msgspec.Struct, tag="raised"):
    error: str  # one line; the child goes on serving


class AgentService:  # pragma: no cover - runs in the child
    """An `AgentHost` answering typed calls (`rank_host.serve` runs it)."""

    requests = Call

    def __init__(self, args: Any, emit: Emit):
        torch.set_num_threads(1)
        self.host, self.emit = AgentHost(), emit

    def step(self) -> float:
        return 0.05  # nothing of its own to do: wait for the next call

    def handle(self, call: Any) -> None:
        if isinstance(call, Crash):
            os._exit(17)
        fields = msgspec.structs.asdict(call)
        fields |= fields.pop("options", {})  # the method's own **kwargs
        try:
            value = getattr(self.host, call.__struct_config__.tag)(**fields)
        except Exception as e:  # noqa: BLE001 - sent back and raised in the parent
            self.emit(Raised(one_line(e)))
            return
        self.emit(Returned(value))

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.host.close_all()


class PeerError(RuntimeError):
    """An `AgentHost` call failed in the child process."""


class PeerProcess:
    """An `AgentHost` in a spawned child; `call(method, ...)` runs it there (a typed call each)."""

    def __init__(self, start_timeout: float = 120.0):
        self._host = HostProcess("kvbridge.testing.peer:AgentService", None, Union[Returned, Raised],
                                 name="agent host", error_type=PeerError, timeout_type=TimeoutError)
        self.process = self._host.proc
        self.pid = self.call("pid", timeout=start_timeout)

    def call(self, method: str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
        self.begin(method, *args, **kwargs)
        try:
            return self.finish(timeout)
        except TimeoutError:
            raise TimeoutError(f"peer process {self.process.pid}: {method} took more than {timeout} s") from None

    def begin(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Start `method` in the child without waiting; `finish` collects its result."""
        kind = CALLS.get(method)
        if kind is None:
            raise AttributeError(f"AgentHost has no remote method {method!r}")
        if "options" in kind.__struct_fields__:  # the method takes **kwargs
            call: Any = kind(*args, options=kwargs)
        else:
            call = kind(*args, **kwargs)
        self._returns = kind.returns
        self._host.send(call)

    def finish(self, timeout: float = 120.0) -> Any:
        got = self._host.expect((Returned, Raised), timeout)
        if isinstance(got, Raised):
            raise PeerError(got.error)
        return None if self._returns is None else msgspec.convert(got.value, self._returns)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *a, **k: self.call(method, *a, **k)

    def kill(self) -> None:
        """SIGKILL the child (a crash: no cleanup runs there)."""
        self._host.kill()

    def close(self) -> None:
        if self.process.is_alive():
            self._host.ask_stop()
            self.process.join(30)
        self._host.stop(10)


def runs_between(plan, src_rank: int, dst_rank: int, op: str) -> Runs:
    """The runs of `plan` from source rank to destination rank, as the poster of `op` sees them."""
    m = (plan.src_rank == src_rank) & (plan.dst_rank == dst_rank)
    s = (plan.src_region[m], plan.src_offset[m])
    d = (plan.dst_region[m], plan.dst_offset[m])
    local, remote = (d, s) if op == "read" else (s, d)
    return Runs(*(np.ascontiguousarray(a, np.int64) for a in (*local, *remote, plan.length[m])))

"""One OS process per engine rank, driven by commands over a pipe.

Why processes and not threads: the point of the multi-process demo and of the fault tests is
that each rank owns its memory, its transport agent and its side-channel sockets the way a
serving engine's TP worker does, and that a rank can die (SIGKILL) without taking its peers
with it. Processes are started with `spawn` (safe with threads, numba and ZMQ in the parent;
the caller's script needs the usual `if __name__ == "__main__":` guard).

Start method: `forkserver` where the platform has it, with torch, transformers and kvbridge
preloaded into the fork server once; every rank process then forks from that clean,
single-threaded server in milliseconds instead of importing torch and transformers again
(seconds of CPU each, which on a two-core CI machine decides whether a test suite with dozens
of rank processes fits its budget). Like `spawn`, it never forks the caller's threads. Set
`KVBRIDGE_START_METHOD=spawn` to force `spawn`.

A rank process runs a loop: `Producer.progress` / `Consumer.progress` with a short timeout,
then any command waiting on its pipe. Everything it learns (its address, handshakes, releases,
request results, errors) is sent back as an event tuple. It exits on `stop`, when its parent
disappears, or after `max_lifetime` seconds, so a test that goes wrong cannot leave it behind.

`RankProcess` is the parent's handle: `send(cmd, ...)`, `expect(kind, timeout)` (every wait has a
deadline and fails fast, with the child's traceback, if the child reported an error or died),
`kill()`, `stop()`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kvbridge.errors import KVBridgeError


PRELOAD = ["torch", "numpy", "zmq", "msgspec", "kvbridge.connector.processes", "kvbridge.connector.producer",
           "kvbridge.connector.consumer", "kvbridge.transport.shm"]
PRELOAD_MODEL = ["kvbridge.proofs.hf", "kvbridge.proofs.decode_job"]
"""Added when a process will run a model (decode rank 0): transformers takes seconds to import."""


def process_context(model: bool = True) -> Any:
    """The multiprocessing context rank processes start from (see the module docstring).

    `model=False` leaves transformers out of the fork server (a prefill-only host). The fork
    server is one per process and keeps the preload of its first start.
    """
    method = os.environ.get("KVBRIDGE_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD + (PRELOAD_MODEL if model else []))
    return ctx


class RankProcessError(KVBridgeError, RuntimeError):
    """A rank process failed, died, or did not answer in time."""


class RankArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank process needs to build its connector (picklable for spawn)."""

    role: str  # "prefill" | "decode"
    engine_id: str
    rank: int
    transport: str
    spec: Any  # ModelSpec
    layout: Any  # EngineLayout
    mode: str = "pull"
    listen: str = "127.0.0.1:0"  # prefill: side-channel bind address
    host: str = "127.0.0.1"  # transport agent host (notification channel / data plane)
    config: Any = None  # ConnectorConfig
    fill_seed: int = 0  # the cache starts as random bytes from this seed
    max_lifetime: float = 600.0
    threads: int = 1


def _random_fill(cache: Any, seed: int) -> None:
    import torch
    gen = torch.Generator().manual_seed(seed)
    for r in cache.byte_regions():
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))


def _warm_copier() -> None:
    """Load the compiled run copier (numba's on-disk cache, its thread pool) before the first
    transfer, so that the first request's transfer time measures the transfer."""
    from kvbridge.transport.local import copy_runs
    buf = np.zeros(16, np.uint8)
    base = np.array([buf.ctypes.data], np.int64)
    one = np.zeros(1, np.int64)
    copy_runs(base, base, one, one, one, np.full(1, 8, np.int64), np.full(1, 8, np.int64))


def _regions_bytes(cache: Any) -> list[np.ndarray]:
    return [r.numpy().copy() for r in cache.byte_regions()]


def _rank_main(conn: Connection, args: RankArgs) -> None:  # pragma: no cover - runs in the child
    import torch
    torch.set_num_threads(args.threads)
    parent = os.getppid()
    born = time.monotonic()
    transport = None
    connector: Any = None
    try:
        from kvbridge.connector.config import ConnectorConfig
        from kvbridge.connector.transports import allocate_cache, make_transport
        config = args.config or ConnectorConfig()
        cache = allocate_cache(args.transport, args.spec, args.layout, args.rank,
                               name_prefix=f"{args.engine_id}-{args.role}")
        _random_fill(cache, args.fill_seed)
        _warm_copier()
        transport = make_transport(args.transport, f"{args.engine_id}/{args.rank}/{os.getpid()}", host=args.host,
                                   timeout_s=config.transfer_timeout)
        if args.role == "prefill":
            from kvbridge.connector.producer import Producer
            connector = Producer(args.engine_id, args.rank, cache, transport, listen=args.listen, mode=args.mode,
                                 config=config, on_release=lambda rid, why: conn.send(("released", rid, why)))
            conn.send(("ready", connector.address))
        else:
            from kvbridge.connector.consumer import Consumer
            connector = Consumer(args.engine_id, args.rank, cache, transport, mode=args.mode, config=config)
            conn.send(("ready", ""))
        handlers = _PREFILL if args.role == "prefill" else _DECODE
        seen_engines: set[str] = set()
        while True:
            if args.role == "prefill":
                connector.progress(0.002)
                for eng in connector.decode_engines:
                    if eng not in seen_engines:
                        seen_engines.add(eng)
                        conn.send(("handshake", eng))
            else:
                for res in connector.progress(0.002):
                    conn.send(("result", msgspec.to_builtins(res)))
            while conn.poll(0):
                cmd, *rest = conn.recv()
                if cmd == "stop":
                    conn.send(("stats", dict(connector.stats)))
                    return
                handlers[cmd](conn, connector, cache, *rest)
            if os.getppid() != parent or time.monotonic() - born > args.max_lifetime:
                return
    except (EOFError, BrokenPipeError):
        return
    except BaseException:  # noqa: BLE001 - reported to the parent, then the process exits
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        try:
            if connector is not None:
                connector.close()
        finally:
            if transport is not None:
                transport.close()


# -- commands (run in the child) -----------------------------------------------------------------
def _load(conn: Connection, producer: Any, cache: Any, regions: list[np.ndarray]) -> None:  # pragma: no cover
    import torch
    for dst, src in zip(cache.byte_regions(), regions):
        dst.copy_(torch.from_numpy(src))
    conn.send(("loaded",))


def _add(conn: Connection, producer: Any, cache: Any, requests: list[tuple]) -> None:  # pragma: no cover
    for rid, block_ids, num_tokens, first_token, lease in requests:
        producer.add_request(rid, block_ids, num_tokens, first_token, lease_seconds=lease)
    conn.send(("added", [r[0] for r in requests]))


def fill_rows(cache: Any, block_ids: Any, num_tokens: int, seed: int) -> None:
    """Fresh random bytes in rows [0, num_tokens) of the request's blocks, in every attention
    layer and component this rank holds: what a prefill forward pass writes. A decode rank
    writes them too (poison) before it receives, so bytes left from an earlier request in the
    same blocks cannot pass an integrity check."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    pos = np.arange(num_tokens, dtype=np.int64)
    for li, layer in enumerate(cache.spec.layers):
        if layer.is_recurrent or not num_tokens:
            continue
        ids = np.asarray(block_ids[cache.spec.layer_group[li]], dtype=np.int64)
        for ci in range(len(layer.components)):
            rows = cache.read_tokens(li, ci, ids, pos, as_int=True)  # [tokens, heads, dim] integers
            raw = torch.randint(0, 256, (*rows.shape[:-1], rows.shape[-1] * rows.element_size()),
                                dtype=torch.uint8, generator=gen)
            cache.write_tokens(li, ci, ids, pos, raw.view(rows.dtype))


def _fill_add(conn: Connection, producer: Any, cache: Any, requests: list[tuple]) -> None:  # pragma: no cover
    """`requests`: (id, block ids, num tokens, first token, lease seconds or None, fill seed)."""
    for rid, block_ids, num_tokens, first_token, lease, seed in requests:
        fill_rows(cache, block_ids, num_tokens, seed)
        producer.add_request(rid, block_ids, num_tokens, first_token, lease_seconds=lease)
    conn.send(("added", [r[0] for r in requests]))


def _directory(conn: Connection, producer: Any, cache: Any, addresses: list[str]) -> None:  # pragma: no cover
    producer.set_peer_addresses(addresses)
    conn.send(("directory_set",))


def _abort(conn: Connection, connector: Any, cache: Any, rid: str, reason: str) -> None:  # pragma: no cover
    conn.send(("aborted", rid, connector.abort(rid, reason)))


def _stats(conn: Connection, connector: Any, cache: Any) -> None:  # pragma: no cover
    conn.send(("stats", dict(connector.stats)))


def _figures(conn: Connection, connector: Any, cache: Any) -> None:  # pragma: no cover
    """This rank's open descriptors and what its transport agent holds (leak checks)."""
    from kvbridge.transport.agent import resource_figures
    conn.send(("figures", {"fds": len(os.listdir("/proc/self/fd")), **resource_figures()}))


def _connect(conn: Connection, consumer: Any, cache: Any, address: str, timeout: float) -> None:  # pragma: no cover
    try:
        engine = consumer.connect(address, timeout)
    except KVBridgeError as e:
        conn.send(("connect_failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("connected", engine, list(consumer.source_ranks(engine)),
               consumer.topology.get_engine_info(engine).layout.describe()))


def _receive(conn: Connection, consumer: Any, cache: Any, requests: list[tuple]) -> None:  # pragma: no cover
    """`requests`: (id, block ids, num tokens, timeout[, prefill engine id])."""
    for rid, block_ids, num_tokens, timeout, *engine in requests:
        consumer.receive(rid, block_ids, num_tokens=num_tokens, timeout=timeout,
                         engine_id=engine[0] if engine else None)
    conn.send(("receiving", [r[0] for r in requests]))


def _scrub_receive(conn: Connection, consumer: Any, cache: Any, requests: list[tuple]) -> None:  # pragma: no cover
    """`requests`: (id, block ids, num tokens, timeout, poison seed): poison the destination rows, then receive."""
    for rid, block_ids, num_tokens, timeout, seed in requests:
        fill_rows(cache, block_ids, num_tokens, seed)
        consumer.receive(rid, block_ids, num_tokens=num_tokens, timeout=timeout)
    conn.send(("receiving", [r[0] for r in requests]))


def _regions(conn: Connection, consumer: Any, cache: Any) -> None:  # pragma: no cover
    conn.send(("regions", _regions_bytes(cache)))


def _decode(conn: Connection, consumer: Any, cache: Any, job: dict) -> None:  # pragma: no cover
    from kvbridge.proofs.decode_job import run_decode_job
    conn.send(("decoded", run_decode_job(cache, job)))


_PREFILL = {"load": _load, "add": _add, "fill_add": _fill_add, "directory": _directory, "abort": _abort,
            "stats": _stats, "figures": _figures}
_DECODE = {"connect": _connect, "receive": _receive, "scrub_receive": _scrub_receive, "abort": _abort,
           "stats": _stats, "regions": _regions, "decode": _decode, "figures": _figures}


# -- the parent's handle ---------------------------------------------------------------------------
class RankProcess:
    """Parent-side handle of one rank process (see the module docstring)."""

    def __init__(self, args: RankArgs, context: Any = None):
        ctx = context or process_context()
        self.args = args
        self.name = f"{args.role} {args.engine_id!r} rank {args.rank}"
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child, args), name=f"kvbridge-{args.role}-{args.rank}",
                                daemon=True)
        self.proc.start()
        child.close()
        self.events: deque[tuple] = deque()
        self.error: str | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, *cmd: Any) -> None:
        try:
            self.conn.send(cmd)
        except (BrokenPipeError, OSError) as e:
            raise RankProcessError(f"{self.name}: cannot send {cmd[0]!r}: {e}{self._why()}") from None

    def pump(self, timeout: float = 0.0) -> None:
        """Move every event the child sent into `events` (waits at most `timeout` for the first)."""
        try:
            ready = self.conn.poll(timeout)
            while ready:
                event = self.conn.recv()
                if event[0] == "error":
                    self.error = event[1]
                self.events.append(event)
                ready = self.conn.poll(0)
        except (EOFError, OSError):
            if timeout > 0:
                time.sleep(min(timeout, 0.01))

    def take(self, kind: str) -> list[tuple]:
        """Remove and return the buffered events of `kind`."""
        out = [e for e in self.events if e[0] == kind]
        if out:
            self.events = deque(e for e in self.events if e[0] != kind)
        return out

    def expect(self, kind: str, timeout: float) -> tuple:
        """The next event of `kind`; raises `RankProcessError` on error, death or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e[0] == kind:
                    del self.events[i]
                    return e
            if self.error is not None:
                raise RankProcessError(f"{self.name} failed:\n{self.error}")
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise RankProcessError(f"{self.name} exited (code {self.proc.exitcode}) before sending {kind!r}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankProcessError(f"{self.name} sent no {kind!r} within {timeout:.1f} s")
            self.pump(min(left, 0.05))

    def kill(self) -> None:
        """SIGKILL: the rank dies without any cleanup, as in a crash."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)
        self._reap()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the rank to close cleanly; kill it if it does not exit in time. Idempotent."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2)
        if self.proc.is_alive():
            self.kill()
        self.pump(0)
        self.conn.close()
        self._reap()

    def _reap(self) -> None:
        """Once the rank is gone, free what it leaves behind here: the /dev/shm segments it could not
        unlink (killed), and this process's ends of its start pipes (two descriptors per rank, else
        held until the garbage collector finds the process object; `proc.exitcode` stays readable)."""
        if self.proc.pid is None or self.proc.exitcode is None:
            return
        if self.args.transport == "shm":
            from kvbridge.transport.shm import reap_stale_segments
            reap_stale_segments(self.proc.pid)
        popen = getattr(self.proc, "_popen", None)
        if popen is not None:
            popen.close()

    def _why(self) -> str:
        if self.error:
            return f"\n{self.error}"
        if not self.proc.is_alive():
            return f" (process exited with code {self.proc.exitcode})"
        return ""


def stop_all(processes: list[RankProcess], timeout: float = 5.0) -> None:
    """Stop every process: all are asked first, then each is joined (bounded)."""
    for p in processes:
        if p.proc.is_alive():
            try:
                p.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
    deadline = time.monotonic() + timeout
    for p in processes:
        p.proc.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        p.stop(0.5)


__all__ = ["RankArgs", "RankProcess", "RankProcessError", "fill_rows", "stop_all"]

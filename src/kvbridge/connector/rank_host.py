"""One typed way to host a rank (or a set of transport agents) in another process.

Why: a rank that owns its memory, its transport agent and its sockets the way a serving
engine's worker does, and that can die without taking its peers with it, runs in a process of
its own: the multi-process proof and the fault tests (`connector.processes`), the transport
benches (`testing.peer`), the vLLM sidecar. They all speak the same way here:

* requests and events are msgspec Structs in tagged unions, msgpack-encoded (numpy arrays
  included, as dtype, shape and bytes), over one channel: a `multiprocessing` pipe
  (`PipeChannel`) or length-prefixed frames on a pair of file descriptors (`StreamChannel`, for a
  child whose stdin/stdout is the link, as the vLLM worker's sidecar);
* the child runs a `Service` under `serve`: one bounded `step` of its own work, then every
  request waiting; it ends on `Stop` (answering `Stopped` with its counters), on end of input,
  when its parent disappears or after `max_lifetime` seconds, so a test that goes wrong cannot
  leave it behind; whatever it raises reaches the parent as one line (`Failed`), the traceback
  going to the child's stderr;
* the parent's handle (`Peer`, `HostProcess`) buffers events and waits for one kind with a
  deadline, failing fast with the child's one-line error or its exit code.

What the service is comes from the caller as an import path ("package.module:Class"), so the
arrow points from the caller (a proof, a bench) to this engine facility, never back. The
cache warm-up and random fills every hosted rank does are written once here too.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import select
import signal
import struct
import sys
import time
import traceback
import typing
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, Union

import msgspec
import numpy as np

from kvbridge.errors import KVBridgeError

log = logging.getLogger("kvbridge.connector.rank_host")


class HostError(KVBridgeError, RuntimeError):
    """A hosted process failed, died, or did not answer in time."""


# -- the messages every channel carries ---------------------------------------------------------
class Stop(msgspec.Struct, tag="stop"):
    """Parent -> child: close cleanly and exit."""


class Stopped(msgspec.Struct, tag="stopped"):
    """Child -> parent: the last event, with the service's counters."""

    stats: dict[str, int] = {}


class Failed(msgspec.Struct, tag="failed"):
    """Child -> parent: the service raised; `error` is one line (type: message)."""

    error: str


def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def union_of(*types: Any) -> Any:
    """One tagged union of the given Structs and unions (flattened)."""
    members: list[Any] = []
    for t in types:
        for a in (typing.get_args(t) if typing.get_origin(t) is Union else (t,)):
            if a not in members:
                members.append(a)
    return Union[tuple(members)]


def resolve(path: str) -> Any:
    """The object named by "package.module:attribute"."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise HostError(f"import path must be 'package.module:attribute', got {path!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise HostError(f"cannot load {path!r}: {one_line(e)}") from None


# -- encoding -------------------------------------------------------------------------------------
def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return (arr.dtype.str, list(arr.shape), arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    raise NotImplementedError(f"cannot decode {kind}")


class Codec:
    """msgpack for one union of Structs, numpy arrays included."""

    def __init__(self, receives: Any):
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._dec = msgspec.msgpack.Decoder(receives, dec_hook=_dec_hook)

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes) -> Any:
        return self._dec.decode(data)


class PipeChannel:
    """Typed messages over a `multiprocessing` connection."""

    def __init__(self, conn: Any, receives: Any):
        self.conn, self.codec, self.eof = conn, Codec(receives), False

    def send(self, msg: Any) -> None:
        self.conn.send_bytes(self.codec.encode(msg))

    def recv(self, timeout: float = 0.0) -> list[Any]:
        """Every message that has arrived, waiting at most `timeout` s for the first."""
        out: list[Any] = []
        try:
            ready = self.conn.poll(timeout)
            while ready:
                out.append(self.codec.decode(self.conn.recv_bytes()))
                ready = self.conn.poll(0)
        except (EOFError, OSError):
            self.eof = True
        return out

    def close(self) -> None:
        self.conn.close()


_HEADER = struct.Struct("<I")


class StreamChannel:
    """Typed messages as length-prefixed frames: read from one file descriptor (made non-blocking),
    written to a binary file object (a child's stdin, or the parent's end of its stdout).

    `never_block`: the writer's side is an engine step (the vLLM worker's sidecar client). Frames
    go to an outbox and then as much of it as the pipe takes in one write; the rest waits for the
    next `send`, `recv` or `flush_out`. A reader that is starved, stopped or busy in a handshake
    then delays its own commands, never the step that sent them (a blocking write of a full pipe
    would stall the step for as long as the reader does not read)."""

    def __init__(self, read_fd: int, write: Any, receives: Any, *, never_block: bool = False):
        self.fd, self.write, self.codec, self.buf, self.eof = read_fd, write, Codec(receives), b"", False
        self.never_block, self.out = never_block, bytearray()
        os.set_blocking(read_fd, False)
        if never_block:
            os.set_blocking(write.fileno(), False)

    def send(self, msg: Any) -> None:
        self.send_all((msg,))

    def send_all(self, msgs: Any) -> None:
        """Every message, in order; with `never_block` in one write of the outbox (what a step
        sends goes as one batch)."""
        frames = b"".join(_HEADER.pack(len(d)) + d for d in map(self.codec.encode, msgs))
        if not self.never_block:
            self.write.write(frames)
            self.write.flush()
            return
        self.out += frames
        self.flush_out()

    def flush_out(self) -> int:
        """Write what the pipe takes now (never waits); returns the bytes still in the outbox."""
        while self.out:
            try:
                n = os.write(self.write.fileno(), self.out)
            except BlockingIOError:
                break
            del self.out[:n]
        return len(self.out)

    def recv(self, timeout: float = 0.0) -> list[Any]:
        if self.out:
            try:
                self.flush_out()
            except OSError:  # the reader is gone: its end of input says so
                self.out.clear()
        if not self.eof and (timeout <= 0 or select.select([self.fd], [], [], timeout)[0]):
            while True:
                try:
                    chunk = os.read(self.fd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    self.eof = True
                    break
                self.buf += chunk
        out = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + n:
                break
            out.append(self.codec.decode(self.buf[_HEADER.size:_HEADER.size + n]))
            self.buf = self.buf[_HEADER.size + n:]
        return out

    def close(self) -> None:
        try:
            self.write.close()
        except OSError:
            pass


# -- the child side -------------------------------------------------------------------------------
class Service(Protocol):
    """What `serve` runs: requests in, events out through the `emit` it was built with."""

    def step(self) -> float:
        """One bounded round of the service's own work; returns how long `serve` may then wait
        for the next request (0 when it has work in flight)."""

    def handle(self, request: Any) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def serve(channel: Any, service: Service, *, stop: tuple[type, ...] = (Stop,), parent: int | None = None,
          max_lifetime: float | None = None) -> None:
    """Run `service` until `Stop` (answered with `Stopped`), end of input, the parent's death or
    `max_lifetime`; closes the service in every case."""
    born = time.monotonic()
    try:
        while True:
            for msg in channel.recv(service.step()):
                if isinstance(msg, stop):
                    channel.send(Stopped(dict(service.stats())))
                    return
                service.handle(msg)
            if channel.eof or (parent is not None and os.getppid() != parent):
                return
            if max_lifetime is not None and time.monotonic() - born > max_lifetime:
                return
    finally:
        service.close()


def report_failure(channel: Any, e: BaseException) -> None:
    """The traceback to stderr, one line to the parent (if it still listens)."""
    log.error("hosted service failed:\n%s", traceback.format_exc())
    try:
        channel.send(Failed(one_line(e)))
    except Exception:  # noqa: BLE001 - the parent is gone
        pass


def _host_main(conn: Any, target: str, args: Any, max_lifetime: float | None) -> None:  # pragma: no cover
    parent = os.getppid()
    cls = resolve(target)
    channel = PipeChannel(conn, union_of(cls.requests, Stop))
    try:
        service = cls(args, channel.send)
    except BaseException as e:  # noqa: BLE001
        report_failure(channel, e)
        return
    try:
        serve(channel, service, parent=parent, max_lifetime=max_lifetime)
    except (EOFError, BrokenPipeError):
        return
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then the process exits
        report_failure(channel, e)


# -- the parent side ------------------------------------------------------------------------------
class Peer:
    """The parent's end of a hosted process: buffered events, waits with deadlines."""

    def __init__(self, channel: Any, name: str, error_type: type[Exception] = HostError,
                 timeout_type: type[Exception] | None = None):
        self.channel, self.name, self.error_type = channel, name, error_type
        self.timeout_type = timeout_type or error_type  # what a missed deadline raises
        self.inbox: deque[Any] = deque()
        self.error: str | None = None

    def _running(self) -> bool:
        raise NotImplementedError

    def exit_code(self) -> int | None:
        raise NotImplementedError

    def send(self, msg: Any) -> None:
        try:
            self.channel.send(msg)
        except (BrokenPipeError, OSError, ValueError) as e:
            raise self.error_type(f"{self.name}: cannot send {type(msg).__name__}: {e}{self._why()}") from None

    def pump(self, timeout: float = 0.0) -> None:
        """Move every event the child sent into `inbox` (waits at most `timeout` for the first)."""
        got = self.channel.recv(timeout)
        for ev in got:
            if isinstance(ev, Failed):
                self.error = ev.error
            self.inbox.append(ev)
        if not got and self.channel.eof and timeout > 0:
            time.sleep(min(timeout, 0.01))

    def take(self, kind: type | tuple[type, ...]) -> list[Any]:
        """Remove and return the buffered events of `kind`."""
        out = [e for e in self.inbox if isinstance(e, kind)]
        if out:
            self.inbox = deque(e for e in self.inbox if not isinstance(e, kind))
        return out

    def expect(self, kind: type | tuple[type, ...], timeout: float) -> Any:
        """The next event of `kind`; raises on the child's error, its death or the deadline."""
        deadline = time.monotonic() + timeout
        what = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        while True:
            for i, e in enumerate(self.inbox):
                if isinstance(e, kind):
                    del self.inbox[i]
                    return e
            if self.error is not None:
                raise self.error_type(f"{self.name} failed: {self.error}")
            if not self._running():
                before = len(self.inbox)
                self.pump(0)
                if len(self.inbox) > before:
                    continue  # what it sent before exiting
                raise self.error_type(f"{self.name} exited (code {self.exit_code()}) before sending {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.timeout_type(f"{self.name} sent no {what} within {timeout:.1f} s")
            self.pump(min(left, 0.05))

    def call(self, request: Any, kind: type | tuple[type, ...], timeout: float) -> Any:
        self.send(request)
        return self.expect(kind, timeout)

    def _why(self) -> str:
        if self.error:
            return f": {self.error}"
        if not self._running():
            return f" (process exited with code {self.exit_code()})"
        return ""


class HostProcess(Peer):
    """A `Service` (named by import path) in a child process of `context`, over a pipe."""

    def __init__(self, target: str, args: Any, events: Any, *, context: Any = None, name: str = "",
                 max_lifetime: float | None = None, error_type: type[Exception] = HostError,
                 timeout_type: type[Exception] | None = None):
        ctx = context or mp.get_context("spawn")
        conn, child = ctx.Pipe()
        name = name or target
        self.proc = ctx.Process(target=_host_main, args=(child, target, args, max_lifetime),
                                name=f"kvbridge-{name.replace(' ', '-')}"[:60], daemon=True)
        self.proc.start()
        child.close()
        super().__init__(PipeChannel(conn, union_of(events, Stopped, Failed)), name, error_type, timeout_type)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    _running = alive

    def exit_code(self) -> int | None:
        return self.proc.exitcode

    def ask_stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.channel.send(Stop())
            except (BrokenPipeError, OSError):
                pass

    def kill(self) -> None:
        """SIGKILL: the child dies without any cleanup, as in a crash."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)
        self._reap()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the child to close cleanly; kill it if it does not exit in time. Idempotent."""
        if self.proc.is_alive():
            self.ask_stop()
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2)
        if self.proc.is_alive():
            self.kill()
        self.pump(0)
        self.channel.close()
        self._reap()

    def _reap(self) -> None:
        """Once the child is gone, close this process's ends of its start pipes (else held until the
        garbage collector finds the process object; `proc.exitcode` stays readable)."""
        if self.proc.pid is None or self.proc.exitcode is None:
            return
        popen = getattr(self.proc, "_popen", None)
        if popen is not None:
            popen.close()


def stop_all(processes: list[HostProcess], timeout: float = 5.0) -> None:
    """Stop every process: all are asked first, then each is joined (bounded)."""
    for p in processes:
        p.ask_stop()
    deadline = time.monotonic() + timeout
    for p in processes:
        p.proc.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        p.stop(0.5)


# -- what every hosted rank does before its first transfer ----------------------------------------
def warm_copier() -> None:
    """Load the compiled run copier (numba's on-disk cache, its thread pool) before the first
    transfer, so that the first request's transfer time measures the transfer."""
    from kvbridge.transport.copy import copy_runs
    buf = np.zeros(16, np.uint8)
    base = np.array([buf.ctypes.data], np.int64)
    one = np.zeros(1, np.int64)
    copy_runs(base, base, one, one, one, np.full(1, 8, np.int64), np.full(1, 8, np.int64))


def random_fill(caches: list[Any], seed: int) -> None:
    """Every byte of the caches random, from one generator seeded `seed` (reproducible in the
    parent, which can then tell what a rank started with)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    for c in caches:
        for r in c.byte_regions():
            r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))


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


def regions_bytes(cache: Any) -> list[np.ndarray]:
    return [r.numpy().copy() for r in cache.byte_regions()]


def stderr_logging(prefix: str) -> None:
    """Log lines of a hosted child on its stderr (stdout may be its channel)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"({prefix} pid=%(process)d) %(levelname)s %(asctime)s %(message)s",
                        datefmt="%m-%d %H:%M:%S")


Emit = Callable[[Any], None]

__all__ = ["Codec", "Emit", "Failed", "HostError", "HostProcess", "Peer", "PipeChannel", "Service", "Stop",
           "Stopped", "StreamChannel", "fill_rows", "one_line", "random_fill", "regions_bytes", "report_failure",
           "resolve", "serve", "stderr_logging", "stop_all", "union_of", "warm_copier"]

"""One thread that makes a rank's store calls, so an engine step never waits on the store past a deadline.

Why: Mooncake's calls have no deadline (a stopped master blocks them for as long as it is
stopped) but release the GIL while they wait, so a call on another thread leaves the engine
free. The engine submits a `Call` and waits for it only as long as its deadline allows; a call
it stops waiting for is `abandon`ed. The catch is the device: a load that finishes after its
request was handed back for recompute must not write blocks vLLM has given to someone else,
and a store must not read them. So every touch of device memory happens inside
`Call.device_access()`, which yields False once the call is abandoned, and `abandon` waits for
a touch in progress (a local copy, bounded) before it returns. After `abandon`, the call never
touches the device again, however late the store answers.

Calls run one at a time, in order (the staging memory they share has one user at a time); the
queue is bounded, and a call that does not fit is refused (`submit` returns None: a store is
dropped, a lookup or load is a miss). A thread whose work may wait (stores: a cache's writes)
can step aside for the engine's forward with `lower_priority`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Call:
    """One submitted function: its result or error once `done`, and the gate for device memory."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._device = threading.Lock()
        self.device_released = threading.Event()
        """Set by a call that reads no more device memory (a store putting what it already copied)."""

    @contextlib.contextmanager
    def device_access(self) -> Iterator[bool]:
        """`with call.device_access() as ok:` touch device memory only when ok."""
        with self._device:
            yield not self.abandoned

    def abandon(self, wait: bool = True) -> None:
        """The engine no longer waits: from now on the call leaves device memory alone.

        `wait=False` for a call that only *reads* device memory (a store): the flag is set at
        once, without waiting for a copy in progress, and the call checks it again after each
        copy (`still_allowed`) and drops what it read if it was abandoned meanwhile: the engine
        thread never waits on a lower-priority store thread's copy (priority inversion)."""
        if not wait:
            self.abandoned = True
            return
        with self._device:
            self.abandoned = True

    def still_allowed(self) -> bool:
        """After a read of device memory: whether the call was not abandoned during it."""
        return not self.abandoned

    def wait(self, timeout: float) -> bool:
        return self.done.wait(max(0.0, timeout))

    def age(self) -> float:
        return time.monotonic() - self.submitted


class PoolThread:
    """A daemon thread running submitted calls in order (see the module)."""

    def __init__(self, name: str, max_queue: int = 256):
        self._queue: queue.Queue[Call | None] = queue.Queue(maxsize=max_queue)
        self.current: Call | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Call | None:
        """Queue `fn(call, *args)`; None when the queue is full or the thread closed."""
        if self._closed:
            return None
        call = Call(fn, args)
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            return None
        return call

    def lower_priority(self, nice: int) -> bool:
        """From the thread itself: raise its nice value by `nice` (Linux schedules threads, so only
        this thread, and threads it starts from now on, step aside; no privilege needed to lower
        one's own priority). False where the platform has no per-thread priority."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("lower_priority is called from the pool thread itself")
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except (AttributeError, OSError):
            return False
        return True

    def busy_for(self) -> float:
        """Seconds the running call has run (0 when idle): a stuck store shows here."""
        c = self.current
        return 0.0 if c is None or c.started is None else time.monotonic() - c.started

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            self.current = call
            call.started = time.monotonic()
            try:
                if not call.abandoned:
                    call.result = call.fn(call, *call.args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, never raised in the thread
                call.error = e
            finally:
                self.current = None
                call.done.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking calls; wait `timeout` for the running one (a hung store call is left behind:
        the thread is a daemon)."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                c = self._queue.get_nowait()
            except queue.Empty:
                break
            if c is not None:
                c.abandon()
                c.done.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout)


class Prober:
    """While `breaker` is open, probe the store with `probe` on `thread` once its backoff has passed.

    Why a thread of its own: an idle engine takes no steps, so a breaker probed only from the
    engine's hooks would stay open until a request came, and that request would miss the pool
    although it had been back for minutes."""

    def __init__(self, thread: PoolThread, breaker: Any, probe: Callable[[Call], Any], timeout: float,
                 name: str = "kvbridge-pool-probe"):
        self._thread, self._breaker, self._probe, self._timeout = thread, breaker, probe, timeout
        self._stop = threading.Event()
        self._runner = threading.Thread(target=self._run, name=name, daemon=True)
        self._runner.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            if self._breaker.is_closed or not self._breaker.allow():
                continue
            call = self._thread.submit(self._probe)
            if call is None:
                self._breaker.failure("the pool thread is behind")
            elif not call.wait(self._timeout):
                call.abandon()
                self._breaker.failure(f"no answer within {self._timeout:.1f} s")
            elif call.error is not None:
                self._breaker.failure(one_line(call.error))
            else:
                self._breaker.success()

    def close(self) -> None:
        self._stop.set()
        self._runner.join(1.0)


def one_line(error: BaseException) -> str:
    """An error as one bounded line (for logs and breaker reasons)."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


__all__ = ["Call", "PoolThread", "Prober", "one_line"]

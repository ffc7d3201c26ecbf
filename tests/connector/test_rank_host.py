"""`connector.rank_host`: a service in a real child process, typed both ways; deadlines, one-line
errors, clean shutdown, and the typed frames the vLLM sidecar speaks over a pipe."""

from __future__ import annotations

import os
import time
from typing import Any, Union

import msgspec
import numpy as np
import pytest

from kvbridge.connector.rank_host import (Failed, HostError, HostProcess, Stopped, StreamChannel, one_line, resolve,
                                          stop_all)


class Echo(msgspec.Struct, tag="echo"):
    values: np.ndarray
    note: str = ""


class Boom(msgspec.Struct, tag="boom"):
    message: str


class Echoed(msgspec.Struct, tag="echoed"):
    values: np.ndarray
    pid: int


class EchoService:
    """Doubles arrays; raises on `Boom`; counts what it handled."""

    requests = Union[Echo, Boom]

    def __init__(self, args: Any, emit) -> None:
        self.emit, self.count = emit, 0

    def step(self) -> float:
        return 0.01

    def handle(self, req: Any) -> None:
        if isinstance(req, Boom):
            raise ValueError(f"asked to fail:\n{req.message}")
        self.count += 1
        self.emit(Echoed(req.values * 2, os.getpid()))

    def stats(self) -> dict[str, int]:
        return {"handled": self.count}

    def close(self) -> None:
        pass


def _host(**kw) -> HostProcess:
    return HostProcess("test_rank_host:EchoService", None, Echoed, name="echo", **kw)


def test_typed_round_trip_and_clean_stop() -> None:
    p = _host()
    try:
        values = np.arange(12, dtype=np.int64).reshape(3, 4)
        got = p.call(Echo(values), Echoed, 60)
        assert got.pid == p.pid != os.getpid()
        assert got.values.dtype == np.int64 and got.values.shape == (3, 4)
        assert np.array_equal(got.values, values * 2)
        stop_all([p], timeout=120)  # returns when it exits; a starved host may take more than the default 5 s
        assert p.take(Stopped) == [Stopped({"handled": 1})]
        assert p.proc.exitcode == 0
    finally:
        p.stop()


def test_a_failure_reaches_the_parent_as_one_line_and_the_child_exits() -> None:
    p = _host()
    try:
        p.call(Echo(np.zeros(1)), Echoed, 60)
        p.send(Boom("two\nlines"))
        with pytest.raises(HostError, match=r"^echo failed: ValueError: asked to fail: two lines$"):
            p.expect(Echoed, 10)
        p.proc.join(10)
        assert not p.alive()
    finally:
        p.stop()


def test_deadline_and_death_are_named() -> None:
    p = _host()
    try:
        p.call(Echo(np.zeros(1)), Echoed, 60)
        t0 = time.monotonic()
        with pytest.raises(HostError, match="sent no Echoed within 0.2 s"):
            p.expect(Echoed, 0.2)
        assert time.monotonic() - t0 < 2
        p.kill()
        with pytest.raises(HostError, match=r"exited \(code -9\) before sending Echoed"):
            p.expect(Echoed, 5)
    finally:
        p.stop()


def test_stream_channel_frames_survive_partial_reads() -> None:
    r, w = os.pipe()
    with os.fdopen(w, "wb", buffering=0) as out:
        tx = StreamChannel(os.pipe()[0], out, Union[Echo, Failed])
        rx = StreamChannel(r, None, Union[Echo, Failed])
        tx.send(Echo(np.ones(3, np.float32), "a"))
        tx.send(Failed("x"))
        got = rx.recv(1.0)
        while len(got) < 2:
            got += rx.recv(1.0)
    assert got[0].note == "a" and np.array_equal(got[0].values, np.ones(3, np.float32)) and got[1] == Failed("x")
    assert rx.recv(0.1) == [] and rx.eof


def test_a_never_blocking_writer_keeps_going_while_its_reader_does_not_read() -> None:
    """The vLLM worker sends from its engine step: a reader that does not read (starved, stopped)
    fills the pipe, and a blocking write would hold the step until it reads. Here the writer sends
    4 MiB into a 64 KiB pipe nobody reads, on a thread; every send returns (the rest waits in the
    outbox), and once the reader reads, every frame arrives, in order."""
    import threading

    r, w = os.pipe()
    out = os.fdopen(w, "wb", buffering=0)
    tx = StreamChannel(os.pipe()[0], out, Union[Echo, Failed], never_block=True)
    rx = StreamChannel(r, None, Union[Echo, Failed])
    batches = [[Echo(np.full(256, i * 4 + j, np.float32), str(i * 4 + j)) for j in range(4)] for i in range(1024)]
    sender = threading.Thread(target=lambda: [tx.send_all(b) for b in batches], daemon=True)
    sender.start()
    sender.join(120)  # a liveness bound, not a speed one: a blocking write never returns at all
    assert not sender.is_alive(), "a send blocked on a reader that does not read"
    assert len(tx.out) > 3 << 20  # the pipe took at most its buffer; the rest waits
    got: list[Any] = []
    while len(got) < 4096:
        tx.flush_out()
        got += rx.recv(1.0)
    assert tx.flush_out() == 0
    assert [g.note for g in got] == [str(k) for k in range(4096)]
    assert all(np.array_equal(g.values, np.full(256, k, np.float32)) for k, g in enumerate(got))
    out.close()


def test_import_paths_are_checked() -> None:
    assert resolve("test_rank_host:EchoService") is EchoService
    with pytest.raises(HostError, match="package.module:attribute"):
        resolve("no_colon")
    with pytest.raises(HostError, match="cannot load 'test_rank_host:Nope'"):
        resolve("test_rank_host:Nope")
    assert one_line(ValueError("a\n  b")) == "ValueError: a b"

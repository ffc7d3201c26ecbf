"""An idle engine step pauses until its sidecar reports a transfer's end (issue 31): the poke from
another process ends the pause, nothing else does, a flood is one wake, and where the socket
cannot be had the step keeps the old fixed pace."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from kvbridge.integrations.vllm.idle_wake import IdleWait, IdleWaker, wake_address


def _engine() -> str:
    return f"test-idle-{os.getpid()}-{time.monotonic_ns()}"


def test_a_poke_from_another_process_ends_the_pause_and_only_a_poke_does():
    engine = _engine()
    idle = IdleWait(engine)
    try:
        assert idle.wakeable
        assert idle.wait(0.0, 0.05) is False  # nobody poked: the whole pause, no wake
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(idle.wait(0.0, 120.0)))
        waiter.start()
        code = f"from kvbridge.integrations.vllm.idle_wake import IdleWaker; IdleWaker({engine!r}).poke()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        waiter.join(100)  # far below the pause: only the poke can have ended it
        assert not waiter.is_alive() and result == [True]
    finally:
        idle.close()


def test_a_flood_of_pokes_is_one_wake_and_a_poke_for_another_engine_is_none():
    engine = _engine()
    idle = IdleWait(engine)
    waker, stranger = IdleWaker(engine), IdleWaker(engine + "-other")
    try:
        for _ in range(5000):  # more than the socket queues: the rest are dropped, never an error
            waker.poke()
        assert idle.wait(0.0, 0.05) is True
        assert idle.wait(0.0, 0.05) is False  # drained in one pass: the flood cost one step
        stranger.poke()
        assert idle.wait(0.0, 0.05) is False
    finally:
        idle.close()
        waker.close()
        stranger.close()


def test_a_taken_name_falls_back_to_the_fixed_pace_and_a_lonely_poke_is_harmless():
    engine = _engine()
    first, second = IdleWait(engine), IdleWait(engine)
    try:
        assert first.wakeable and not second.wakeable
        assert second.wait(0.001, 60.0) is False  # no socket: the minimum pace only, never the maximum
    finally:
        first.close()
        second.close()
    IdleWaker(_engine()).poke()  # nobody bound: no error


def test_the_address_is_bounded_and_names_no_path_whatever_the_engine_id():
    for engine in ("", "x" * 100_000, "../../etc/passwd", "\0\n\t"):
        address = wake_address(engine)
        assert address.startswith(b"\0kvbridge-idle-") and len(address) < 108

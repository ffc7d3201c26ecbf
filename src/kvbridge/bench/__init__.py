"""Benchmarks beside the library: local executor, transports, offload, serving, the pool.
"""

from __future__ import annotations

import signal
import sys
import threading


def exit_on_sigterm() -> None:
    """Make SIGTERM (`kill`, `timeout`) raise SystemExit in the main thread: the serving
    benchmarks stop the fleets, routers and masters they started in `finally` blocks, which a
    SIGTERM's default action skips, leaving vLLM instances running on a shared host."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


__all__ = ["exit_on_sigterm"]

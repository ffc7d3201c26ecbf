"""Transports execute plans; they know nothing about models.

- `cache`: `RankCache`, one rank's regions as torch tensors (what every engine registers).
- `local`: one process (`LocalExecutor`, `execute_plan`, the compiled run copier `copy_runs`).
- `base`: the `Transport` protocol every engine agent implements.
- `agent`: what the engine agents share (validation, worker threads, deadlines, abort, staging).
- `shm`, `nixl`, `mooncake`: the agents (import them directly; the engines are optional extras).
- `notify`: the ZMQ channel for notifications and staging control.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"LocalExecutor": "kvbridge.transport.local",
                                      "execute_plan": "kvbridge.transport.local",
                                      "RankCache": "kvbridge.transport.cache"})

if TYPE_CHECKING:
    from kvbridge.transport.cache import RankCache
    from kvbridge.transport.local import LocalExecutor, execute_plan

__all__ = ["LocalExecutor", "RankCache", "execute_plan"]

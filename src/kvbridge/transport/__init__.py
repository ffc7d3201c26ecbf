"""Transports execute plans; they know nothing about models.

- `cache`: `RankCache`, one rank's regions as torch tensors (what every engine registers).
- `copy`: every compiled copy kernel (`copy_runs` parallel, `copy_addresses` serial or parallel).
- `local`: one process (`LocalExecutor`, `execute_plan`).
- `base`: the `Transport` protocol every engine agent implements.
- `agent`: what the engine agents share (regions, metadata, peers, handles, worker and service
  threads); `direct` and `staging`: the two ways a transfer moves (mixins of `Agent`).
- `backoff`, `frame_auth`, `peer_meta`: waiting without spinning, signed frames, peer metadata bounds.
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

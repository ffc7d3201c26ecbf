"""Transports execute plans; they know nothing about models.

- `local`: one process (`LocalExecutor`, `execute_plan`, the compiled run copier `copy_runs`).
- `base`: the `Transport` protocol every engine agent implements.
- `agent`: what the engine agents share (validation, worker threads, deadlines, abort, staging).
- `shm`, `nixl`, `mooncake`: the agents (import them directly; the engines are optional extras).
- `notify`: the ZMQ channel for notifications and staging control; `peer`: agents in a child
  process; `bench`: `bench_transport`.
"""

from kvbridge.transport.local import LocalExecutor, execute_plan

__all__ = ["LocalExecutor", "execute_plan"]

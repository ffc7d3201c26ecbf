"""Transports execute plans; they know nothing about models. `local` runs in one process."""

from kvbridge.transport.local import LocalExecutor, execute_plan

__all__ = ["LocalExecutor", "execute_plan"]

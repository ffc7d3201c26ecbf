"""The scheduler's question to a pool: which blocks are complete in it, host tier first."""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.core.spec import ModelSpec
from kvbridge.offload.keys import OffloadKey
from kvbridge.pool.config import PoolConfig, StagingLayout, object_layout
from kvbridge.pool.host_tier import HostTier
from kvbridge.pool.store import StoreClient


class PoolIndex:
    """The scheduler's view: which blocks are complete in the pool (no device, no staging): in this
    host's tier first, then in the store."""

    def __init__(self, spec: ModelSpec, client: StoreClient | None, config: PoolConfig,
                 staging: StagingLayout | None = None):
        self.layout = object_layout(spec, config, 1, staging)
        self.client = client
        self.host = HostTier(self.layout, config.secret, config.host_bytes, config.host_dir) if config.host_bytes else None

    def hits(self, keys: Sequence[OffloadKey], remote: bool = True) -> list[bool | None]:
        """Per block key: every object present (True), one missing (False), store unreachable (None).
        `remote=False` asks the host tier only (the store is away): what it lacks is missing."""
        answer: list[bool | None] = [True] * len(keys)
        on_host = self.host.complete(keys) if self.host is not None else [False] * len(keys)
        rest = [i for i, hit in enumerate(on_host) if not hit]
        if self.client is None or not remote:
            for i in rest:
                answer[i] = False
            return answer
        names, owner = [], []
        for i in rest:
            ks = self.layout.keys(keys[i])
            names += ks
            owner += [i] * len(ks)
        for i, e in zip(owner, self.client.exists(names) if names else []):
            if e is None:
                answer[i] = None
            elif not e and answer[i] is not None:
                answer[i] = False
        return answer

    def close(self) -> None:
        if self.host is not None:
            self.host.close()


__all__ = ["PoolIndex"]

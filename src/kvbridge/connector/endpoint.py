"""What a prefill `Producer` and a decode `Consumer` rank share: one `RankEndpoint`.

Why a base class: both sides of the lifecycle are one rank of one engine holding a registered
cache and a transport agent, and they apply the same rules to everything around their state
machines: the Hello they present, the block ids an engine hands them, the transport
notifications a peer sends (decoded, typed, and accepted only from the agent that handshook as
that rank), how a posted transfer is polled, aborted and waited for until it stops, and how a
bounded history forgets its oldest entries. Written once here, each subclass is one state machine.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from kvbridge.connector import messages as m
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.handshake import make_hello
from kvbridge.connector.transports import agent_name, transport_kind
from kvbridge.errors import InvalidRequest, KVBridgeError
from kvbridge.core.topology import TransferTopology
from kvbridge.transport.base import Handle, Runs, Transport, XferState
from kvbridge.transport.cache import RankCache

log = logging.getLogger("kvbridge.connector.endpoint")

BlockIds = tuple[tuple[int, ...], ...]


class RankEndpoint:
    """One engine rank's cache, transport agent and connector config (see the module docstring)."""

    role: ClassVar[m.Role]
    kind: ClassVar[str]  # "producer" | "consumer", for messages

    def __init__(self, engine_id: str, rank: int, cache: RankCache, transport: Transport, *, mode: m.Mode,
                 config: ConnectorConfig | None, clock: Callable[[], float] = time.monotonic,
                 topology: TransferTopology | None = None):
        if mode not in ("pull", "push"):
            raise KVBridgeError(f"mode must be 'pull' or 'push', got {mode!r}")
        self.engine_id, self.rank, self.cache, self.transport = engine_id, rank, cache, transport
        self.mode: m.Mode = mode
        self.config = config or ConnectorConfig()
        self.clock = clock
        # `topology`: an engine's own subclass (its layouts' rules), for this rank and cache
        self.topology = topology or TransferTopology(engine_id, cache.spec, cache.layout, rank)
        self.agent_name = agent_name(transport)
        transport.register(cache.regions)
        self._notes_trusted = authenticate_transport(transport, self.config.secret, self.config.replay_window)
        self._metadata = transport.metadata()
        self.stats: Counter[str] = Counter()
        self.closed = False

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank}"

    @property
    def hello(self) -> m.Hello:
        return make_hello(self.engine_id, self.rank, self.role, self.mode, self.cache.spec, self.cache.layout,
                          transport_kind(self.transport), self.agent_name, self._metadata, self._hello_addresses(),
                          self.config.kv_identity)

    def _hello_addresses(self) -> tuple[str, ...]:
        return ()

    # -- requests ---------------------------------------------------------------------------------
    def _checked_blocks(self, block_ids: Sequence[Sequence[int]], num_tokens: int | None, request_id: str, *,
                        exact: bool) -> BlockIds:
        """The block ids as tuples, refused (one `InvalidRequest` line) unless one group per KV-cache
        group and every id inside the cache; `exact`: each attention group holds exactly the blocks
        `num_tokens` need (the decode side allocates them), else `num_tokens` >= 1 (the prefill side)."""
        ids = tuple(tuple(int(b) for b in g) for g in block_ids)
        spec, layout = self.cache.spec, self.cache.layout
        if len(ids) != len(spec.groups):
            raise InvalidRequest(f"request {request_id!r}: block ids for {len(ids)} KV-cache groups, the model has "
                                 f"{len(spec.groups)}")
        if not exact and num_tokens is not None and num_tokens < 1:
            raise InvalidRequest(f"request {request_id!r}: num_tokens must be >= 1, got {num_tokens}")
        for g, group in enumerate(ids):
            arr = np.asarray(group, dtype=np.int64)
            bad = arr[(arr < 0) | (arr >= layout.num_blocks)]
            if bad.size:
                raise InvalidRequest(f"request {request_id!r} group {g}: block id {int(bad[0])} outside "
                                     f"[0, {layout.num_blocks})")
            if exact and num_tokens is not None and not spec.group_layer(g).is_recurrent:
                need = layout.block_ids_needed(g, num_tokens)
                if len(group) != need:
                    raise InvalidRequest(f"request {request_id!r} group {g}: {num_tokens} tokens need {need} blocks "
                                         f"of {layout.group_block_size(g)}{' per CP rank' if layout.cp_size > 1 else ''}, got {len(group)}")
        return ids

    def _check_open(self) -> None:
        if self.closed:
            raise KVBridgeError(f"{self.who} {self.kind} is closed")

    def _bounded(self, history: OrderedDict[str, Any], stat: str | None = None) -> None:
        """Forget the oldest entries beyond `max_pending` (counted in `stats[stat]` when given)."""
        while len(history) > self.config.max_pending:
            history.popitem(last=False)
            if stat is not None:
                self.stats[stat] += 1

    # -- peers ------------------------------------------------------------------------------------
    def _notifications(self, kind: type, agent_of: Callable[[str, int], str | None]) -> list[Any]:
        """The transport notifications of type `kind` sent by the agent that handshook as the rank
        they name (`agent_of(engine, rank)`); others are counted and dropped."""
        out = []
        for sender, msg in m.decoded_notifications(self.transport, self.config.max_frame_bytes, self.stats,
                                                   self.who, self._notes_trusted):
            if not isinstance(msg, kind):
                self.stats["unexpected_notifications"] += 1
            elif agent_of(msg.engine_id, msg.rank) != sender:
                self.stats["refused_notifications"] += 1
            else:
                out.append(msg)
        return out

    def _refuse_frame(self, where: str, error: str) -> None:
        self.stats["refused_frames"] += 1
        log.warning("%s refused a frame%s: %s", self.who, where, error)

    # -- transfers --------------------------------------------------------------------------------
    def _post(self, agent: str, op: str, runs: Runs, done: m.Message) -> Handle | str:
        """Post `runs`; `done` rides along as the transport notification when enabled. A failure
        to post is returned as its one-line reason."""
        notify = m.encode(done, self.config.max_frame_bytes) if self.config.transport_notify else None
        try:
            return self.transport.submit(agent, op, runs, notify)
        except Exception as e:  # noqa: BLE001 - the caller fails the request with this reason
            return f"{type(e).__name__}: {e}"

    def _poll(self, handle: Handle) -> XferState:
        try:
            return self.transport.poll(handle)
        except Exception as e:  # noqa: BLE001 - a transfer we cannot poll has failed
            handle.reason = f"poll raised {type(e).__name__}: {e}"
            return XferState.FAILED

    def _abort_pending(self, handles: Iterable[Handle]) -> None:
        """Ask the transport to stop every posted transfer still pending (the caller polls them)."""
        for handle in handles:
            if handle.state == XferState.PENDING:
                try:
                    self.transport.abort(handle)
                except Exception as e:  # noqa: BLE001 - keep going; the caller keeps polling it
                    log.error("%s: aborting transfer %d raised %s", self.who, handle.id, e)

    def _still_pending(self, handles: dict[int, Handle], skip: Iterable[int] = ()) -> list[int]:
        """The peer ranks whose transfer has not stopped yet (a poll that raises counts as pending)."""
        skip = set(skip)
        pending = []
        for rank, handle in handles.items():
            if rank in skip:
                continue
            try:
                state = self.transport.poll(handle) if handle.state == XferState.PENDING else handle.state
            except Exception:  # noqa: BLE001
                state = XferState.PENDING
            if state == XferState.PENDING:
                pending.append(rank)
        return pending



def authenticate_transport(transport: Any, secret: bytes | None, replay_window: float = 300.0) -> bool:
    """Extend `secret` to the transport's notification channel; True when the connector may act on
    the transport's notifications (they are authenticated, or the side channel is not either)."""
    auth = getattr(transport, "authenticate", None)
    if auth is None:
        return secret is None
    trusted = auth(secret, replay_window)
    return secret is None or bool(trusted)

__all__ = ["BlockIds", "RankEndpoint"]

"""A decode rank's side channels to the prefill engines it reads from: handshake, loss, rejoin.

Why apart from the `Consumer`: which connection speaks for which source rank, when a link
counts as lost and how a lost source is re-handshaken (and whether what answers is the same
incarnation) is one concept with its own state; the consumer's request state machine only asks
"which source does this frame come from" and "is this source lost".

A lost source is re-handshaken on a fresh connection (a fresh routing id: the prefill rank's
ROUTER may still hold the stale one) every `handshake_timeout` at most; it serves again only if
it answers with the very Hello it gave at the handshake (same engine id, rank, transport agent
and metadata). Another incarnation under the same engine id stays lost (`replaced`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.connector import messages as m
from kvbridge.connector.handshake import validate_peer
from kvbridge.connector.side_channel import Received, SideChannelClient, SideChannelError
from kvbridge.core.layout import EngineLayout
from kvbridge.errors import KVBridgeError

if TYPE_CHECKING:
    from kvbridge.connector.endpoint import RankEndpoint

log = logging.getLogger("kvbridge.connector.consumer")


@dataclass
class SourceEngine:
    """A prefill engine this rank completed the handshake with."""

    engine_id: str
    layout: EngineLayout
    addresses: tuple[str, ...]
    sources: tuple[int, ...]
    clients: dict[int, SideChannelClient] = field(default_factory=dict)
    agents: dict[int, str] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    hellos: dict[int, m.Hello] = field(default_factory=dict)  # each source's Hello at the handshake
    rejoins: dict[int, tuple[SideChannelClient, float]] = field(default_factory=dict)  # (client, deadline)
    next_rejoin: dict[int, float] = field(default_factory=dict)
    replaced: dict[int, str] = field(default_factory=dict)  # sources that came back as another incarnation
    last_used: float = 0.0  # when a request last named this engine (connect, receive, expect)

    @property
    def replaced_whole(self) -> bool:
        """Every source came back as another incarnation: this engine will never answer again."""
        return set(self.sources) <= set(self.replaced)


class SourceLinks:
    """The side channels of one decode rank (`endpoint`) to every prefill engine it connected."""

    def __init__(self, endpoint: RankEndpoint):
        self.ep = endpoint
        self.engines: dict[str, SourceEngine] = {}
        self._client_of: dict[int, tuple[str, int]] = {}  # id(client) -> (engine, source rank)
        self._rejoining: dict[int, tuple[str, int]] = {}  # id(re-handshake client) -> (engine, source rank)

    def clients(self) -> list[SideChannelClient]:
        """Every connection to poll: the sources' and the re-handshakes in flight."""
        return [c for e in self.engines.values() for c in (*e.clients.values(), *(r for r, _ in e.rejoins.values()))]

    def source_of(self, client: SideChannelClient) -> tuple[str, int]:
        return self._client_of.get(id(client), ("", -1))

    def connect(self, address: str, timeout: float) -> str:
        """Handshake with every source rank of the engine reachable at `address`; its engine id."""
        ep = self.ep
        mine = ep.hello
        opened: list[SideChannelClient] = []
        try:
            # A fresh routing id per engine: a lost engine's connection keeps reconnecting under its
            # id, and when another incarnation listens at the same address its ROUTER ignores a
            # second connection with that id (a restarted prefill instance never answered).
            identity = self._new_identity()
            boot = self._client(address, opened, identity)
            reply = self._exchange(boot, mine, timeout)
            validate_peer(ep.topology, mine, reply)
            engine_id = reply.engine_id
            if engine_id in self.engines:
                raise m.HandshakeRefused(f"prefill engine {engine_id!r} is already connected to decode rank "
                                         f"{ep.rank}")
            world = reply.layout.world_size
            if reply.peer_addresses:
                addresses = reply.peer_addresses
            elif world == 1:
                addresses = (address,)
            else:
                raise m.HandshakeRefused(f"prefill engine {engine_id!r} rank {reply.rank} at {address} does not list "
                                         f"its engine's {world} rank addresses; connect to its rank 0")
            sources = ep.topology.source_ranks(engine_id)
            eng = SourceEngine(engine_id, reply.layout, tuple(addresses), sources)
            for s in sources:
                if s == reply.rank:
                    client, hello = boot, reply
                else:
                    client = self._client(addresses[s], opened, identity)
                    hello = self._exchange(client, mine, timeout)
                    if (hello.engine_id, hello.rank) != (engine_id, s):
                        raise m.HandshakeRefused(f"{addresses[s]} answered as {hello.engine_id!r} rank {hello.rank}, "
                                                 f"expected {engine_id!r} rank {s}")
                    validate_peer(ep.topology, mine, hello)
                try:
                    ep.transport.connect(hello.agent_name, hello.transport_metadata)
                except Exception as e:
                    raise m.HandshakeRefused(f"transport {mine.transport} cannot connect to prefill rank {s} "
                                             f"({hello.agent_name!r}): {e}") from None
                eng.clients[s], eng.agents[s], eng.hellos[s] = client, hello.agent_name, hello
        except BaseException:
            for c in opened:
                c.close()
            raise
        for c in opened:
            if all(c is not x for x in eng.clients.values()):
                c.close()
        for s, c in eng.clients.items():
            self._client_of[id(c)] = (engine_id, s)
        eng.last_used = ep.clock()
        self.engines[engine_id] = eng
        return engine_id

    def newly_lost(self) -> list[tuple[SourceEngine, int]]:
        """Mark the sources whose link dropped since the last call (and start rejoining them)."""
        out = []
        for eng in list(self.engines.values()):
            for s, c in eng.clients.items():
                if c.lost and s not in eng.lost:
                    eng.lost.add(s)
                    eng.next_rejoin[s] = self.ep.clock()
                    self.ep.stats["sources_lost"] += 1
                    out.append((eng, s))
            if eng.lost:
                self._rejoin(eng)
        return out

    def forget(self, engine_id: str) -> bool:
        """Drop a prefill engine: close its connections and re-handshakes, disconnect its transport
        agents and unregister it from the topology. False when it was not connected."""
        eng = self.engines.pop(engine_id, None)
        if eng is None:
            return False
        for s in list(eng.rejoins):
            self._drop_rejoin(eng, s)
        for c in eng.clients.values():
            self._client_of.pop(id(c), None)
            c.close()
        for agent in set(eng.agents.values()):
            try:
                self.ep.transport.disconnect(agent)
            except Exception as e:  # noqa: BLE001 - a transport that already dropped the peer
                log.debug("disconnect %s: %s", agent, e)
        self.ep.topology.unregister_remote_engine(engine_id)
        self.ep.stats["engines_forgotten"] += 1
        return True

    def close(self) -> None:
        for eng in self.engines.values():
            for c in eng.clients.values():
                c.close()
            for s in list(eng.rejoins):
                self._drop_rejoin(eng, s)

    # -- handshake --------------------------------------------------------------------------------
    def _new_identity(self) -> bytes:
        return f"{self.ep.engine_id}/{self.ep.rank}/{uuid.uuid4().hex[:12]}".encode()

    def _client(self, address: str, opened: list[SideChannelClient],
                identity: bytes | None = None) -> SideChannelClient:
        cfg = self.ep.config
        client = SideChannelClient(address, identity or self._new_identity(), max_frame_bytes=cfg.max_frame_bytes,
                                   heartbeat_seconds=cfg.side_channel_heartbeat, secret=cfg.secret,
                                   replay_window=cfg.replay_window)
        opened.append(client)
        return client

    def _exchange(self, client: SideChannelClient, mine: m.Hello, timeout: float) -> m.Hello:
        try:
            reply = client.request(mine, timeout, (m.Hello,))
        except SideChannelError as e:
            raise SideChannelError(f"handshake with prefill at {client.address} failed: {e}") from None
        if isinstance(reply, m.Error):
            raise m.HandshakeRefused(f"prefill engine {reply.engine_id!r} rank {reply.rank} at {client.address} "
                                     f"refused decode {self.ep.engine_id!r} rank {self.ep.rank}: {reply.reason}")
        assert isinstance(reply, m.Hello)
        return reply

    # -- rejoining a lost source ------------------------------------------------------------------
    def is_rejoin(self, client: SideChannelClient) -> bool:
        return id(client) in self._rejoining

    def _rejoin(self, eng: SourceEngine) -> None:
        """Keep one bounded re-handshake in flight per lost source (see the module docstring)."""
        ep, cfg = self.ep, self.ep.config
        now = ep.clock()
        for s in sorted(eng.lost):
            if s in eng.replaced:
                continue
            pending = eng.rejoins.get(s)
            if pending is not None:
                if now < pending[1]:
                    continue
                self._drop_rejoin(eng, s)  # no answer in time: the next attempt uses a new connection
                eng.next_rejoin[s] = now + min(1.0, cfg.handshake_timeout)
            if now < eng.next_rejoin.get(s, now):
                continue
            try:
                client = self._client(eng.addresses[s], [], self._new_identity())
            except SideChannelError as e:
                log.warning("decode rank %d: cannot reopen the side channel to prefill %r rank %d: %s", ep.rank,
                            eng.engine_id, s, e)
                eng.next_rejoin[s] = now + cfg.handshake_timeout
                continue
            if not client.send(ep.hello):
                client.close()
                eng.next_rejoin[s] = now + min(1.0, cfg.handshake_timeout)
                continue
            eng.rejoins[s] = (client, now + cfg.handshake_timeout)
            self._rejoining[id(client)] = (eng.engine_id, s)
            ep.stats["rejoin_attempts"] += 1

    def _drop_rejoin(self, eng: SourceEngine, s: int) -> None:
        client, _ = eng.rejoins.pop(s, (None, 0.0))
        if client is not None:
            self._rejoining.pop(id(client), None)
            client.close()

    def on_rejoin_reply(self, client: SideChannelClient, rec: Received) -> None:
        ep = self.ep
        engine, s = self._rejoining[id(client)]
        eng = self.engines[engine]
        msg = rec.msg
        if rec.error is not None or not isinstance(msg, (m.Hello, m.Error)):
            ep.stats["refused_frames"] += 1
            return
        if isinstance(msg, m.Error):
            log.warning("decode rank %d: prefill %r rank %d refused the re-handshake: %s", ep.rank, engine, s,
                        msg.reason)
            self._drop_rejoin(eng, s)
            eng.next_rejoin[s] = ep.clock() + ep.config.handshake_timeout
            return
        known = eng.hellos[s]
        why = ""
        if (msg.engine_id, msg.rank) != (engine, s):
            why = f"{client.address} now answers as {msg.engine_id!r} rank {msg.rank}"
        elif (msg.agent_name, msg.transport_metadata) != (known.agent_name, known.transport_metadata):
            why = (f"prefill {engine!r} rank {s} came back as another incarnation (transport agent "
                   f"{msg.agent_name!r}, was {known.agent_name!r}): a restarted peer needs a new engine id")
        else:
            try:
                validate_peer(ep.topology, ep.hello, msg)
            except KVBridgeError as e:
                why = str(e)
        if why:
            client.send(m.Error(ep.engine_id, ep.rank, f"re-handshake refused: {why}"))  # for its logs
            self._drop_rejoin(eng, s)
            eng.replaced[s] = why
            ep.stats["sources_replaced"] += 1
            log.error("decode rank %d: side channel to prefill %r rank %d stays lost: %s", ep.rank, engine, s, why)
            return
        eng.rejoins.pop(s)
        old = eng.clients[s]
        self._client_of.pop(id(old), None)
        old.close()
        eng.clients[s] = client
        self._client_of[id(client)] = (engine, s)
        del self._rejoining[id(client)]
        eng.lost.discard(s)
        eng.next_rejoin.pop(s, None)
        ep.stats["sources_recovered"] += 1
        log.warning("decode rank %d: side channel to prefill %r rank %d (%s) is back (same incarnation)", ep.rank,
                    engine, s, client.address)


__all__ = ["SourceEngine", "SourceLinks"]

"""KV-aware routing for a fleet (issue 45): the instances' KV events, the relay, the router's flags.

With `--router-policy kv_aware` every prefill instance publishes its KV events (vLLM's
`--kv-events-config`, a ZMQ PUB that connects to the launcher's relay on a loopback port: the
events carry prompts' token ids, so nothing listens for them beyond this host), the relay
(`kvbridge.routing.relay`) re-chunks each into `CANONICAL_BLOCK` tokens and republishes it on a
loopback port of its own, and the router scores prefill instances by those events
(`--prefill-policy kv_aware --pd-kv-events URL=ENDPOINT`, whose block size vllm-router fixes at
16 tokens), whatever each instance's block size. Decode instances keep the fleet's other policy.
With a shared pool, each prefill instance's pool connector announces what it stores
(`PoolSettings.kv_events`), and the relay offers it on every prefill instance's stream: as host
memory with a host tier (`--pool-host-mib`), else as an external tier.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvbridge.routing.relay import EventRelay, RelaySource

if TYPE_CHECKING:
    from kvbridge.integrations.vllm.fleet_processes import Member

CANONICAL_BLOCK = 16
"""Tokens per block the router reads events in (vllm-router's P/D event sources: 16)."""
DECODE_POLICY = "round_robin"


class KvRouting:
    """Ports, flags and the relay of one fleet's KV-aware routing (`Fleet` calls each hook)."""

    def __init__(self, port_locks: Any, events_host: str = "127.0.0.1", pool_tier: str = "host"):
        self.port_locks, self.events_host, self.pool_tier = port_locks, events_host, pool_tier
        self.events: dict[str, int] = {}  # instance -> port its publisher binds
        self.relayed: dict[str, int] = {}  # instance -> loopback port the relay publishes it on
        self.relay: EventRelay | None = None

    def instance_args(self, member: Member) -> None:
        """Make a prefill instance publish its KV events (the same port across restarts)."""
        if member.name not in self.events:
            self.events[member.name] = self.port_locks.run([self.events_host])
            self.relayed[member.name] = self.port_locks.run(["127.0.0.1"])
            if self.relay is not None:  # an instance joining a running fleet
                try:
                    self.relay.add(self._source(member.name))
                except BaseException:
                    del self.events[member.name], self.relayed[member.name]
                    raise
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                  "endpoint": f"tcp://{self.events_host}:{self.events[member.name]}"}
        # --enable-scale-out: the router takes a request's token ids from the instance's /render
        # endpoint (vLLM answers 403 there without it), then scores the instance's events by them
        member.argv += ["--kv-events-config", json.dumps(config), "--enable-scale-out"]

    def router_args(self, routes: list[tuple[str, str]], names: dict[str, str]) -> list[str]:
        """`--prefill-policy kv_aware`, the decode policy, and each prefill URL's relayed source
        (`names`: URL -> instance name)."""
        argv = ["--prefill-policy", "kv_aware", "--decode-policy", DECODE_POLICY]
        for role, url in routes:
            if role == "prefill" and names.get(url) in self.relayed:
                argv += ["--pd-kv-events", f"{url}=tcp://127.0.0.1:{self.relayed[names[url]]}"]
        return argv

    def start(self) -> None:
        """The relay, bound before the instances start (their publishers connect to it)."""
        if self.relay is None and self.events:
            self.relay = EventRelay([self._source(name) for name in self.events], CANONICAL_BLOCK,
                                    pool_tier=self.pool_tier).start()

    def _source(self, name: str) -> RelaySource:
        return RelaySource(name, f"tcp://{self.events_host}:{self.events[name]}",
                           f"tcp://127.0.0.1:{self.relayed[name]}")

    def forget(self, name: str) -> None:
        if self.relay is not None:
            self.relay.forget(name)

    def stats(self) -> dict[str, Any]:
        return {} if self.relay is None else {k: vars(v) for k, v in self.relay.stats().items()}

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None


__all__ = ["CANONICAL_BLOCK", "KvRouting"]

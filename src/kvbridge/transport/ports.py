"""Free local ports for the servers kvbridge starts (fleet instances, a pool's store master)."""

from __future__ import annotations

import random
import socket

from kvbridge.errors import KVBridgeError


class PortsExhausted(KVBridgeError, RuntimeError):
    """No run of free ports was found."""


def free_ports(count: int = 1, exclude: set[int] | None = None) -> int:
    """A base port such that `count` consecutive ports are free on 127.0.0.1, below the kernel's
    ephemeral range (an ephemeral port that is free now may be taken by any outgoing connection
    before the side channel binds it: seen as "Address already in use"), none of them in
    `exclude` (ports promised to instances that have not bound them yet)."""
    rng = random.Random()
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(20000 + 1000, min(low, 60000))
    for _ in range(200):
        base = rng.randrange(20000, top - count)
        if exclude and exclude.intersection(range(base, base + count)):
            continue
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise PortsExhausted(f"no {count} consecutive free ports found")


__all__ = ["PortsExhausted", "free_ports"]

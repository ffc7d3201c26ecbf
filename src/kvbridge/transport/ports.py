"""Free local ports for the servers kvbridge starts (fleet instances, a pool's store master), and
reservations that keep two launchers starting side by side from promising the same port."""

from __future__ import annotations

import fcntl
import os
import random
import socket
from collections.abc import Sequence

from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.transport.private_dir import private_dir, runtime_dir


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
        if any(reserved(p) for p in range(base, base + count)):  # a launcher beside us holds it
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


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (with SO_REUSEADDR, as servers bind: a
    closed server's connections in TIME_WAIT do not hold its port). `0.0.0.0` / `::` test every
    interface: a server on any one address holds the port there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def default_lock_dir() -> str:
    """This user's port lock directory: `ports` in its private kvbridge directory
    (`private_dir.runtime_dir`), created 0700 and owner-checked; refused in one line otherwise."""
    return private_dir(os.path.join(runtime_dir(), "ports"))


def reserved(port: int, directory: str | None = None) -> bool:
    """Whether a launcher of this user holds `port`'s reservation (`PortReservations`) now."""
    try:
        directory = directory or default_lock_dir()
    except ConfigError:  # no usable lock directory: nothing of ours is reserved in it
        return False
    try:
        fd = os.open(os.path.join(directory, f"{port}.lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


class PortReservations:
    """Ports one launcher will bind, each free on the interface it binds and held by an exclusive
    `flock` on `PORT.lock` in this user's lock directory (`default_lock_dir`) until `release`, or until
    every process holding a copy of its descriptor has ended (the kernel drops the lock; a fleet's
    watchdog holds copies, `descriptors`, so that a dead launcher's ports stay reserved until its
    members are gone), so a second launcher of this user starting beside it never promises the
    same port. A port is reserved whatever the interface: two fleets on two addresses of one host
    still get different ports.

    Per user (issue 43 point 5): a directory every user could write let anyone hold every port.
    Another user's launcher is kept off a port only by the check that it is free when reserved:
    two users starting fleets in the same second may still be promised one port, and the second
    server to bind it fails to start."""

    def __init__(self, lock_dir: str | None = None):
        self._held: dict[int, int] = {}  # port -> descriptor of its locked file
        self.lock_dir = private_dir(lock_dir) if lock_dir else default_lock_dir()

    @property
    def ports(self) -> set[int]:
        return set(self._held)

    def _lock(self, port: int) -> bool:
        if port in self._held:
            return False
        path = os.path.join(self.lock_dir, f"{port}.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[port] = fd
        return True

    def take(self, port: int, host: str) -> str:
        """Reserve `port` for a server on `host`: '' when done, else why not (one phrase)."""
        if port in self._held:
            return f"{port} is already one of this launcher's ports"
        if not self._lock(port):
            return f"{port} is reserved by another kvbridge launcher starting or running beside this one"
        if not port_free(host, port):
            self.drop(port)
            return f"{host}:{port} is in use or cannot be bound"
        return ""

    def run(self, hosts: Sequence[str]) -> int:
        """Reserve `len(hosts)` consecutive ports, port `base + i` free on `hosts[i]`; the base.
        Below the kernel's ephemeral range (see `free_ports`)."""
        count = len(hosts)
        rng = random.Random()
        top = max(20000 + 1000, min(_ephemeral_low(), 60000))
        for _ in range(400):
            base = rng.randrange(20000, top - count)
            got: list[int] = []
            for i, host in enumerate(hosts):
                if self.take(base + i, host):
                    break
                got.append(base + i)
            if len(got) == count:
                return base
            for p in got:
                self.drop(p)
        raise PortsExhausted(f"no {count} consecutive free ports found")

    def descriptors(self) -> dict[int, int]:
        """port -> the descriptor holding its lock: a copy (sent to another process) holds it too."""
        return dict(self._held)

    def drop(self, port: int) -> None:
        fd = self._held.pop(port, None)
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def release(self) -> None:
        for port in list(self._held):
            self.drop(port)

    def __del__(self) -> None:
        self.release()


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


__all__ = ["PortReservations", "default_lock_dir", "PortsExhausted", "free_ports", "port_free", "reserved"]

"""Two network namespaces joined by a veth pair: 'hosts' on one machine for the multi-host tests.

Private IPv4 (10.254.x.y/30) that exists only inside the namespaces made here. (Not link-local
169.254/16: UCX, under NIXL, does not use interfaces that carry only a link-local address.)
Needs root and iproute2; `veth_pair` raises `Unavailable` with the reason otherwise, which a
test turns into a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (no root, no `ip`, or the kernel refused)."""


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def veth_pair() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """((namespace a, address a), (namespace b, address b)), deleted (veth and all) on exit."""
    if os.geteuid() != 0:
        raise Unavailable("needs root to create network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command (iproute2) is not installed")
    tag = f"kvb{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    subnet = 100 + os.getpid() % 100
    addr_a, addr_b = f"10.254.{subnet}.1", f"10.254.{subnet}.2"
    made = []
    try:
        for ns in (a, b):
            r = ip("netns", "add", ns)
            if r.returncode:
                raise Unavailable(f"cannot create a network namespace: {r.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"),
                 ("link", "set", f"{tag}va", "netns", a), ("link", "set", f"{tag}vb", "netns", b),
                 ("-n", a, "addr", "add", f"{addr_a}/30", "dev", f"{tag}va"),
                 ("-n", b, "addr", "add", f"{addr_b}/30", "dev", f"{tag}vb"),
                 ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up"),
                 ("-n", a, "link", "set", f"{tag}va", "up"), ("-n", b, "link", "set", f"{tag}vb", "up")]
        for step in steps:
            r = ip(*step)
            if r.returncode:
                raise Unavailable(f"cannot set up the veth pair (ip {' '.join(step)}): {r.stderr.strip()}")
        yield (a, addr_a), (b, addr_b)
    finally:
        for ns in made:
            ip("netns", "del", ns)  # removes the veth pair with it


@contextlib.contextmanager
def namespace_beside_root() -> Iterator[tuple[str, str, str]]:
    """(namespace, root's address, the namespace's address): one namespace joined to this one by a
    veth pair, for a 'second host' whose processes reach this host's (and are reached from it)
    only over that link; deleted (veth and all) on exit."""
    if os.geteuid() != 0:
        raise Unavailable("needs root to create network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command (iproute2) is not installed")
    tag = f"kvr{os.getpid() % 100000}"
    subnet = 200 + os.getpid() % 50
    root_addr, ns_addr = f"10.254.{subnet}.1", f"10.254.{subnet}.2"
    r = ip("netns", "add", tag)
    if r.returncode:
        raise Unavailable(f"cannot create a network namespace: {r.stderr.strip()}")
    try:
        steps = [("link", "add", f"{tag}r", "type", "veth", "peer", "name", f"{tag}n"),
                 ("link", "set", f"{tag}n", "netns", tag), ("addr", "add", f"{root_addr}/30", "dev", f"{tag}r"),
                 ("-n", tag, "addr", "add", f"{ns_addr}/30", "dev", f"{tag}n"), ("-n", tag, "link", "set", "lo", "up"),
                 ("link", "set", f"{tag}r", "up"), ("-n", tag, "link", "set", f"{tag}n", "up")]
        for step in steps:
            r = ip(*step)
            if r.returncode:
                raise Unavailable(f"cannot set up the veth pair (ip {' '.join(step)}): {r.stderr.strip()}")
        yield tag, root_addr, ns_addr
    finally:
        ip("netns", "del", tag)  # removes the veth pair, the root's end with it


__all__ = ["Unavailable", "ip", "namespace_beside_root", "veth_pair"]

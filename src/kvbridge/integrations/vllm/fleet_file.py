"""A fleet across hosts (issue 28 point 1): one file, the same on every host, names each instance
(its role, shape, host and ports) and the router's host and port; `kvbridge serve MODEL --fleet
FILE --on HOST --secret-file KEY` then starts on each host exactly the members the file puts on
HOST, and the router, wherever it runs, gets every instance's URL from the file.

Why a file and fixed ports: the hosts do not talk to each other before the fleet serves (no
coordinator to build or trust), so every host must compute the same fleet on its own; the router
needs each remote instance's URL before that instance exists, and a firewall, a container's
ports or a Kubernetes Service need them known in advance too. The decode instances need no
address of a prefill instance: a prefill instance returns its side channel's address in the
`kv_transfer_params` the router hands on (the address it binds: its host's own interface).

The file is untrusted text: parsed by msgspec into typed structs (TOML), every number bounded,
every name checked, every port of one host disjoint, and refused in one line naming the file.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.fleet_config import MAX_INSTANCES, FleetConfig, InstanceShape

MAX_FILE_BYTES = 64 << 10
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# An IPv4/IPv6 literal or a DNS name (a Kubernetes pod's stable name): letters, digits, '.', '-', ':'.
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:-]+$")]
# A DNS label: it names a log file, an engine id and, in Kubernetes, a pod.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")]
Shape = Annotated[str, msgspec.Meta(max_length=200)]
_WILDCARDS = {"0.0.0.0", "::", "[::]"}


class RouterEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[router]`: where vllm-router runs and listens (the fleet's endpoint)."""

    host: Host
    port: Port = 8000


class InstanceEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[[instance]]`: a `vllm serve` of the fleet on `host`, HTTP on `port`, one side-channel
    port per rank from `side_channel_port` (default `port + 1`)."""

    name: Name
    role: Literal["prefill", "decode"]
    host: Host
    port: Port
    shape: Shape = ""  # as --prefill / --decode write it: tp=2,block=32,transport=mooncake
    side_channel_port: Port | None = None


class _Document(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    router: RouterEntry
    instance: Annotated[list[InstanceEntry], msgspec.Meta(min_length=2, max_length=2 * MAX_INSTANCES)]


@dataclass(frozen=True)
class Placement:
    """One checked instance of a fleet file."""

    name: str
    role: str
    host: str
    port: int
    side_port: int  # the first of tp * pp
    shape: InstanceShape

    @property
    def url(self) -> str:
        """Where the router (on any host) reaches it."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def ports(self) -> list[int]:
        return [self.port, *range(self.side_port, self.side_port + self.shape.tp * self.shape.pp)]


@dataclass(frozen=True)
class FleetFile:
    """A checked fleet file: the router's place and every instance's."""

    path: Path
    router_host: str
    router_port: int
    instances: tuple[Placement, ...]

    @property
    def hosts(self) -> list[str]:
        """Every host named, the router's first, in file order."""
        return list(dict.fromkeys([self.router_host, *(p.host for p in self.instances)]))

    @property
    def router_url(self) -> str:
        return f"http://{_url_host(self.router_host)}:{self.router_port}"

    def role(self, role: str) -> list[Placement]:
        return [p for p in self.instances if p.role == role]

    def on(self, host: str) -> list[Placement]:
        """The instances `host` runs; `ConfigError` when the file puts nothing on it."""
        if host not in self.hosts:
            shown = ", ".join(self.hosts)
            raise ConfigError(f"--on {host[:80]}: {self.path} puts no member on it (its hosts: "
                              f"{shown if len(shown) <= 200 else shown[:197] + '...'})")
        return [p for p in self.instances if p.host == host]


def read_fleet_file(path: str | Path) -> FleetFile:
    """The fleet file at `path`, checked; `ConfigError` (one line naming the file) otherwise."""
    path = Path(path)
    where = f"fleet file {path}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = msgspec.toml.decode(data, type=_Document)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{where}: {first[:200]}") from None
    for host in [doc.router.host, *(i.host for i in doc.instance)]:
        if host in _WILDCARDS:
            raise ConfigError(f"{where}: host {host} is every interface, not an address other hosts reach; "
                              "name each member's own address")
    placed: list[Placement] = []
    seen: set[str] = set()
    for entry in doc.instance:
        if entry.name in seen or entry.name in ("router", "master"):
            raise ConfigError(f"{where}: instance name {entry.name!r} is "
                              f"{'given twice' if entry.name in seen else 'reserved'}")
        seen.add(entry.name)
        shape = InstanceShape.parse(entry.shape, f"{where}: instance {entry.name} shape") if entry.shape \
            else InstanceShape()
        side = entry.side_channel_port if entry.side_channel_port is not None else entry.port + 1
        if side + shape.tp * shape.pp - 1 > 65535:
            raise ConfigError(f"{where}: instance {entry.name}: side-channel ports {side}.."
                              f"{side + shape.tp * shape.pp - 1} (one per rank) go past 65535")
        placed.append(Placement(entry.name, entry.role, entry.host, entry.port, side, shape))
    for role in ("prefill", "decode"):
        count = sum(p.role == role for p in placed)
        if not 1 <= count <= MAX_INSTANCES:
            raise ConfigError(f"{where}: {count} {role} instances; a fleet has 1..{MAX_INSTANCES} of each")
    _check_ports(where, doc.router, placed)
    kinds = {(p.shape.transport, p.shape.mode) for p in placed}
    hosts = {p.host for p in placed}
    if ("shm", "pull") in kinds or ("shm", "push") in kinds:
        if len(hosts) > 1:
            raise ConfigError(f"{where}: transport shm moves KV through one host's shared memory; instances on "
                              f"{len(hosts)} hosts need transport=mooncake or transport=nixl in every shape")
    return FleetFile(path, doc.router.host, doc.router.port, tuple(placed))


def _check_ports(where: str, router: RouterEntry, placed: list[Placement]) -> None:
    """No two servers of one host on one port (HTTP, side channels, the router)."""
    taken: dict[tuple[str, int], str] = {(router.host, router.port): "the router"}
    for p in placed:
        for i, port in enumerate(p.ports):
            what = f"instance {p.name}'s " + ("HTTP port" if i == 0 else f"side-channel port (rank {i - 1})")
            other = taken.setdefault((p.host, port), what)
            if other is not what:
                raise ConfigError(f"{where}: {p.host} port {port} is both {other} and {what}")


def bind_address(host: str) -> str:
    """The address a member named `host` binds on this machine: an IP literal as it is, a name
    (a Kubernetes pod's stable DNS name) resolved here. Whether this machine has it is for the
    port checks to say (a port that cannot be bound is refused in one line)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--on {host[:80]}: the name does not resolve here "
                          f"({getattr(e, 'strerror', None) or e})") from None
    return str(infos[0][4][0])


def place_here(config: FleetConfig) -> list[Placement]:
    """Make `config` (with `fleet_file` and `on` set) this host's part of the fleet: every
    instance's shape (each host checks the whole fleet's pairs, so all refuse alike), HTTP and
    side channels bound on this host's own address, the router's port; the instances to start."""
    fleet: FleetFile = config.fleet_file
    here = fleet.on(config.on)
    config.prefill = [p.shape for p in fleet.role("prefill")]
    config.decode = [p.shape for p in fleet.role("decode")]
    config.host = config.side_channel_host = bind_address(config.on)
    config.port = fleet.router_port
    if config.pool == "start":
        raise ConfigError("--fleet takes --pool HOST:PORT (a mooncake_master every host reaches, started on its "
                          "own), not --pool start")
    return here


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


__all__ = ["FleetFile", "InstanceEntry", "Placement", "RouterEntry", "bind_address", "place_here",
           "read_fleet_file"]

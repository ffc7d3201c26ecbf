"""A `mooncake_master` process: the Mooncake Store that a fleet's pool lives in, started and stopped here.

The master keeps the object directory and leases; the memory itself is what clients mount
(`StoreConfig.segment_bytes`). Clients find each other by Mooncake's P2P handshake, so the
master runs no metadata server. It binds its RPC port on `host` only (the fleet's interface;
Mooncake's default is every interface), and its HTTP metrics/admin server on loopback whatever
`host` is: that server lists every object's name (`/get_all_keys`, `/query_key`) to whoever
asks, and Mooncake 0.3.13 has no switch to turn it off, so only this host's users reach it. Tests, `kvbridge serve --pool` and the
benchmark start one with `MooncakeMaster.start()`; a fleet that runs its own names it by address.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.errors import ConfigError
from kvbridge.pool.store import P2P_METADATA
from kvbridge.transport.parent_death import parent_death_command
from kvbridge.transport.ports import free_ports


METRICS_HOST = "127.0.0.1"
"""Where every master's HTTP metrics/admin server listens (see the module)."""


def master_binary() -> str:
    """`mooncake_master` beside this interpreter, in the Mooncake package, or on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file():
        return str(beside)
    try:
        import mooncake

        packaged = Path(mooncake.__file__).parent / "mooncake_master"
        if packaged.is_file():
            return str(packaged)
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if not found:
        raise ConfigError("mooncake_master not found: install the Mooncake wheel (`pip install 'kvbridge[mooncake]'`)")
    return found


@dataclass
class MooncakeMaster:
    """One running master; `address` and `metadata_url` are what clients are given."""

    host: str
    rpc_port: int
    metrics_port: int
    log_path: Path
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return P2P_METADATA

    @property
    def metrics_url(self) -> str:
        """The HTTP metrics/admin server: on loopback (see the module)."""
        return f"http://{METRICS_HOST}:{self.metrics_port}"

    @property
    def ports(self) -> tuple[int, int]:
        """Every port the master binds (RPC, metrics)."""
        return self.rpc_port, self.metrics_port

    @classmethod
    def prepare(cls, log_path: str | os.PathLike, host: str = "127.0.0.1", lease_ms: int = 5000,
                eviction_ratio: float = 0.1, extra: tuple[str, ...] = ()) -> MooncakeMaster:
        """A master on free ports of `host`, not started yet (`launch`): a fleet hands its address
        to instances it configures before anything runs.

        `lease_ms` is how long a read pins an object against eviction and removal (Mooncake's
        `default_kv_lease_ttl`); `eviction_ratio` the share of objects dropped when memory fills.
        """
        base = free_ports(2)
        m = cls(host, base, base + 1, Path(log_path))
        m.argv = [master_binary(), f"-rpc_address={host}", f"-rpc_port={m.rpc_port}", "-rpc_thread_num=2",
                  "-enable_http_metadata_server=false", f"-metrics_host={METRICS_HOST}", f"-metrics_port={m.metrics_port}",
                  f"-default_kv_lease_ttl={int(lease_ms)}", f"-eviction_ratio={eviction_ratio}", *extra]
        return m

    @classmethod
    def start(cls, log_path: str | os.PathLike, host: str = "127.0.0.1", lease_ms: int = 5000,
              eviction_ratio: float = 0.1, extra: tuple[str, ...] = (), wait_s: float = 60.0) -> MooncakeMaster:
        """`prepare` and `launch`: returns once its RPC port accepts connections."""
        m = cls.prepare(log_path, host, lease_ms, eviction_ratio, extra)
        m.launch(wait_s)
        return m

    def launch(self, wait_s: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launch(wait_s)

    def spawn(self) -> subprocess.Popen:
        """Start the process on the master's ports and return at once (`accepts` says when it
        listens): a fleet's supervisor restarts a dead master without waiting on it.

        It gets SIGTERM when the thread that started it ends, however it ends (a crashed test or
        CLI must not leave a master holding its ports): `transport.parent_death`'s exec wrapper,
        not `preexec_fn`, which is unsafe in a parent with threads."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(parent_death_command(self.argv), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self.proc

    def accepts(self) -> bool:
        """Whether its RPC port accepts connections now."""
        return _accepts(self.host, self.rpc_port)

    def _launch(self, wait_s: float) -> None:
        self.spawn()
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ConfigError(f"mooncake_master exited (rc {self.proc.returncode}) at start; see {self.log_path}")
            if _accepts(self.host, self.rpc_port):
                return
            time.sleep(0.1)
        self.stop()
        raise ConfigError(f"mooncake_master did not listen on {self.address} within {wait_s:.0f} s; "
                          f"see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill: bool = False) -> None:
        """Stop the master (`kill`: SIGKILL at once, as a crash would); idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def restart(self, wait_s: float = 60.0) -> None:
        """Stop and start again on the same ports: its objects are gone, clients reconnect."""
        self.stop()
        self._launch(wait_s)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


__all__ = ["MooncakeMaster", "master_binary"]

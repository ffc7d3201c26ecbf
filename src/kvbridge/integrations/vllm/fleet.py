"""A P/D fleet of `vllm serve` instances behind vLLM's own router: what `kvbridge serve` starts.

Why a launcher and no proxy of our own: people run P/D as `vllm serve` processes with
`--kv-transfer-config`, a router speaking NixlConnector's request protocol (`vllm-router
--vllm-pd-disaggregation`) and an OpenAI-compatible client. KVBridgeConnector speaks that
protocol, so the fleet is vLLM's parts only; this module computes their command lines (ports
checked free, one secret for the fleet in a 0600 file, the side channel on the given interface,
`kv_load_failure_policy: recompute` so a KV cache that cannot come is computed rather than
failed), checks every shape against vLLM's and kvbridge's rules before anything starts, starts
the processes each in its own session with its log in a file, waits for health, and stops them
all, leaving no process, port or shared-memory segment behind.

A fleet lives and dies with its launcher (issue 43 point 2): `start` writes what it starts in a
record beside the logs (`fleet_record.py`) and starts a watchdog (`transport/launcher_watch.py`)
holding copies of the port locks; a launcher that dies without `stop` (SIGKILL, an OOM kill)
leaves the watchdog to stop every member's session, remove the segments and the secret file, and
release the ports, within seconds. Why a watchdog and not a parent-death signal per member: that
signal follows the thread that forked the member, reaches only the member's leading process (not
vLLM's EngineCore, workers or kvbridge's sidecar), cannot wake a member SIGSTOPped by the
benchmark, and removes no file and releases no port.

Every instance is `kv_both` (it can serve either role; the router assigns them), runs vLLM with
prefix caching on (vLLM's serving default) and takes its shape from an `InstanceShape`.

Across hosts (`fleet_file.py`) a `Fleet` is one host's part: the members the file puts on that
host, on the file's ports and the host's own address, the operator's shared secret file (read,
never written or removed), and the router, if it runs there, with every instance's URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.fleet_config import (FleetConfig, FleetError, InstanceShape, check_environment,
                                                     check_shapes)
from kvbridge.integrations.vllm.fleet_file import place_here
from kvbridge.integrations.vllm.fleet_routing import DECODE_POLICY, KvRouting
from kvbridge.integrations.vllm.fleet_processes import (HEALTH_FAILURES, HEALTH_INTERVAL_S, Member, SegmentLedger,
                                                        _group_alive, _pids_in_groups, find_tool, health_flags,
                                                        healthy, kill_seen, port_free, process_start, retire_session,
                                                        stop_session, vllm_python, vllm_serve_member)
from kvbridge.integrations.vllm.fleet_record import MARK, FleetRecord, Leader
from kvbridge.transport.launcher_watch import LauncherWatch
from kvbridge.transport.ports import PortReservations


class Fleet:
    """The processes of one fleet: `start`, `wait_ready`, `stop` (also on SIGINT / SIGTERM by the CLI)."""

    def __init__(self, config: FleetConfig):
        self.config = config
        check_environment({**os.environ, **config.extra_env})  # what every member inherits
        self.python = vllm_python(config.vllm_python)
        config.vllm_python = self.python
        # A fleet across hosts (fleet_file.py): this launcher runs the members the file puts on
        # `config.on`, and the router if it is there; the shapes checked are the whole fleet's.
        self.here = place_here(config) if config.fleet_file is not None else None
        self.notes = check_shapes(config)
        vllm = find_tool(self.python, "vllm")
        router = find_tool(self.python, "vllm-router")
        if vllm is None:
            raise ConfigError(f"no `vllm` command beside {self.python} (the vLLM environment's python): pass "
                              "--vllm-python PATH of an environment with vLLM, or run `make vllm-env` in the kvbridge "
                              "repository")
        if router is None:
            raise ConfigError("no `vllm-router` command: `pip install 'kvbridge[serve]'` into the vLLM environment "
                              "(make vllm-env does)")
        self.log_dir = Path(config.log_dir).resolve()  # instances run in it: every path they get is absolute
        config.log_dir = self.log_dir
        if config.stats_path:
            config.stats_path = str(Path(config.stats_path).resolve())
        self.tag = os.urandom(4).hex()
        # In every member's environment (KVBRIDGE_FLEET): what a reaper knows the fleet's processes
        # by, the children of its members included, when its launcher is gone (fleet_record.py).
        self.mark = os.urandom(16).hex()
        self.record_path = self.log_dir / f"fleet-{self.tag}.json"
        self.watch: LauncherWatch | None = None  # started by `start`, told `done` by `stop`
        self._handed: set[int] = set()  # ports whose locks the watchdog holds copies of
        self._starts: dict[int, int] = {}  # session leader -> its process start (`process_start`)
        self._written: object = None  # the ledger as last recorded
        # Written by `start`, removed by `stop`; named by the fleet's tag, so two fleets sharing a
        # log directory never remove each other's. A given one (--secret-file: every host of a
        # fleet across hosts shares it) is only read.
        self.secret_file = Path(config.secret_file) if config.secret_file else self.log_dir / f"fleet-{self.tag}.secret"
        self._own_secret = not config.secret_file
        self.pool_secret_file = Path(config.pool_secret_file) if config.pool_secret_file else self.secret_file
        self.ledger = SegmentLedger()  # the segments of the fleet's processes (`track_segments`), removed at stop
        self._vllm, self._router_bin = vllm, router
        self._incarnation = 0
        # Every process session any member (the master too) ever led, by leader pid: `stop` kills
        # what is left of each, the sessions of dead incarnations included.
        self.sessions: dict[int, str] = {}
        # Every port the fleet binds, checked free on the interface that binds it and held (flock)
        # until `stop`: a fleet starting beside this one never promises the same port.
        self.port_locks = PortReservations()
        try:
            self._place(config)
        except BaseException:
            self.port_locks.release()
            raise

    def _place(self, config: FleetConfig) -> None:
        """The pool's master, the instances and the router, each on ports reserved for it."""
        router_here = self.here is None or config.fleet_file.router_host == config.on
        if router_here and (why := self.port_locks.take(config.port, config.host)):
            raise ConfigError(f"--port {config.port}: {why}" if self.here is None else
                              f"fleet file {config.fleet_file.path}: the router's port {config.port}: {why}")
        self.master = None  # the fleet's own mooncake_master (--pool start), launched by `start`
        self.pool_address = ""
        if config.pool == "start":
            from kvbridge.pool.master import MooncakeMaster
            for _ in range(50):  # its ports are drawn free on 127.0.0.1: taken only when free on its host too
                self.master = MooncakeMaster.prepare(self.log_dir / "mooncake-master.log", config.side_channel_host)
                if not self.port_locks.take(self.master.rpc_port, self.master.host):
                    if not self.port_locks.take(self.master.metrics_port, self.master.host):
                        break
                    self.port_locks.drop(self.master.rpc_port)
            else:
                raise ConfigError(f"no two free ports for the pool's master on {config.side_channel_host}")
            self.pool_address = self.master.address
        elif config.pool:
            self.pool_address = config.pool
        self.routing = (KvRouting(self.port_locks, pool_tier="host" if config.pool_host_mib else "external")
                        if config.router_policy == "kv_aware" else None)
        self.members: list[Member] = []
        if self.here is not None:
            self._place_from_file(config)
        else:
            for role, shapes in (("prefill", config.prefill), ("decode", config.decode)):
                for i, shape in enumerate(shapes):
                    self.members.append(self._new_instance(f"{role}-{i}", role, shape))
        self._prometheus = self.port_locks.run(["127.0.0.1"]) if router_here else 0  # the router's metrics
        self.router = self._router() if router_here else None

    def _place_from_file(self, config: FleetConfig) -> None:
        """This host's instances on the file's ports, each checked free on this host's address and
        reserved; refused in one line naming the file and the instance."""
        for p in self.here:
            for port, host in zip(p.ports, [config.host] + [config.side_channel_host] * (len(p.ports) - 1)):
                if (why := self.port_locks.take(port, host)):
                    raise ConfigError(f"fleet file {config.fleet_file.path}: instance {p.name}'s port {port}: {why}")
            self.members.append(self._instance(self._vllm, p.name, p.role, p.shape, p.port, p.side_port))

    @property
    def _promised(self) -> set[int]:
        """Every port the fleet holds (callers starting more servers beside it exclude them)."""
        return self.port_locks.ports

    def _new_instance(self, name: str, role: str, shape: InstanceShape) -> Member:
        c = self.config  # HTTP on --host, then one side-channel port per rank on --side-channel-host
        base = self.port_locks.run([c.host] + [c.side_channel_host] * (shape.tp * shape.pp))
        return self._instance(self._vllm, name, role, shape, http_port=base, side_port=base + 1)

    def routes(self) -> list[tuple[str, str]]:
        """(role, URL) of every instance of the fleet, this host's and, across hosts, the others'."""
        if self.here is None:
            return [(m.role, m.url) for m in self.members]
        return [(p.role, p.url) for p in self.config.fleet_file.instances]

    def _router(self) -> Member:
        c = self.config
        argv = [self._router_bin, "--host", c.host, "--port", str(c.port), "--vllm-pd-disaggregation",
                "--policy", c.router_policy if self.routing is None else DECODE_POLICY, "--prometheus-host",
                "127.0.0.1", "--prometheus-port", str(self._prometheus), "--request-timeout-secs",
                str(c.request_timeout_s), "--worker-startup-timeout-secs", "1800", *health_flags()]
        for role, url in self.routes():
            argv += [f"--{role}", url]
        if self.routing is not None:
            argv += self.routing.router_args(self.routes(), {m.url: m.name for m in self.members})
        return Member("router", argv, dict(os.environ), self.log_dir / "router.log", c.port, argv_host=c.host)

    def _instance(self, vllm: str, name: str, role: str, shape: InstanceShape, http_port: int,
                  side_port: int) -> Member:
        """One instance of the fleet; a prefill instance of a kv_aware fleet publishes its KV events."""
        member = self._serve_member(vllm, name, role, shape, http_port, side_port)
        if self.routing is not None and role == "prefill":
            self.routing.instance_args(member)
        return member

    def _serve_member(self, vllm: str, name: str, role: str, shape: InstanceShape, http_port: int,
                      side_port: int) -> Member:
        c = self.config
        engine_id = f"{name}-{self.tag}" + (f"-{self._incarnation}" if self._incarnation else "")
        if c.connector == "nixl":  # vLLM's own, the benchmark's baseline (same fleet, same router)
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": engine_id,
                  "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute"}
            member = vllm_serve_member(c, vllm, name, shape, http_port, self.log_dir, kv)
            member.env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=c.side_channel_host, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port))
            member.engine_id, member.side_port, member.role = engine_id, side_port, role
            return member
        extra = {"transport": shape.transport, "mode": shape.mode, "side_channel_host": c.side_channel_host,
                 "side_channel_port": side_port, "secret_file": str(self.secret_file)}
        if c.stats_path:
            extra["stats_path"] = c.stats_path
        kv = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
              "kv_role": "kv_both", "engine_id": engine_id, "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
        if self.pool_address:  # P/D first (a decode instance loads from its prefill), then the shared pool
            pool = {"kv_connector": "KVBridgePoolConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": {
                        "master": self.pool_address, "secret_file": str(self.pool_secret_file),
                        "block_tokens": c.pool_block_tokens, "model_id": str(Path(c.model).resolve()),
                        "host_mib": c.pool_host_mib, "kv_events": self.routing is not None and role == "prefill"}}
            children = [{k: v for k, v in kv.items() if k != "engine_id"}, pool]
            kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": engine_id,
                  "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"connectors": children}}
        member = vllm_serve_member(c, vllm, name, shape, http_port, self.log_dir, kv)
        member.engine_id, member.side_port, member.role = engine_id, side_port, role
        return member

    @property
    def endpoint(self) -> str:
        """The router's URL (across hosts: as the file names it, wherever it runs)."""
        return self.router.url if self.here is None else self.config.fleet_file.router_url

    def pool_unreachable(self) -> str:
        """'' when the fleet has no pool or its master accepts connections, else the one line to say
        (the instances serve without the pool and start using it when it answers)."""
        if not self.pool_address or self.master is not None:
            return ""
        from kvbridge.pool.store import reachable
        if reachable(self.pool_address):
            return ""
        return (f"the pool's master {self.pool_address} does not accept connections: the instances serve without "
                f"the pool and use it once it does")

    def everyone(self) -> list[Member]:
        """The members this launcher runs: its instances and the router, if it runs here."""
        return [*self.members, *([self.router] if self.router is not None else [])]

    def start_member(self, m: Member) -> None:
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(m.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      env={**m.env, MARK: self.mark}, start_new_session=True, cwd=str(self.log_dir))
        self._led(m.proc, m.name)

    def _led(self, proc: subprocess.Popen, name: str) -> None:
        """Note a session a member leads, in memory and in the record."""
        self.sessions[proc.pid] = name
        start = process_start(proc.pid)  # unreaped: the pid is still this process's
        if start is not None:
            self._starts[proc.pid] = start
        self._record()

    def _record(self) -> None:
        """Write the record a reaper reads (`fleet_record.py`), once `start` has begun."""
        if self.watch is None:
            return
        ledger = self.ledger.to_json()
        record = FleetRecord(tag=self.tag, mark=self.mark, launcher_pid=os.getpid(),
                             launcher_start=process_start(os.getpid()) or 0,
                             secret_file=str(self.secret_file) if self._own_secret else "",
                             leaders=[Leader(pid, self._starts[pid], name) for pid, name in self.sessions.items()
                                      if pid in self._starts],
                             segments=ledger["segments"], procs=ledger["procs"])
        try:
            record.write(self.record_path)
        except OSError:  # the log directory went: the reaper still finds the members by their mark (its argument)
            return
        self._written = ledger

    def _hand_ports(self) -> None:
        """Give the watchdog copies of the port locks it does not hold yet."""
        fresh = {p: fd for p, fd in self.port_locks.descriptors().items() if p not in self._handed}
        if self.watch is not None and fresh:
            self.watch.hold(fresh.values())
            self._handed |= set(fresh)

    def start(self) -> None:
        """Start every instance (together: their imports overlap), then the router; first the
        record and the watchdog that stops them all if this process dies without `stop`."""
        from kvbridge.core.secrets import write_secret_file
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.watch = LauncherWatch([sys.executable, "-m", "kvbridge.integrations.vllm.fleet_record", "reap",
                                    str(self.record_path), self.mark], self.log_dir / "watchdog.log", cwd=self.log_dir)
        self._record()  # before the secret file: a launcher dying from here on leaves nothing behind
        self._hand_ports()
        if self._own_secret:
            if self.secret_file.exists():
                self.secret_file.unlink()
            write_secret_file(self.secret_file)
        if self.master is not None:
            self.master.launch()
            self._led(self.master.proc, "master")
        if self.routing is not None:
            self.routing.start()
        for m in self.members:
            self.start_member(m)
        if self.router is not None:
            self.start_member(self.router)

    def wait_ready(self, timeout: float, on_progress: Callable[[list[tuple[str, str]]], None] | None = None) -> None:
        """Until every instance and the router answer /health; a member that exits raises."""
        deadline = time.monotonic() + timeout
        while True:
            states = [(m.name, m.state()) for m in self.everyone()]
            if on_progress:
                on_progress(states)
            for (name, st), m in zip(states, self.everyone()):
                if st.startswith("exited"):
                    cause = m.cause() or "its log names no error"
                    raise FleetError(f"{name} {st} during start: {cause} (its log: {m.log_path})\n"
                                     f"last lines of that log:\n{m.log_tail(8)}")
            self.track_segments()
            if all(st == "ready" for _, st in states):
                return
            if time.monotonic() > deadline:
                late = [n for n, st in states if st != "ready"]
                raise FleetError(f"not healthy after {timeout:.0f} s: {', '.join(late)} (logs in {self.log_dir})")
            time.sleep(1.0)

    def stop_member(self, m: Member, timeout: float = 20.0) -> None:
        """SIGTERM the member's process session, then SIGKILL what is left of it after `timeout`
        (what it maps noted in the fleet's ledger, removed at the fleet's stop)."""
        stop_session(m.proc, timeout, self.ledger)
        m.proc = None

    def member(self, name: str) -> Member:
        for m in self.everyone():
            if m.name == name:
                return m
        raise ConfigError(f"no fleet member named {name!r}")

    def kill(self, name: str) -> None:
        """SIGKILL a member's whole session (a crash: nothing of it shuts down cleanly)."""
        m = self.member(name)
        self.track_segments()
        if m.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(m.proc.pid, signal.SIGKILL)
            end = time.monotonic() + 30
            while _group_alive(m.proc.pid) and time.monotonic() < end:
                m.proc.poll()
                time.sleep(0.1)
            m.proc.poll()
            m.proc = None

    def restart(self, name: str) -> Member:
        """Start member `name` again on its ports as a new incarnation (a new engine id, as a
        restarted vLLM instance has); the caller waits for its health."""
        old = self.member(name)
        if old.proc is not None:
            self.stop_member(old)
        self._incarnation += 1
        if self.routing is not None:
            self.routing.forget(name)
        new = self._instance(self._vllm, name, old.role, old.shape, old.http_port, old.side_port)
        self.members[self.members.index(old)] = new
        self.start_member(new)
        return new

    def join(self, role: str, shape: InstanceShape) -> Member:
        """Start one more instance (`role` prefill or decode); `restart_router` then routes to it."""
        count = sum(m.role == role for m in self.members)
        m = self._new_instance(f"{role}-{count}", role, shape)
        self._hand_ports()
        self.members.append(m)
        self.start_member(m)
        return m

    def restart_router(self) -> None:
        """Stop the router (it finishes what it accepted) and start it with every member: vLLM's
        router takes no new P/D workers while it runs."""
        if self.router is None:
            return
        self.stop_member(self.router, timeout=30.0)
        self.router = self._router()
        self.start_member(self.router)

    # What the supervisor (fleet_supervisor.py) sees of a member, by name: the instances, "router"
    # and, with --pool start, "master".

    def supervised(self) -> list[str]:
        return [m.name for m in self.everyone()] + (["master"] if self.master is not None else [])

    def process(self, name: str) -> subprocess.Popen | None:
        return self.master.proc if name == "master" and self.master is not None else self.member(name).proc

    def answers(self, name: str) -> bool:
        """Whether member `name` serves: an instance's or the router's /health, the master's RPC port."""
        if name == "master" and self.master is not None:
            return self.master.accepts()
        return healthy(self.member(name).url)

    def log_of(self, name: str) -> Path:
        return self.master.log_path if name == "master" and self.master is not None else self.member(name).log_path

    def retire(self, name: str) -> None:
        """Kill what is left of member `name`'s session once its leader exited (`retire_session`)."""
        proc = self.process(name)
        if proc is None:
            return
        retire_session(proc, self.ledger)
        if name == "master":
            self.master.proc = None
        else:
            self.member(name).proc = None

    def relaunch(self, name: str) -> subprocess.Popen:
        """Start member `name` again on its ports without waiting for it: an instance as a new
        incarnation (`restart`), the router with every member, the master on its RPC and metrics
        ports (its objects are gone; the instances' clients re-register by themselves)."""
        if name == "master" and self.master is not None:
            proc = self.master.spawn()
            self._led(proc, "master")
            return proc
        if name == "router":
            self.restart_router()
            return self.router.proc
        return self.restart(name).proc

    def track_segments(self) -> None:
        """Note the shared-memory segments the fleet's processes map (vLLM's TP channels, Python's
        multiprocessing blocks and semaphores, kvbridge's caches): killed workers leave theirs in
        /dev/shm, and `stop` removes them. Called while waiting for health and by the CLI's watch."""
        self.ledger.track(*(m.proc.pid for m in self.everyone() if m.proc is not None))
        if self.watch is not None and self.ledger.to_json() != self._written:
            self._record()

    @property
    def segments(self) -> set[str]:
        """The /dev/shm names the fleet's processes mapped or created."""
        return self.ledger.own()

    def stop(self) -> None:
        """Stop the router first (no new requests), then every instance; remove their segments."""
        self.track_segments()
        if self.router is not None:
            self.stop_member(self.router, timeout=5.0)
        for m in self.members:
            if m.proc is not None:
                try:
                    os.killpg(m.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for m in self.members:
            self.stop_member(m)
        if self.routing is not None:
            with contextlib.suppress(Exception):  # the rest of the stop must run whatever the relay says
                self.routing.close()
        if self.master is not None:
            self.master.stop()
        for leader in self.sessions:  # every incarnation's session: what `retire` or the stops left
            kill_seen(leader, self.ledger)
        end = time.monotonic() + 10
        while self.ledger.live(_pids_in_groups(set(self.sessions), zombies=False)) and time.monotonic() < end:
            time.sleep(0.1)
        self.ledger.remove_unused()  # only the fleet's own (SegmentLedger): nothing by age
        if self._own_secret:
            try:
                self.secret_file.unlink()
            except OSError:
                pass
        if self.watch is not None:  # last: a launcher killed while stopping leaves the rest to it
            with contextlib.suppress(OSError):
                self.record_path.unlink()
            self.watch.done()
            self.watch = None
        self.port_locks.release()

    def summary(self) -> dict[str, Any]:
        """What `kvbridge serve --json` prints once the fleet is healthy."""
        return {"endpoint": self.endpoint, "model": "model", "log_dir": str(self.log_dir),
                "watchdog": {"pid": self.watch.proc.pid if self.watch else None, "record": str(self.record_path)},
                "ports": sorted(self.port_locks.ports),  # every port the fleet binds, held until it stops
                "instances": [{"name": m.name, "url": m.url, "shape": m.shape.describe() if m.shape else None,
                               "engine_id": m.engine_id, "pid": m.proc.pid if m.proc else None,
                               "log": str(m.log_path)} for m in self.members],
                "router": {"url": self.endpoint, "pid": self.router.proc.pid if self.router.proc else None,
                           "metrics": f"http://127.0.0.1:{self._prometheus}",
                           "log": str(self.router.log_path)} if self.router is not None else
                          {"url": self.endpoint, "on": self.config.fleet_file.router_host},
                "pool": {"master": self.pool_address, "block_tokens": self.config.pool_block_tokens,
                         "metrics": self.master.metrics_url if self.master else None,  # on loopback
                         "pid": self.master.proc.pid if self.master and self.master.proc else None,
                         "log": str(self.master.log_path) if self.master else None} if self.pool_address else None}

    def curl_example(self) -> str:
        body = json.dumps({"model": "model", "prompt": "Hello", "max_tokens": 16, "temperature": 0})
        return f"curl -s {self.endpoint}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


__all__ = ["HEALTH_FAILURES", "HEALTH_INTERVAL_S", "Fleet", "FleetConfig", "FleetError", "InstanceShape", "Member", "check_shapes", "healthy", "port_free",
           "vllm_serve_member"]

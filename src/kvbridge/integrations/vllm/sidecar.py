"""The kvbridge side of one vLLM worker rank, in a process of its own (no vLLM import here).

Why a process and not a thread in the vLLM worker: the kvbridge `Producer`/`Consumer` must
answer handshakes, announce leases and run transfers while the engine works. In a vLLM CPU
worker the engine thread holds the GIL through its steps (and busy-loops empty steps while a
prefill lease is outstanding), and on a loaded two-core host a thread of ours there was
starved for over 10 s, past the 5 s handshake deadline (measured: "sleep 0.0005 s took
10.4 s"). A sidecar process has its own interpreter: only the OS schedules it.

Memory: the worker hands over a handle to the memory behind the KV cache tensors vLLM registered
(`cache_handles.py`: a CUDA IPC handle on GPU; on CPU a kvbridge shared-memory segment the cache
moved into once, at registration); the sidecar maps the same memory and adopts each layer's
bytes as a `RankCache` region, so the transport reads and writes vLLM's own cache, no copy.

Protocol (`sidecar_protocol.py`): `connector.rank_host`'s typed messages as length-prefixed frames, commands on the
sidecar's stdin, events on its stdout (the sidecar's own prints and logs go to stderr, which is
the worker's log; stdin/stdout because the worker starts it with `subprocess`, outside any
multiprocessing context vLLM owns):

    worker -> sidecar   Init, then any of Send / Recv / Expect / Abandon, then Close (or EOF)
    sidecar -> worker   Ready(address), then Released / Received per request, Fatal(error)

The sidecar exits on Close, on EOF of its stdin (the worker died) or when its parent changes.
It uses public APIs only: the connector's, and `cache_handles.open_regions` to map the worker's
memory.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import msgspec

from kvbridge.connector.rank_host import (Peer, StreamChannel, report_failure, serve, stderr_logging, union_of,
                                          warm_copier)
from kvbridge.errors import KVBridgeError
from kvbridge.integrations.vllm.sidecar_protocol import (Abandon, Close, Command, Event, Expect, Fatal, Init, Ready,
                                                         Received, Recv, Released, Send)

log = logging.getLogger("kvbridge.vllm.sidecar")

POLL_ACTIVE_S = 0.001
"""How long one loop round waits for side-channel traffic while this rank's own transfers are
in flight (their completion is polled, not signalled)."""
POLL_IDLE_S = 0.01
"""How long one loop round waits otherwise: everything else this rank waits for (a handshake, a
ReadDone, a heartbeat) arrives on a socket and ends the wait at once; worker commands wait at
most this long. (The loop used to wait 0.5 ms while any request was held, which ZMQ's
millisecond poll rounds to 0: the sidecar spun a whole core at nice -10 for as long as a
prefill request waited for its reader, starving the vLLM processes of both engines on a 2-core
host; measured: a prefill sidecar at 89 % CPU, the decode engine's worker at 4 %, its engine
core waiting 60 s for a step.)"""


# -- the sidecar (child side) -----------------------------------------------------------------------
class Sidecar:
    """Producer and/or Consumer of one rank over the worker's shared-memory cache; step-driven."""

    def __init__(self, init: Init, emit):
        from kvbridge.connector.consumer import Consumer
        from kvbridge.connector.producer import Producer
        from kvbridge.connector.transports import make_transport
        from kvbridge.integrations.vllm.layout import VllmTopology, as_vllm_cpu, vllm_cpu_spec
        from kvbridge.integrations.vllm.cache_handles import open_regions
        from kvbridge.integrations.vllm.idle_wake import IdleWaker
        from kvbridge.transport.cache import RankCache

        self.init, self._emit, s = init, emit, init.settings
        self._waker = IdleWaker(init.engine_id)  # ends the engine's idle pause when a transfer ends
        self.settings = s
        layout = as_vllm_cpu(init.layout)
        spec = vllm_cpu_spec(init.spec)  # the wire carries plain LayerSpecs
        nbytes = layout.addressing(spec, init.rank).region_nbytes
        if len(nbytes) != len(init.regions):
            raise KVBridgeError(f"{len(init.regions)} regions given, the layout has {len(nbytes)}")
        for r, n in zip(init.regions, nbytes):
            if r.nbytes != n:
                raise KVBridgeError(f"a region of {r.nbytes} bytes where the layout has {n}")
        self.cache = RankCache(spec, layout, init.rank, open_regions(init.storages, init.regions))
        cfg = s.connector_config(init.identity)
        eid, r = init.engine_id, init.rank
        self.producer = self.consumer = None
        self.address = ""
        if init.produce:
            addresses = [f"{s.side_channel_host}:{s.side_channel_port + q}" for q in range(layout.tp_size)]
            transport = make_transport(s.transport, f"{eid}/p{r}", host=s.side_channel_host,
                                       timeout_s=s.transfer_timeout)
            # A reader is leased to only once it is past its handshake (`Producer.confirmed_ranks`):
            # a frame sent right behind the Hello reply can be dropped by the reader's handshake,
            # and that reader would then wait out the whole lease (seen on a loaded 2-core host with
            # a timed 0.25 s pause, the former rule). The decode sidecar confirms with an empty
            # Heartbeat after `connect` and after its consumer re-handshook a lost source.
            self.producer = Producer(eid, r, self.cache, transport, listen=addresses[r], mode=s.mode, config=cfg,
                                     on_release=self._released, peer_addresses=addresses,
                                     topology=VllmTopology(eid, spec, layout, r))
            self.address = self.producer.address
        if init.consume:
            self.consumer = Consumer(eid, r, self.cache, make_transport(s.transport, f"{eid}/d{r}", host=s.side_channel_host,
                                                                       timeout_s=s.transfer_timeout),
                                     mode=s.mode, config=cfg, topology=VllmTopology(eid, spec, layout, r))
        self._held: dict[str, tuple[Send, float]] = {}
        self._pending: list[Recv] = []
        self._recv: dict[str, Recv] = {}  # remote request id -> request
        self._recovered = 0  # the consumer's count of re-handshaken sources, last seen
        from kvbridge.integrations.vllm.step_profile import StepProfile
        self.profile = StepProfile()  # KVBRIDGE_STEP_PROFILE: rounds that used the CPU (issue 31)
        warm_copier()

    # commands
    def handle(self, cmd: Any) -> None:
        if isinstance(cmd, Send) and self.producer is not None:
            log.info("prefill rank %d: %s complete (%d tokens), waiting for its decode ranks", self.init.rank,
                     cmd.request_id, cmd.num_tokens)
            self._held[cmd.request_id] = (cmd, time.monotonic() + self.settings.lease_seconds)
        elif isinstance(cmd, Recv) and self.consumer is not None:
            self._pending.append(cmd)
        elif isinstance(cmd, Expect) and self.consumer is not None:
            if self._connect(cmd.remote_engine_id, cmd.remote_address):
                try:
                    self.consumer.expect(cmd.remote_request_id, engine_id=cmd.remote_engine_id)
                except KVBridgeError as e:
                    log.warning("expect %s: %s", cmd.remote_request_id, e)
        elif isinstance(cmd, Abandon) and self.consumer is not None:
            if cmd.remote_engine_id in self.consumer.prefill_engines:
                self.consumer.abort(cmd.remote_request_id, "the decode engine dropped the request before loading it")

    def step(self, timeout: float | None = None) -> float:
        """One round of work, waiting at most `timeout` s for side-channel traffic (default: a
        short wait while this rank's own transfers are in flight, a longer one otherwise)."""
        if timeout is None:
            timeout = POLL_ACTIVE_S if self.transferring else POLL_IDLE_S
        if self.profile.on:
            t0, cpu0 = time.monotonic(), time.process_time()
            self._step(timeout)
            cpu = time.process_time() - cpu0
            if cpu > 0.0005:  # the rounds that worked, not those that only waited
                self.profile.record("sidecar", t0, time.monotonic() - t0, f"{cpu * 1e3:.3f}",
                                    len(self.consumer.active) if self.consumer is not None else 0,
                                    len(self.producer.active) if self.producer is not None else 0)
            return 0.0
        self._step(timeout)
        return 0.0

    def _step(self, timeout: float) -> None:
        if self.producer is not None:
            self.producer.progress(timeout if self.consumer is None else 0.0)
            self._lease_held()
        if self.consumer is not None:
            self._start_pending()
            for res in self.consumer.progress(timeout):
                self._result(res)
            recovered = self.consumer.stats.get("sources_recovered", 0)
            if recovered != self._recovered:  # a lost source is back on a new connection
                self._recovered = recovered
                for engine in self.consumer.prefill_engines:
                    self._confirm(engine)

    def stats(self) -> dict[str, int]:
        return {f"{side}.{k}": v for side, c in (("producer", self.producer), ("consumer", self.consumer))
                if c is not None for k, v in c.stats.items()}

    @property
    def transferring(self) -> bool:
        """True while this rank's own transfers are in flight (their completion is polled)."""
        return bool((self.consumer is not None and (self.consumer.active or self._pending))
                    or (self.producer is not None and self.settings.mode == "push" and self.producer.active))

    def emit(self, event: Any) -> None:
        """Hand the worker an event, and wake its engine's scheduler from an idle pause (`idle_wake`):
        the step that reads the event runs now, not when the pause ends."""
        self._emit(event)
        self._waker.poke()

    def close(self) -> None:
        self._waker.close()
        for side in (self.consumer, self.producer):
            if side is not None:
                try:
                    side.close()
                finally:
                    side.transport.close()

    # prefill
    def _lease_held(self) -> None:
        """Lease a held request once every decode rank that reads it has confirmed its handshake
        (see `_confirming_producer`); release it (vLLM frees the blocks) if that does not happen
        within the lease."""
        now = time.monotonic()
        engines = self.producer.decode_engines
        for rid, (req, deadline) in list(self._held.items()):
            named = req.to_engine
            aborted = self.producer.take_early_abort(rid)
            if aborted is not None:  # its decode engine gave it up before it was leased here
                del self._held[rid]
                self._released(rid, aborted)
                continue
            if named is None:
                # The router named no decode engine: the one that claims it (its heartbeat names the
                # request as soon as the router hands it the request) reads it. Never "the only one
                # connected": decode engines connect to a prefill engine on their first request from
                # it, so in a fleet of several the only one connected so far is often not the reader
                # (it was leased to decode-1 while decode-0 waited for it until its deadline).
                claimant = self.producer.claimant(rid)
                target = claimant if claimant in engines else None
                if target is None and engines and all(not self.producer.topology.reader_ranks(e) for e in engines):
                    target = engines[0]  # no decode engine reads this rank (GQA de-duplication, MLA): release now
            else:
                target = named if named in engines else None
            confirmed = set(self.producer.confirmed_ranks(target)) if target is not None else set()
            waiting = (None if target is None else [r for r in self.producer.topology.reader_ranks(target)
                                                    if r not in confirmed])
            if waiting is None or waiting:
                if now > deadline:
                    del self._held[rid]
                    self._released(rid, f"decode engine {named or '(any)'} did not connect within the lease"
                                   if waiting is None else
                                   f"decode engine {target} rank(s) {waiting} did not finish their handshake with "
                                   f"prefill rank {self.init.rank} within the lease (connected: "
                                   f"{list(self.producer.reader_ranks(target))})")
                continue
            del self._held[rid]
            log.info("prefill rank %d: leasing %s to %s", self.init.rank, rid, target)
            try:
                self.producer.add_request(rid, req.block_ids, req.num_tokens, to_engine=target,
                                          lease_seconds=max(1.0, deadline - now))
            except KVBridgeError as e:
                log.error("prefill rank %d cannot lease %s: %s", self.init.rank, rid, e)
                self._released(rid, f"refused: {e}")

    def _released(self, request_id: str, reason: str) -> None:
        self._stat("release", request_id=request_id, reason=reason,
                   producer=dict(self.producer.stats) if self.producer is not None else None)
        self.emit(Released(request_id, reason))

    # decode
    def _connect(self, engine: str, address: str) -> bool:
        if engine in self.consumer.prefill_engines:
            return True
        log.info("decode rank %d: handshake with %s at %s", self.init.rank, engine, address)
        try:
            got = self.consumer.connect(address)
        except Exception as e:  # noqa: BLE001 - refusals and unreachable peers alike
            log.error("decode rank %d: handshake with %s at %s failed: %s", self.init.rank, engine, address, e)
            return False
        if got != engine:
            log.error("decode rank %d: %s answered as engine %s, expected %s", self.init.rank, address, got, engine)
            return False
        self._confirm(got)
        return True

    def _confirm(self, engine: str) -> None:
        """Tell every source rank of `engine` that our handshake with it is over, so that it
        announces leases only now (`Producer.confirmed_ranks`). After `connect`, and after the
        consumer re-handshook a lost source (its re-handshake drops frames that come with the
        reply, too)."""
        for s in self.consumer.touch(engine):
            log.error("decode rank %d: cannot confirm the handshake to %s rank %d (side channel full or closed)",
                      self.init.rank, engine, s)

    def _start_pending(self) -> None:
        pending, self._pending = self._pending, []
        for req in pending:
            if not self._connect(req.remote_engine_id, req.remote_address):
                self._fail(req, f"no handshake with prefill engine {req.remote_engine_id} at {req.remote_address}")
                continue
            try:
                self.consumer.receive(req.remote_request_id, req.block_ids, num_tokens=req.num_tokens,
                                      num_cached_tokens=req.num_cached_tokens, engine_id=req.remote_engine_id)
            except KVBridgeError as e:
                self._fail(req, str(e))
                continue
            self._recv[req.remote_request_id] = req

    def _fail(self, req: Recv, reason: str) -> None:
        log.error("decode rank %d: request %s failed: %s", self.init.rank, req.request_id, reason)
        self._stat("recv", request_id=req.request_id, remote_request_id=req.remote_request_id, ok=False,
                   reason=reason, consumer=dict(self.consumer.stats))
        if req.report:
            self.emit(Received(req.request_id, False, reason))

    def _result(self, res: Any) -> None:
        req = self._recv.pop(res.request_id, None)
        if req is None:
            return
        if not res.ok:
            self._fail(req, res.reason)
            return
        self._stat("recv", request_id=req.request_id, remote_request_id=req.remote_request_id, ok=True,
                   nbytes=res.nbytes, nruns=res.nruns, transfer_seconds=res.transfer_seconds, seconds=res.seconds,
                   num_tokens=res.num_tokens, num_cached_tokens=req.num_cached_tokens,
                   local_layout=self.cache.layout.describe())
        if req.report:
            self.emit(Received(req.request_id, True))

    def _stat(self, event: str, **fields: Any) -> None:
        path = self.settings.stats_path
        if not path:
            return
        line = json.dumps({"event": event, "engine_id": self.init.engine_id, "rank": self.init.rank,
                           "tp_size": self.cache.layout.tp_size, "time": time.time(), **fields})
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError as e:  # figures are optional: a stats file that cannot be written never stops a transfer
            log.error("stats_path %s cannot be written (%s); transfer events are no longer recorded", path, e)
            self.settings = msgspec.structs.replace(self.settings, stats_path="")


def _raise_priority(nice: int = -10) -> None:
    """Run ahead of (and beside) the vLLM processes where allowed: a vLLM CPU worker spins (sched_yield) for a
    second after every engine step, and an engine that waits for a transfer steps continuously,
    so on a 2-core host the transfer's own process was starved for minutes (measured: a prefill
    sidecar answered no handshake for 120 s while both cores spun). Unprivileged: no change."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except (PermissionError, OSError, AttributeError):
        pass
    # vLLM binds each CPU worker (and so its children) to its OpenMP cores; with TP > 1 a rank's
    # sidecar would share one core with that rank's spinning worker. Run on every allowed CPU.
    try:
        os.sched_setaffinity(0, os.sched_getaffinity(1) or range(os.cpu_count() or 1))
    except (PermissionError, OSError, AttributeError):
        pass


def main() -> None:  # pragma: no cover - runs as the sidecar process
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints go to the worker's log, never into the event stream
    stderr_logging("kvbridge sidecar")
    parent = os.getppid()
    _raise_priority()
    channel = StreamChannel(0, out, Command)
    try:
        init = None
        deadline = time.monotonic() + 60
        while init is None:
            msgs = channel.recv(1.0)
            if msgs:
                init = msgs[0]
            elif channel.eof or time.monotonic() > deadline:
                return
        sidecar = Sidecar(init, channel.send)
        channel.send(Ready(sidecar.address, os.getpid()))
        serve(channel, sidecar, parent=parent)
    except BaseException as e:  # noqa: BLE001 - the worker reports it
        report_failure(channel, e)


# -- the worker's handle (parent side) ------------------------------------------------------------
class SidecarError(KVBridgeError, RuntimeError):
    pass


class SidecarClient(Peer):
    """Start the sidecar for one rank and talk to it without ever blocking the engine step."""

    def __init__(self, init: Init, python: str | None = None, start_timeout: float = 180.0):
        self.proc = subprocess.Popen([python or sys.executable, "-m", "kvbridge.integrations.vllm.sidecar"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # never_block: the worker sends from its engine step, which must not wait for a sidecar that
        # is starved, stopped or busy (issue 31); what the pipe cannot take goes with the next call.
        super().__init__(StreamChannel(self.proc.stdout.fileno(), self.proc.stdin, union_of(Event, Fatal),
                                       never_block=True), f"kvbridge sidecar of rank {init.rank}", SidecarError)
        self.send(init)
        try:
            self.ready: Ready = self.expect(Ready, start_timeout)
        except SidecarError:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _running(self) -> bool:
        return self.alive

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def send_all(self, msgs: list[Any]) -> None:
        """One step's commands in one write, never waiting (the rest goes with the next call)."""
        if not msgs:
            return
        try:
            self.channel.send_all(msgs)
        except (BrokenPipeError, OSError, ValueError) as e:
            raise SidecarError(f"{self.name}: cannot send {len(msgs)} commands: {e}{self._why()}") from None

    @property
    def unsent(self) -> int:
        """Bytes of commands the sidecar has not taken yet."""
        return len(self.channel.out)

    def events(self) -> list[Any]:
        """Every event that arrived since the last call (first handing over unsent commands)."""
        self.pump(0.0)
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def close(self, timeout: float = 5.0) -> None:
        if self.alive:
            try:
                self.send(Close())
                deadline = time.monotonic() + timeout
                while self.channel.flush_out() and self.alive and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except (SidecarError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


__all__ = ["Sidecar", "SidecarClient", "SidecarError", "main"]


if __name__ == "__main__":
    main()

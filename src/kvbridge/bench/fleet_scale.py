"""What one rank of a P/D fleet pays as the fleet grows: side-channel connections, descriptors,
ZMQ sockets, threads, memory and handshake time, measured on real connector ranks.

Why per rank: every rank is its own process in a served fleet (a vLLM worker and its sidecar), and
what it holds depends only on the remote ranks it talks to. So one *observed* rank in this process
talks to a *crowd* of remote engines hosted by a few spawned processes (each crowd engine is whole:
all its TP ranks, real `Producer`s or `Consumer`s, shm transport agents, authenticated ZMQ side
channels on loopback), and the observed rank's own /proc counts are read as the crowd grows. A
fleet's total is the sum over its ranks; the crowd processes hold at most 1/`crowds` of the
crowd's sockets each, so no process here nears ZMQ's 1,023 sockets per context.

Two scans, engines of TP `tp` on both sides:

* `decode_scan`: decode rank 0 of a decode engine connects to 1..N prefill engines, one by one
  (what a decode rank does as requests from new prefill instances reach it);
* `prefill_scan`: decode engines 1..N, every rank, connect to one prefill engine whose rank 0 is
  observed (every decode rank's handshake starts at rank 0, which lists the engine's ranks).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import zmq

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.consumer import Consumer
from kvbridge.connector.producer import Producer
from kvbridge.connector.transports import allocate_cache, make_transport
from kvbridge.core.layout import EngineLayout
from kvbridge.core.secrets import generate_secret
from kvbridge.core.spec import ModelSpec

SPEC = ModelSpec.uniform(1, 8, 16, "bfloat16", name="fleet-scale")  # 8 KV heads: TP 8 gives each rank one
STEPS = (2, 4, 8, 16, 32, 64)


def layout(tp: int) -> EngineLayout:
    return EngineLayout(tp_size=tp, block_size=16, num_blocks=2)


@dataclass
class Counts:
    """One process's holdings, from /proc (sockets split by TCP state from /proc/net/tcp*)."""

    fds: int
    tcp_established: int
    tcp_listening: int
    eventfds: int  # a ZMQ socket's mailbox is one eventfd: about one per ZMQ socket
    shm_maps: int  # kvbridge segments mapped (a peer's cache is mapped by the shm transport)
    threads: int
    rss_kib: int


def _tcp_states() -> dict[str, str]:
    states: dict[str, str] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    states[cols[9]] = cols[3]
        except OSError:
            continue
    return states


def counts(pid: int | None = None) -> Counts:
    base = f"/proc/{pid or os.getpid()}"
    states = _tcp_states()
    est = lis = evs = 0
    fds = 0
    for name in os.listdir(f"{base}/fd"):
        try:
            target = os.readlink(f"{base}/fd/{name}")
        except OSError:
            continue
        fds += 1
        if target.startswith("socket:["):
            state = states.get(target[8:-1])
            est += state == "01"
            lis += state == "0A"
        elif target == "anon_inode:[eventfd]":
            evs += 1
    with open(f"{base}/maps") as f:
        shm = len({line.split(maxsplit=5)[5].removesuffix(" (deleted)") for line in f if "/dev/shm/kvbridge-" in line})
    with open(f"{base}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return Counts(fds, est, lis, evs, shm, len(os.listdir(f"{base}/task")), rss)


def settled_counts(limit_s: float = 2.0) -> Counts:
    """`counts()` once two reads 50 ms apart agree (ZMQ connects and accepts in the background)."""
    last, end = counts(), time.monotonic() + limit_s
    while time.monotonic() < end:
        time.sleep(0.05)
        now = counts()
        if (now.fds, now.tcp_established, now.eventfds) == (last.fds, last.tcp_established, last.eventfds):
            return now
        last = now
    return last


def law(side: str, engines: int, tp: int) -> dict[str, int]:
    """What the observed rank holds for `engines` remote engines of TP `tp` (both sides TP `tp`),
    as measured (docs/serving.md, "Scale"); eventfds and descriptors also carry a constant the
    first connection adds (ZMQ's I/O thread), so compare them as growth between two rows.

    decode rank: per prefill engine one source rank: its DEALER (+ monitor pair), a PUSH to the
    source's notification channel and the source's PUSH to ours, one mapped segment.
    prefill rank 0: every rank of every decode engine says Hello here first (rank 0 lists the
    engine's ranks), but only its readers are connected (issue 44.1; before, each Hello connected
    this rank's transport to that decode rank: TP peers per engine): at equal TP decode rank 0
    alone, its DEALER and its PUSH to us, our PUSH to it and its mapped segment."""
    if side == "decode":
        per = {"side_channels": 1, "transport_peers": 1, "tcp_established": 3, "eventfds": 4, "shm_maps": 1}
    else:
        per = {"side_channels": 1, "transport_peers": 1, "tcp_established": 3, "eventfds": 1, "shm_maps": 1}
    per["fds"] = per["tcp_established"] + per["eventfds"] + per["shm_maps"]
    return {k: v * engines for k, v in per.items()}


def _producers(engine: str, tp: int, ranks: range, config: ConnectorConfig) -> list[Producer]:
    out = []
    for r in ranks:
        cache = allocate_cache("shm", SPEC, layout(tp), r, "scale-p")
        out.append(Producer(engine, r, cache, make_transport("shm", f"{engine}/{r}", timeout_s=10), config=config))
    return out


def _consumers(engine: str, tp: int, ranks: range, config: ConnectorConfig) -> list[Consumer]:
    out = []
    for r in ranks:
        cache = allocate_cache("shm", SPEC, layout(tp), r, "scale-d")
        out.append(Consumer(engine, r, cache, make_transport("shm", f"{engine}/{r}", timeout_s=10), config=config))
    return out


def _close(endpoints) -> None:
    from kvbridge.transport.shm import free_shared
    for e in endpoints:
        e.close()
        e.transport.close()
        free_shared(e.cache)


class _Pump:
    """Serve producers' side channels from one thread: wake on a frame, housekeeping every 100 ms."""

    def __init__(self, producers: list[Producer]):
        self.producers = producers
        self.busy_s = 0.0  # time spent inside progress() calls that handled a Hello
        self.stop = threading.Event()
        self.poller = zmq.Poller()
        self.by_socket = {}
        for p in producers:
            self.poller.register(p.server.socket, zmq.POLLIN)
            self.by_socket[p.server.socket] = p
        self.lock = threading.Lock()

    def once(self, timeout_ms: int = 10) -> None:
        ready = dict(self.poller.poll(timeout_ms))
        with self.lock:
            for sock in ready:
                p = self.by_socket[sock]
                before, t0 = p.stats["handshakes"], time.perf_counter()
                p.progress(0)
                if p.stats["handshakes"] != before:
                    self.busy_s += time.perf_counter() - t0

    def thread(self) -> threading.Thread:
        def loop() -> None:
            last = time.monotonic()
            while not self.stop.is_set():
                self.once()
                if time.monotonic() - last > 0.1:
                    last = time.monotonic()
                    with self.lock:
                        for p in self.producers:
                            p.progress(0)
        t = threading.Thread(target=loop, daemon=True, name="fleet-scale-pump")
        t.start()
        return t


def _crowd(conn, secret: bytes) -> None:
    """A crowd process: builds the engines it is told to, serves its producers, connects its
    consumers on command, answers every command with a result; exits on ('stop',)."""
    config = ConnectorConfig(secret=secret)
    producers: list[Producer] = []
    consumers: dict[str, list[Consumer]] = {}
    pump = _Pump([])
    try:
        while True:
            if not conn.poll(0.0 if producers else 0.05):
                if producers:
                    pump.once(10)
                continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "prefill":  # engines (all ranks) or (engine, ranks): reply rank-0 addresses
                engines, tp, ranks = args
                made = []
                for engine in engines:
                    ps = _producers(engine, tp, range(tp) if ranks is None else range(*ranks), config)
                    if ranks is None:
                        ps[0].set_peer_addresses([p.address for p in ps])
                    made.append([p.address for p in ps])
                    producers += ps
                pump = _Pump(producers)
                conn.send(made)
            elif cmd == "decode":
                engines, tp = args
                for engine in engines:
                    consumers[engine] = _consumers(engine, tp, range(tp), config)
                conn.send(len(engines))
            elif cmd == "connect":  # every rank of `engines` to `address`: seconds per rank
                engines, address = args
                times = []
                for engine in engines:
                    for c in consumers[engine]:
                        t0 = time.perf_counter()
                        c.connect(address, 10.0)
                        times.append(time.perf_counter() - t0)
                conn.send(times)
            elif cmd == "storm":  # every rank of every engine connects to `address` at once: (seconds, error)
                address, timeout = args
                results: list[tuple[float, str]] = []
                def one(c: Consumer) -> None:
                    t0, error = time.perf_counter(), ""
                    try:
                        c.connect(address, timeout)
                    except Exception as e:  # noqa: BLE001 - a refusal or timeout: counted, with its reason
                        error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                    results.append((time.perf_counter() - t0, error))
                threads = [threading.Thread(target=one, args=(c,), daemon=True) for cs in consumers.values() for c in cs]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout + 60)
                results += [(float(timeout + 60), "no end")] * sum(t.is_alive() for t in threads)
                conn.send(results)
            elif cmd == "readers":  # per producer: decode ranks handshaken with it, transport peers
                conn.send([(p.rank, p.stats["handshakes"], len(p.transport._peers)) for p in producers])
    finally:
        _close([c for cs in consumers.values() for c in cs])
        _close(producers)
        conn.close()


class Crowds:
    """`n` spawned crowd processes; `ask(i, ...)` sends a command to crowd i and waits for its answer."""

    def __init__(self, n: int, secret: bytes):
        ctx = mp.get_context("forkserver")  # one import of torch for every crowd, not one each
        ctx.set_forkserver_preload([__name__])
        self.conns, self.procs = [], []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_crowd, args=(theirs, secret), daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def send(self, i: int, *cmd) -> None:
        self.conns[i].send(cmd)

    def answer(self, i: int, timeout: float = 300.0):
        if not self.conns[i].poll(timeout):
            raise TimeoutError(f"crowd {i} did not answer within {timeout:.0f} s")
        return self.conns[i].recv()

    def ask(self, i: int, *cmd):
        self.send(i, *cmd)
        return self.answer(i)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()


@dataclass
class Row:
    engines: int  # remote engines the observed rank is connected to (N)
    counts: Counts  # the observed process, minus its holdings before the first connect
    side_channels: int  # the observed rank's own view: DEALERs (decode) / distinct readers (prefill)
    transport_peers: int
    handshake_ms_median: float  # per connecting rank, over the engines added since the last row
    handshake_ms_max: float


@dataclass
class Scan:
    side: str
    tp: int
    crowds: int
    baseline: Counts
    rows: list[Row] = field(default_factory=list)
    hello_service_ms: float = 0.0  # prefill scan: observed rank-0 time per Hello it answered
    crowd_ranks: list = field(default_factory=list)  # prefill scan: (rank, handshakes, peers) of ranks 1..tp-1
    storm: dict = field(default_factory=dict)  # prefill scan: every decode rank of the crowd at a fresh engine at once

    def as_dict(self) -> dict:
        return asdict(self)


def _delta(now: Counts, base: Counts) -> Counts:
    return Counts(*(a - b for a, b in zip(asdict(now).values(), asdict(base).values())))


def _spread(engines: list, crowds: int) -> list[list]:
    return [engines[i::crowds] for i in range(crowds)]


def decode_scan(steps: tuple[int, ...] = STEPS, tp: int = 8, crowds: int = 4) -> Scan:
    """Decode rank 0 (this process) connects to prefill engines one by one; a row at each step."""
    secret = generate_secret()
    total = max(steps)
    names = [f"prefill-{i}" for i in range(total)]
    parts = _spread(names, crowds)
    crowd = Crowds(crowds, secret)
    observed: list[Consumer] = []
    try:
        for i, part in enumerate(parts):
            crowd.send(i, "prefill", part, tp, None)
        address: dict[str, str] = {}
        for i, part in enumerate(parts):
            for name, addrs in zip(part, crowd.answer(i)):
                address[name] = addrs[0]
        observed = _consumers("decode-observed", tp, range(0, 1), ConnectorConfig(secret=secret))
        rank = observed[0]
        gc.collect()  # what an earlier scan freed is unmapped now, not between two rows
        scan = Scan("decode", tp, crowds, settled_counts())
        times: list[float] = []
        for n, name in enumerate(names, 1):
            t0 = time.perf_counter()
            rank.connect(address[name], 10.0)
            times.append(time.perf_counter() - t0)
            if n in steps:
                scan.rows.append(Row(n, _delta(settled_counts(), scan.baseline), len(rank._links.clients()),
                                     len(rank.transport._peers), 1000 * statistics.median(times),
                                     1000 * max(times)))
                times = []
        return scan
    finally:
        _close(observed)
        crowd.close()


def prefill_scan(steps: tuple[int, ...] = STEPS, tp: int = 8, crowds: int = 4) -> Scan:
    """Prefill rank 0 (this process) of one engine; decode engines, every rank, connect to it one
    engine at a time; ranks 1..tp-1 of the engine live in crowd 0, the decode engines in the others."""
    secret = generate_secret()
    total = max(steps)
    names = [f"decode-{i}" for i in range(total)]
    parts = _spread(names, max(1, crowds - 1))
    crowd = Crowds(1 + len(parts), secret)
    observed: list[Producer] = []
    pump: _Pump | None = None
    thread = None
    try:
        rest = crowd.ask(0, "prefill", ["prefill-observed"], tp, (1, tp))[0] if tp > 1 else []
        for i, part in enumerate(parts, 1):
            crowd.send(i, "decode", part, tp)
        for i in range(1, len(parts) + 1):
            crowd.answer(i)
        observed = _producers("prefill-observed", tp, range(0, 1), ConnectorConfig(secret=secret))
        rank = observed[0]
        rank.set_peer_addresses([rank.address, *rest])
        pump = _Pump(observed)
        thread = pump.thread()
        gc.collect()
        scan = Scan("prefill", tp, 1 + len(parts), settled_counts())
        where = {name: i for i, part in enumerate(parts, 1) for name in part}
        times: list[float] = []
        for n, name in enumerate(names, 1):
            times += crowd.ask(where[name], "connect", [name], rank.address)
            if n in steps:
                now = settled_counts()  # the boot connections of ranks 1.. close on the decode side
                with pump.lock:
                    readers = len({key for key in rank._readers})
                    peers = len(rank.transport._peers)
                scan.rows.append(Row(n, _delta(now, scan.baseline), readers, peers,
                                     1000 * statistics.median(times), 1000 * max(times)))
                times = []
        handshakes = rank.stats["handshakes"]
        scan.hello_service_ms = 1000 * pump.busy_s / max(1, handshakes)
        if tp > 1:
            scan.crowd_ranks = crowd.ask(0, "readers")
        # A restarted prefill engine: every decode rank of every engine reaches its rank 0 at once.
        pump.stop.set()
        thread.join(5)
        fresh_rest = crowd.ask(0, "prefill", ["prefill-restarted"], tp, (1, tp))[0] if tp > 1 else []
        fresh = _producers("prefill-restarted", tp, range(0, 1), ConnectorConfig(secret=secret))
        observed += fresh
        fresh[0].set_peer_addresses([fresh[0].address, *fresh_rest])
        pump = _Pump(observed)
        thread = pump.thread()
        timeout = ConnectorConfig(secret=secret).handshake_timeout
        t0 = time.perf_counter()
        for i in range(1, len(parts) + 1):
            crowd.send(i, "storm", fresh[0].address, timeout)
        results = [r for i in range(1, len(parts) + 1) for r in crowd.answer(i, 600.0)]
        seconds = [t for t, _ in results]
        scan.storm = {"decode_ranks": len(results), "handshake_timeout_s": timeout,
                      "failed": sum(1 for _, e in results if e), "errors": sorted({e for _, e in results if e})[:5],
                      "connect_ms_median": 1000 * statistics.median(seconds) if seconds else 0.0,
                      "connect_ms_max": 1000 * max(seconds, default=0.0),
                      "all_done_s": time.perf_counter() - t0}
        return scan
    finally:
        if pump is not None:
            pump.stop.set()
        if thread is not None:
            thread.join(5)
        _close(observed)
        crowd.close()


def zmq_caps(probe_peers: int = 4096) -> dict:
    """How many peers one process takes before ZMQ refuses a socket, up to `probe_peers`, counted
    on the real classes: a transport agent's notification channel (one PUSH per peer agent) and
    side-channel clients (a DEALER and its monitor pair per connection, in the side channel's
    context). Each context is sized to the process's descriptors (`transport.descriptors`; ZMQ's
    default was 1,023 sockets: 1,022 peers, 341 clients). Connects go to a closed port: ZMQ
    connects lazily, so nothing is sent."""
    from kvbridge.connector.side_channel import SideChannelClient, _context
    from kvbridge.transport.descriptors import raise_descriptor_limit
    from kvbridge.transport.notify import Channel
    out: dict = {"descriptor_limit": raise_descriptor_limit(), "probe_peers": probe_peers,
                 "max_sockets_per_context": _context().get(zmq.MAX_SOCKETS)}
    channel, peers = Channel("fleet-scale-probe"), 0
    try:
        while peers < probe_peers:
            channel.connect(f"peer-{peers}", "tcp://127.0.0.1:9")
            peers += 1
    except zmq.ZMQError as e:
        out["transport_channel_error"] = str(e)
    finally:
        out["transport_channel_peers"] = peers
        channel.close()
    clients: list[SideChannelClient] = []
    try:
        while len(clients) < probe_peers:
            clients.append(SideChannelClient("127.0.0.1:9", f"probe-{len(clients)}".encode()))
    except Exception as e:  # noqa: BLE001 - SideChannelError or ZMQError: the cap, reported
        out["side_channel_error"] = str(e)
    finally:
        out["side_channel_clients"] = len(clients)
        for c in clients:
            c.close()
    return out


__all__ = ["Counts", "Crowds", "Row", "STEPS", "Scan", "counts", "decode_scan", "law", "prefill_scan",
           "settled_counts", "zmq_caps"]

"""Reliability scenarios shared by the CI tests and `scripts/reliability_report.py`.

Each scenario is a bounded function (count and wall-clock) over real producers, consumers,
transports and ZMQ side channels in this process, returning a plain dict of figures; the tests
assert on them and the report prints them, so the figure sheet shows what CI ran.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvbridge.connector import messages as m
from kvbridge.connector.config import ConnectorConfig
from kvbridge.core.secrets import generate_secret
from kvbridge.connector.consumer import Consumer
from kvbridge.connector.producer import Producer
from kvbridge.connector.transports import allocate_cache, make_transport
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.proofs.verify import random_bytes

SOAK_SPEC = ModelSpec.uniform(2, 2, 16, "bfloat16", name="soak-tiny")
"""Tiny on purpose: the soak measures the lifecycle (leases, sockets, handles), not bandwidth."""

LOADED_HOST_HEARTBEAT = 5.0
"""ZMTP heartbeat interval of the soaks' decode sockets (a peer is dropped after 3x). With the
default, 1 s, the in-process soak lost live peers on this 2-core host while it was shared with
vLLM workers at nice -10 (load average 20; 117 of 2,000 requests failed "side channel lost", most
likely a ZMQ I/O thread not scheduled for 3 s). The soaks measure the lifecycle under load, not how
fast a dead peer is noticed (the fault tests do that)."""


def process_figures(shm_prefix: str = "", pid: int | str = "self") -> dict[str, int]:
    """RSS (bytes), open descriptors of process `pid` (default: this one), /dev/shm segments whose
    name holds `shm_prefix`."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    shm = len([n for n in os.listdir("/dev/shm") if shm_prefix in n]) if os.path.isdir("/dev/shm") else 0
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "shm": shm}


@contextmanager
def _pumping(producers: list[Producer]) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for p in producers:
                p.progress(0.002)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)



def close_endpoints(*groups) -> None:
    """Close every Producer / Consumer of `groups` and its transport agent (decode side first)."""
    for group in groups:
        for endpoint in group:
            endpoint.close()
            endpoint.transport.close()

class Pair:
    """Prefill TP `ptp` and decode TP `dtp` ranks of one engine pair, in this process."""

    def __init__(self, transport: str, ptp: int, dtp: int, blocks: int, config: ConnectorConfig,
                 mode: str = "pull", spec: ModelSpec = SOAK_SPEC, tag: str = "soak"):
        self.spec, self.config = spec, config
        self.pre = EngineLayout(tp_size=ptp, block_size=16, num_blocks=blocks)
        self.dec = EngineLayout(tp_size=dtp, block_size=16, num_blocks=blocks, kv_order="NHD")
        self.src = [allocate_cache(transport, spec, self.pre, r, f"{tag}-p") for r in range(ptp)]
        self.dst = [allocate_cache(transport, spec, self.dec, r, f"{tag}-d") for r in range(dtp)]
        random_bytes(self.src, 1)
        self.released: list[tuple[int, str, str]] = []
        self.producers: list[Producer] = []
        self.consumers: list[Consumer] = []
        try:
            for r in range(ptp):
                t = make_transport(transport, f"{tag}-prefill/{r}", timeout_s=config.transfer_timeout)
                self.producers.append(Producer("prefill", r, self.src[r], t, mode=mode, config=config,
                                               on_release=lambda rid, why, r=r: self.released.append((r, rid, why))))
            self.producers[0].set_peer_addresses([p.address for p in self.producers])
            for r in range(dtp):
                t = make_transport(transport, f"{tag}-decode/{r}", timeout_s=config.transfer_timeout)
                self.consumers.append(Consumer("decode", r, self.dst[r], t, mode=mode, config=config))
            with _pumping(self.producers):
                for c in self.consumers:
                    c.connect(self.producers[0].address, config.handshake_timeout)
        except BaseException:
            self.close()
            raise

    def step(self, timeout: float = 0.0005) -> list:
        for p in self.producers:
            p.progress(timeout)
        out = []
        for c in self.consumers:
            out.extend(c.progress(timeout))
        return out

    def close(self) -> None:
        close_endpoints(self.consumers, self.producers)
        from kvbridge.transport.shm import free_shared
        for c in self.src + self.dst:
            free_shared(c)
        self.producers, self.consumers, self.src, self.dst = [], [], [], []


def soak(transport: str = "shm", requests: int = 2000, in_flight: int = 64, seed: int = 0,
         time_limit: float = 300.0) -> dict:
    """See `_soak`; adds this process's descriptors and shm segments before and after (closed).

    A short warm-up pair first creates what a process sets up once (the ZMQ context's I/O
    thread, the transport library's globals), so before/after compare per-pair resources only.
    """
    _soak(transport, in_flight, in_flight, seed + 1000, time_limit)
    gc.collect()
    before = process_figures(f"soak{seed}")
    out = _soak(transport, requests, in_flight, seed, time_limit)
    gc.collect()
    return out | {"before": before, "after": process_figures(f"soak{seed}")}


def _soak(transport: str, requests: int, in_flight: int, seed: int, time_limit: float) -> dict:
    """`requests` requests, `in_flight` at a time, prefill TP 2 -> decode TP 1, checksums on.

    Every request's landed bytes are verified by the connector's integrity check (a mismatch
    would fail it). RSS, descriptors and /dev/shm segments are sampled at the end of each
    quarter. Bounded by `time_limit` seconds (the result says if it ran out).
    """
    cfg = ConnectorConfig(lease_seconds=20, transfer_timeout=20, abort_timeout=2, checksum=True,
                          side_channel_heartbeat=LOADED_HOST_HEARTBEAT,
                          secret=generate_secret())
    slot_blocks = 2  # up to 32 tokens of 16
    rng = random.Random(seed)
    t0 = time.monotonic()
    pair = Pair(transport, 2, 1, in_flight * slot_blocks, cfg, tag=f"soak{seed}")
    try:
        free = list(range(in_flight))
        active: dict[str, int] = {}
        submitted = done = ok = nbytes = 0
        failures: list[str] = []
        samples: list[dict] = []
        quarter = max(1, requests // 4)
        while (done < requests) and time.monotonic() - t0 < time_limit:
            while free and submitted < requests:
                slot = free.pop()
                n = rng.randint(1, 16 * slot_blocks)
                ids = ((tuple(range(slot * slot_blocks, slot * slot_blocks + -(-n // 16))),))
                rid = f"soak-{seed}-{submitted}"
                for p in pair.producers:
                    p.add_request(rid, ids, n)
                pair.consumers[0].receive(rid, ids, num_tokens=n)
                active[rid] = slot
                submitted += 1
            for res in pair.step():
                free.append(active.pop(res.request_id))
                done += 1
                nbytes += res.nbytes
                if res.ok:
                    ok += 1
                else:
                    failures.append(f"{res.request_id}: {res.reason}")
                if done % quarter == 0 and len(samples) < 4:
                    gc.collect()
                    samples.append(process_figures(f"soak{seed}") | {"done": done, "t": time.monotonic() - t0})
        end = time.monotonic() + 5
        while len(pair.released) < 2 * submitted and time.monotonic() < end:
            pair.step()
        stats = pair.consumers[0].stats
        released = {}
        for _, rid, _ in pair.released:
            released[rid] = released.get(rid, 0) + 1
        return {
            "transport": transport, "requests": requests, "in_flight": in_flight, "submitted": submitted,
            "completed": done, "ok": ok, "failed": len(failures), "failures": failures[:10], "bytes": nbytes,
            "checksums_verified": stats["checksums_verified"], "checksum_mismatches": stats["checksum_mismatches"],
            "releases": len(pair.released), "released_twice": sum(1 for v in released.values() if v != 2),
            "samples": samples, "seconds": time.monotonic() - t0, "timed_out": done < requests,
        }
    finally:
        pair.close()


def garbage_frames(count: int = 500, seed: int = 0) -> dict:
    """Random, truncated and mis-shaped frames into a live prefill rank, then a real request."""
    import zmq
    cfg = ConnectorConfig(lease_seconds=5, transfer_timeout=5, abort_timeout=1, checksum=True,
                          secret=generate_secret())
    pair = Pair("shm", 1, 1, 8, cfg, tag=f"garbage{seed}")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://{pair.producers[0].address}")
        rng = random.Random(seed)
        valid = [m.encode(m.Heartbeat("decode", 0, ("x",))), m.encode(m.ReadDone("decode", 0, "x")),
                 m.encode(m.Abort("decode", 0, "x", "hostile"))]
        sent = 0
        kinds = {"random": 0, "truncated": 0, "bit-flipped": 0, "unauthenticated-valid": 0}
        for i in range(count):
            k = i % 4
            if k == 0:
                frame = rng.randbytes(rng.randint(1, 300))
                kinds["random"] += 1
            elif k == 1:
                v = rng.choice(valid)
                frame = v[:rng.randint(1, len(v) - 1)]
                kinds["truncated"] += 1
            elif k == 2:
                v = bytearray(rng.choice(valid))
                v[rng.randrange(len(v))] ^= 1 << rng.randrange(8)
                frame = bytes(v)
                kinds["bit-flipped"] += 1
            else:  # well-formed, but from a peer that never handshook
                frame = rng.choice(valid)
                kinds["unauthenticated-valid"] += 1
            raw.send(frame)
            sent += 1
        deadline = time.monotonic() + 10
        p = pair.producers[0]
        while p.stats["refused_frames"] + p.stats["unexpected_messages"] < sent and time.monotonic() < deadline:
            pair.step(0.01)
        n = 20
        p.add_request("after-garbage", ((0, 1),), n)
        pair.consumers[0].receive("after-garbage", ((0, 1),), num_tokens=n)
        res = None
        while res is None and time.monotonic() < deadline:
            for r in pair.step(0.01):
                res = r
        while res is not None and not any(rid == "after-garbage" for _, rid, _ in pair.released) \
                and time.monotonic() < deadline:  # its ReadDone may reach the producer after the result
            pair.step(0.01)
        return {"sent": sent, "kinds": kinds, "refused": p.stats["refused_frames"],
                "aborts_counted": p.stats["aborts_received"],
                "released_before": sum(1 for _, rid, _ in pair.released if rid != "after-garbage"),
                "after_ok": bool(res and res.ok), "after_reason": res.reason if res else "no result"}
    finally:
        raw.close(0)
        pair.close()


def multiprocess_soak(transport: str = "shm", requests: int = 2000, in_flight: int = 64, seed: int = 0,
                      prefill_tp: int = 2, decode_tp: int = 1, mode: str = "pull",
                      time_limit: float = 600.0) -> dict:
    """`requests` requests, `in_flight` at a time, through prefill and decode ranks that are each
    their own OS process (`kvbridge.connector.processes`, as the multi-process demo runs them),
    over `transport` and real ZMQ side channels; checksums on.

    This process only orchestrates, the way a scheduler would: it asks each prefill rank to write
    fresh random bytes into a request's source blocks and lease them (`processes.Lease` with a fill seed), and each decode
    rank to poison its destination blocks and receive the request (`processes.Incoming` with a poison seed). A slot's
    blocks are reused only after every decode rank reported the request and every prefill rank
    released it. Every request's landed bytes are verified by the consumer's end-to-end checksum
    against the sources' fresh content, so a transfer that moved nothing, or the wrong rows,
    fails. RSS and open descriptors of every rank process (and of this one) and the engines'
    /dev/shm segments are sampled at the end of each quarter of the requests; the segments are
    counted again after the processes stopped. Bounded by `time_limit` seconds.
    """
    from kvbridge.proofs.rank_engines import DecodeEngine, PrefillEngine
    from kvbridge.connector import processes as rp
    from kvbridge.connector.processes import process_context, stop_all
    cfg = ConnectorConfig(lease_seconds=120, transfer_timeout=120, abort_timeout=5, handshake_timeout=30,
                          checksum=True, side_channel_heartbeat=LOADED_HOST_HEARTBEAT,
                          secret=generate_secret())
    slot_blocks = 2  # up to 32 tokens of 16
    rng = random.Random(seed)
    tag = f"soakmp{seed}{transport}"
    startup = 120.0  # rank processes start from the fork server; a loaded 2-core host takes a while
    t0 = time.monotonic()
    ctx = process_context()
    pre = EngineLayout(tp_size=prefill_tp, block_size=16, num_blocks=in_flight * slot_blocks)
    dec = EngineLayout(tp_size=decode_tp, block_size=16, num_blocks=in_flight * slot_blocks, kv_order="NHD")
    lifetime = time_limit + 2 * startup
    prefill = PrefillEngine(ctx, transport, f"{tag}-prefill", SOAK_SPEC, pre, mode, "127.0.0.1:0", cfg,
                            max_lifetime=lifetime)
    decode = DecodeEngine(ctx, transport, f"{tag}-decode", SOAK_SPEC, dec, mode, "127.0.0.1", cfg,
                          max_lifetime=lifetime)
    ranks = {f"prefill {p.args.rank}": p for p in prefill.ranks} | {f"decode {p.args.rank}": p for p in decode.ranks}
    try:
        prefill.start(startup)
        decode.start(startup)
        decode.connect(prefill.address, startup)
        prefill.wait_handshake(startup)
        started = time.monotonic()
        free = list(range(in_flight))
        slot_of: dict[str, int] = {}  # requests in flight -> their slot
        landed: dict[str, list[dict]] = {}  # in flight: each decode rank's result
        releases: dict[str, set[int]] = {}  # in flight: prefill ranks that released it
        counts = {"submitted": 0, "done": 0, "ok": 0, "bytes": 0, "releases": 0, "released_twice": 0}
        failures: list[str] = []
        not_done: list[str] = []
        samples: dict[str, list[dict]] = {name: [] for name in [*ranks, "parent"]}
        shm_samples: list[int] = []
        quarter = max(1, requests // 4)

        def settle(rid: str) -> None:
            """Free the slot once every decode rank reported and every prefill rank released; the
            parent keeps no per-request record after that (its own RSS is sampled too)."""
            if len(landed.get(rid, ())) == decode_tp and len(releases.get(rid, ())) == prefill_tp:
                free.append(slot_of.pop(rid))
                del landed[rid], releases[rid]

        def collect() -> None:
            for rank, evs in prefill.releases.items():
                for rid, why in evs:
                    counts["releases"] += 1
                    if not why.startswith("done"):
                        not_done.append(f"{rid}: {why}")
                    if rid not in slot_of or rank in releases.get(rid, ()):
                        counts["released_twice"] += 1
                        continue
                    releases.setdefault(rid, set()).add(rank)
                    settle(rid)
                evs.clear()
            for by_id in decode.results.values():
                for rid, res in by_id.items():
                    if rid not in slot_of:
                        failures.append(f"{rid}: a second result: {res}")
                        continue
                    landed.setdefault(rid, []).append(res)
                    counts["bytes"] += res["nbytes"]
                    if len(landed[rid]) < decode_tp:
                        continue
                    counts["done"] += 1
                    bad = [f"decode rank {x['rank']}: {x['reason']}" for x in landed[rid] if not x["ok"]]
                    if bad:
                        failures.append(f"{rid}: {'; '.join(bad)}")
                    else:
                        counts["ok"] += 1
                    if counts["done"] % quarter == 0 and len(shm_samples) < 4:
                        now = time.monotonic() - started
                        for name, p in ranks.items():
                            samples[name].append(process_figures(tag, p.pid) | {"done": counts["done"], "t": now})
                        gc.collect()
                        samples["parent"].append(process_figures(tag) | {"done": counts["done"], "t": now})
                        shm_samples.append(samples["parent"][-1]["shm"])
                    settle(rid)
                by_id.clear()

        while counts["done"] < requests and time.monotonic() - t0 < time_limit:
            batch = []
            while free and counts["submitted"] < requests:
                slot, i = free.pop(), counts["submitted"]
                n = rng.randint(1, 16 * slot_blocks)
                ids = (tuple(range(slot * slot_blocks, slot * slot_blocks + -(-n // 16))),)
                rid = f"{tag}-{i}"
                slot_of[rid] = slot
                batch.append((rid, ids, n, i))
                counts["submitted"] += 1
            if batch:  # distinct fill seeds per request and rank; odd for sources, even for poison
                for p in prefill.ranks:
                    p.send(rp.Add([rp.Lease(rid, ids, n, fill_seed=(i * 64 + p.args.rank) * 2 + 1)
                                   for rid, ids, n, i in batch]))
                for p in decode.ranks:
                    p.send(rp.Receive([rp.Incoming(rid, ids, n, cfg.transfer_timeout,
                                                   poison_seed=(i * 64 + p.args.rank) * 2)
                                       for rid, ids, n, i in batch]))
            prefill.pump(0.005)
            decode.pump(0.005)
            for p in ranks.values():
                p.take((rp.Added, rp.Receiving))
            collect()
        end = time.monotonic() + 30
        while slot_of and time.monotonic() < end:
            prefill.pump(0.02)
            collect()
        seconds = time.monotonic() - started
        stats: dict[str, dict] = {}
        for p in ranks.values():
            p.send(rp.GetStats())
        for name, p in ranks.items():
            stats[name] = p.expect(rp.Stats, startup).stats
    finally:
        stop_all(decode.ranks)  # readers first: a prefill rank that goes first is a lost side channel to them
        stop_all(prefill.ranks)
    never_released = sum(prefill_tp - len(releases.get(rid, ())) for rid in slot_of)
    return {
        "transport": transport, "mode": mode, "requests": requests, "in_flight": in_flight,
        "prefill_tp": prefill_tp, "decode_tp": decode_tp, "processes": len(ranks),
        "submitted": counts["submitted"], "completed": counts["done"], "ok": counts["ok"], "failed": len(failures),
        "failures": failures[:10], "bytes": counts["bytes"],
        "checksums_verified": sum(stats[f"decode {r}"].get("checksums_verified", 0) for r in range(decode_tp)),
        "checksum_mismatches": sum(stats[f"decode {r}"].get("checksum_mismatches", 0) for r in range(decode_tp)),
        "releases": counts["releases"], "released_twice": counts["released_twice"],
        "never_released": never_released, "releases_not_done": not_done[:10],
        "samples": samples, "shm_samples": shm_samples, "shm_after": process_figures(tag)["shm"],
        "exit_codes": {name: p.proc.exitcode for name, p in ranks.items()}, "seconds": seconds,
        "wall_seconds": time.monotonic() - t0, "timed_out": counts["done"] < requests,
    }


__all__ = ["Pair", "SOAK_SPEC", "garbage_frames", "multiprocess_soak", "process_figures", "soak"]

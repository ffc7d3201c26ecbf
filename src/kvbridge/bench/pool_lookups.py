"""How many pool lookups one `mooncake_master` answers: existence checks per second from several
client processes, as a fleet's schedulers send them (`PoolIndex.hits` -> `StoreClient.exists`,
one `batch_is_exist` of every object key of a request's blocks).

Why: every engine of a fleet with `--pool` asks the one master before it schedules a request, so
the master's answer rate bounds the fleet's request rate; the figure to compare is keys per
second (one request asks blocks x layers x KV heads keys). Measured with a real master started as
a fleet starts it (`MooncakeMaster.start`: 2 RPC threads) and real clients in spawned processes
(one client per process, as one scheduler per engine); keys are absent (a miss costs the master
one map lookup, as a hit does).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

BATCHES = (1, 256, 4096)  # one key; one pool block of 32 layers x 8 KV heads; 16 such blocks
CLIENTS = (1, 4)


def _client(master: str, schedule: list[tuple[int, float]], barrier, conn, index: int) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from kvbridge.pool.store import StoreClient, StoreConfig
    client = StoreClient(StoreConfig(master, segment_bytes=0))
    try:
        results = []
        for batch, seconds in schedule:
            keys = [f"kvb-scale/{index}/{i}" for i in range(batch)]
            client.exists(keys)
            barrier.wait(600)  # clients start slowly on a loaded host
            calls, failed, end = 0, 0, time.monotonic() + seconds
            t0 = time.perf_counter()
            while time.monotonic() < end:
                failed += sum(a is None for a in client.exists(keys))
                calls += 1
            results.append((batch, calls, time.perf_counter() - t0, failed))
        conn.send(results)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(f"lookup client {index}: {type(e).__name__}: {e}")
    finally:
        client.close()
        conn.close()


def lookup_rates(batches: tuple[int, ...] = BATCHES, clients: tuple[int, ...] = CLIENTS,
                 seconds: float = 3.0) -> dict:
    """Per (clients, batch): calls/s and keys/s summed over the clients, and failed answers."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    from kvbridge.pool.master import MooncakeMaster
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvb-lookups-") as tmp, \
            MooncakeMaster.start(os.path.join(tmp, "master.log")) as master:
        for n in clients:
            barrier = ctx.Barrier(n)
            pipes, procs = [], []
            try:
                for i in range(n):
                    mine, theirs = ctx.Pipe()
                    p = ctx.Process(target=_client, daemon=True,
                                    args=(master.address, [(b, seconds) for b in batches], barrier, theirs, i))
                    p.start()
                    theirs.close()
                    pipes.append(mine)
                    procs.append(p)
                deadline = time.monotonic() + 600 + 2 * seconds * len(batches)
                per = [c.recv() if c.poll(max(0.0, deadline - time.monotonic())) else None for c in pipes]
                if any(not isinstance(r, list) for r in per):
                    raise RuntimeError(f"lookup clients: {[r for r in per if not isinstance(r, list)]}")
            finally:
                for p in procs:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
                        p.join(5)
            for j, batch in enumerate(batches):
                calls = sum(r[j][1] for r in per)
                wall = max(r[j][2] for r in per)
                rows.append({"clients": n, "batch_keys": batch, "calls_per_s": round(calls / wall),
                             "keys_per_s": round(calls * batch / wall), "failed": sum(r[j][3] for r in per)})
    return {"master_rpc_threads": 2, "seconds_each": seconds, "rows": rows}


__all__ = ["BATCHES", "CLIENTS", "lookup_rates"]

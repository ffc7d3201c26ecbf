"""One side of the link-cut test, run inside a network namespace (`ip netns exec NS python THIS ROLE ARGS`).

The prefill side runs a `Producer` per prefill rank, the decode side a `Consumer` per decode
rank, all in this one process and driven from one loop, each rank with its own transport agent
and side-channel sockets bound to this namespace's veth address. The test (in the root
namespace) drives it with JSON commands on stdin, one per line, and reads `EV {json}` events on
stdout. Every wait the test does on these events is bounded; this process also ends itself when
stdin closes or after `max_lifetime` seconds, so a test that goes wrong cannot leave it behind.

Caches: the prefill ranks hold the coordinate pattern of `kvbridge.proofs.verify` in every request's
blocks; the decode ranks start as random bytes, and `verify` compares each decode rank with its
start state plus exactly the requests named `ok` (rows of the `ignore`d, failed requests may hold
anything, every other byte must be exact).
"""

from __future__ import annotations

import json
import os
import selectors
import sys
import time
import traceback


def _emit(kind: str, **fields) -> None:
    sys.stdout.write("EV " + json.dumps({"ev": kind, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def _figures() -> dict:
    """This process's open descriptors, its /dev/shm segments, and what its transport agents hold."""
    from kvbridge.transport.agent import resource_figures
    mine = f"kvbridge-{os.getpid()}-"
    shm = len([n for n in os.listdir("/dev/shm") if n.startswith(mine)]) if os.path.isdir("/dev/shm") else 0
    return {"fds": len(os.listdir("/proc/self/fd")), "shm": shm, **resource_figures()}


def main(role: str, args: dict) -> None:
    from kvbridge.connector.config import ConnectorConfig
    from kvbridge.connector.transports import allocate_cache, make_transport
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.plan import Request
    from kvbridge.core.spec import ModelSpec
    from kvbridge.proofs.verify import clone_caches, expected_destination, fill_source, mismatch_report, random_bytes

    spec = ModelSpec.uniform(*args["spec"], name="link-cut")
    layout = EngineLayout(**args["layout"])
    config = ConnectorConfig(**args["config"])
    kind, mode, host = args["transport"], args["mode"], args["host"]
    requests = {rid: Request(tuple(map(tuple, s)), tuple(map(tuple, d)), n)
                for rid, (s, d, n) in args["requests"].items()}
    caches = [allocate_cache(kind, spec, layout, r, f"linkcut-{role}") for r in range(layout.tp_size)]
    from kvbridge.connector.rank_host import warm_copier
    warm_copier()  # as a rank process does: load the compiled copier before a deadline runs
    transports = []
    conns = []
    born = time.monotonic()
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    buf = b""
    try:
        if role == "prefill":
            from kvbridge.connector.producer import Producer
            for rq in requests.values():
                fill_source(caches, rq.src_block_ids, rq.num_tokens)
            for r in range(layout.tp_size):
                t = make_transport(kind, f"prefill/{r}/{os.getpid()}", host=host, timeout_s=config.transfer_timeout)
                transports.append(t)
                listen = args["listen"] if r == 0 else f"{host}:0"
                conns.append(Producer("prefill", r, caches[r], t, listen=listen, mode=mode, config=config,
                                      on_release=lambda rid, why, r=r: _emit("released", rank=r, rid=rid, why=why)))
            conns[0].set_peer_addresses([p.address for p in conns])
            _emit("ready", address=conns[0].address)
        else:
            from kvbridge.connector.consumer import Consumer
            random_bytes(caches, 1001)
            before = clone_caches(caches)
            for r in range(layout.tp_size):
                t = make_transport(kind, f"decode/{r}/{os.getpid()}", host=host, timeout_s=config.transfer_timeout)
                transports.append(t)
                conns.append(Consumer("decode", r, caches[r], t, mode=mode, config=config))
            _emit("ready", address="")
        seen: set[str] = set()
        while True:
            if role == "prefill":
                for p in conns:
                    p.progress(0.002)
                    for eng in p.decode_engines:
                        if eng not in seen:
                            seen.add(eng)
                            _emit("handshake", engine=eng)
            else:
                for c in conns:
                    for res in c.progress(0.002):
                        _emit("result", rank=c.rank, rid=res.request_id, ok=res.ok, reason=res.reason,
                              quiesced=res.quiesced, seconds=res.seconds)
            if time.monotonic() - born > args.get("max_lifetime", 300):
                _emit("error", text="max lifetime reached")
                return
            if not sel.select(0):
                continue
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return  # the test went away
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                op = cmd["cmd"]
                if op == "stop":
                    _emit("stats", stats=[dict(c.stats) for c in conns])
                    return
                if op == "figures":
                    _emit("figures", figures=_figures())
                elif op == "status":  # decode: source ranks whose side channel is lost, per rank
                    _emit("status", lost=[list(c.lost_sources(e)) for c in conns for e in c.prefill_engines])
                elif op == "add":  # prefill
                    for rid in cmd["rids"]:
                        rq = requests[rid]
                        for p in conns:
                            p.add_request(rid, rq.src_block_ids, rq.num_tokens, first_token=7,
                                          lease_seconds=cmd.get("lease"))
                    _emit("added", rids=cmd["rids"])
                elif op == "connect":  # decode
                    try:
                        engines = [c.connect(cmd["address"], cmd["timeout"]) for c in conns]
                        _emit("connected", engines=engines)
                    except Exception as e:  # noqa: BLE001 - reported to the test
                        _emit("connect_failed", reason=f"{type(e).__name__}: {e}")
                elif op == "receive":  # decode
                    for rid in cmd["rids"]:
                        rq = requests[rid]
                        for c in conns:
                            c.receive(rid, rq.dst_block_ids, num_tokens=rq.num_tokens, timeout=cmd["timeout"])
                    _emit("receiving", rids=cmd["rids"])
                elif op == "verify":  # decode
                    expected = clone_caches(before)
                    for rid in cmd["ok"]:
                        expected_destination(expected, requests[rid])
                    import numpy as np
                    for rid in cmd["ignore"]:  # a failed request's own rows may hold anything
                        rq = requests[rid]
                        pos = np.arange(rq.num_tokens)
                        for a, e in zip(caches, expected):
                            for li in range(spec.num_layers):
                                ids = rq.dst_block_ids[spec.layer_group[li]]
                                for ci in range(len(spec.layers[li].components)):
                                    e.write_tokens(li, ci, ids, pos, a.read_tokens(li, ci, ids, pos, as_int=True))
                    _emit("verified", mismatches=mismatch_report(caches, expected)[:20])
                else:
                    _emit("error", text=f"unknown command {op!r}")
    except BaseException:  # noqa: BLE001 - reported to the test, then the process exits
        _emit("error", text=traceback.format_exc())
    finally:
        for c in conns:
            c.close()
        for t in transports:
            t.close()
        _emit("closed")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
    os._exit(0)  # everything is closed above; skip the interpreter's slow teardown of the engines' modules

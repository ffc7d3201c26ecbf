"""One 'host' of the multi-host pool test, run inside a network namespace:
`ip netns exec NS python THIS ROLE JSON`. The writer stores blocks (its memory lent to the pool)
and stays up until its stdin closes; the reader loads them and checks every byte."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("GLOG_minloglevel", "2")

from pool_harness import Engine, block_keys, config, expected_load, same  # noqa: E402

from kvbridge.pool.store import PoolUnavailable  # noqa: E402


class Master:
    def __init__(self, address: str, url: str):
        self.address, self.metadata_url = address, url


def attached(engine: Engine, master: Master, **kwargs) -> Engine:
    """Attach, waiting up to a minute for the master (started beside this process) to listen."""
    end = time.monotonic() + 60
    while True:
        try:
            return engine.attach(master, **kwargs)
        except PoolUnavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    master = Master(args["master"], args["metadata_url"])
    keys = block_keys(args["blocks"], "netns")
    writer = Engine(2, 4, seed=41)
    if role == "writer":
        attached(writer, master, cfg=config(), local_hostname=args["host"])
        done = writer.store(writer.job(0, args["blocks"]), keys)
        print("RESULT " + json.dumps({"stored": sum(done)}), flush=True)
        sys.stdin.read()  # serve the objects in its memory until the test is done
        writer.close()
        return
    reader = attached(Engine(1, 8, seed=42, kv_order="HND"), master, cfg=config(staging=16), segment_bytes=0,
                      local_hostname=args["host"])
    expected = expected_load(writer, writer.job(0, args["blocks"]), reader.caches, reader.layout,
                             reader.job(0, args["blocks"]))
    done = reader.load(keys, reader.job(0, args["blocks"]))
    print("RESULT " + json.dumps({"loaded": sum(done), "exact": same(reader.caches, expected),
                                  "bytes": sum(t.stats["bytes_got"] for t in reader.tiers)}), flush=True)
    reader.close()


if __name__ == "__main__":
    main()

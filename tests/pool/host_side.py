"""Run by the host-tier tests as another process of the host: stores (or loads) pool blocks
through the host tier only, and prints one JSON line. argv: host_dir mode salt n [seed]."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pool_harness import Engine, block_keys  # noqa: E402

from kvbridge.pool.tier import PoolConfig, PoolTier  # noqa: E402


def main() -> None:
    host_dir, mode, salt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    cfg = PoolConfig(model_id="pool-test", block_tokens=8, staging_blocks=4, secret=b"fleet-secret-0123456789",
                     host_bytes=8 << 20, host_dir=host_dir)
    eng = Engine(2, 4, seed=seed)
    eng.tiers = [PoolTier(c, None, cfg) for c in eng.caches]
    keys = block_keys(n, salt)
    done = eng.store(eng.job(3, n), keys) if mode == "store" else eng.load(keys, eng.job(3, n))
    stats = {k: sum(t.stats[k] for t in eng.tiers) for k in ("host_objects_put", "host_objects_got")}
    eng.close()
    print(json.dumps({"done": done, **stats}))


if __name__ == "__main__":
    main()

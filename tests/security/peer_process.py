"""One half of the two-host demo in its own process, for the forged-peer tests.

    python peer_process.py prefill|decode '{"listen": ..., "secret_file": ..., ...}'

Calls `run_prefill_server` / `run_decode_client` with the JSON arguments (layouts as dicts),
prints `LISTENING <address>` once the prefill server's rank 0 listens and `RESULT <json>` at
the end (what `kvbridge prefill-server --secret-file` and `demo --role decode --secret-file` run).
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    from kvbridge.core.layout import EngineLayout
    from kvbridge.proofs import connector_demo as demo
    for key in ("prefill", "decode"):
        if isinstance(args.get(key), dict):
            args[key] = EngineLayout(**args[key])
    if role == "prefill":
        result = demo.run_prefill_server(on_listening=lambda a: print(f"LISTENING {a}", flush=True), **args)
    else:
        result = demo.run_decode_client(**args)
    print("RESULT " + json.dumps(result.to_dict()), flush=True)

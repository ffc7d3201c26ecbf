"""An OpenAI-compatible client run inside a network namespace (`ip netns exec NS python THIS JSON`)
for the two-host fleet test: JSON in ({"url", "requests": [{"prompt", "stream", "chat"}],
"max_tokens", "concurrent"}), one JSON list of answers ({"token_ids", "error"}) out, in order."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from kvbridge.testing.serving import request


def main() -> None:
    args = json.loads(sys.argv[1])

    def one(r: dict) -> dict:
        a = request(args["url"], r["prompt"], args["max_tokens"], stream=r.get("stream", False),
                    chat=r.get("chat", False))
        return {"token_ids": a.token_ids, "error": a.error}

    with ThreadPoolExecutor(max(1, args.get("concurrent", 1))) as pool:
        print(json.dumps(list(pool.map(one, args["requests"]))), flush=True)


if __name__ == "__main__":
    main()

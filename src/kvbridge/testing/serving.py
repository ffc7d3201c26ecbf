"""Requests as users send them to a served fleet: an OpenAI-compatible HTTP client (completions and
chat completions, streamed or not) and the edge cases of P/D serving, each answer compared with
one plain instance's.

Greedy decoding (temperature 0) and `return_token_ids`, so answers compare as token ids, not
text: a random-weight model's tokens often decode to invalid UTF-8, which two different token
sequences can share.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

TIMEOUT_S = 900.0  # one request on a starved 2-core host: slow is not failed


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str | None = None  # an HTTP error or an error event in a stream: what a client would see
    status: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def request(base: str, prompt: str, max_tokens: int, *, chat: bool = False, stream: bool = False,
            timeout: float = TIMEOUT_S, model: str = "model", extra: dict[str, Any] | None = None) -> Answer:
    """One greedy completion (or chat completion) from `base` (http://host:port); `extra` adds
    fields to the body (vLLM's `cache_salt`, ...)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                            "return_token_ids": True, "ignore_eos": True, **(extra or {})}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    answer = Answer()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer.status = r.status
            if not stream:
                _take(answer, json.loads(r.read()), chat)
                return answer
            done = False
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                _take(answer, json.loads(data), chat)
            if not done and answer.error is None:  # the server went away mid-stream: a client sees a cut answer
                answer.error = f"stream cut after {len(answer.token_ids)} tokens (no [DONE])"
    except urllib.error.HTTPError as e:
        answer.status = e.code
        answer.error = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        answer.error = f"{type(e).__name__}: {e}"
    return answer


def tokenize(base: str, text: str, timeout: float = 120.0) -> list[int]:
    """The token ids instance `base` gives `text` (vLLM's /tokenize): a prompt sent as these ids
    is the same prompt, which a reply's text sent back is not always (invalid UTF-8)."""
    req = urllib.request.Request(base + "/tokenize", data=json.dumps({"model": "model", "prompt": text}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["tokens"]


def _take(answer: Answer, obj: dict[str, Any], chat: bool) -> None:
    if "error" in obj:
        answer.error = json.dumps(obj["error"])[:300]
        return
    for choice in obj.get("choices") or []:
        answer.token_ids += list(choice.get("token_ids") or [])
        if chat:
            part = (choice.get("delta") or choice.get("message") or {}).get("content")
        else:
            part = choice.get("text")
        answer.text += part or ""
        if choice.get("finish_reason") == "error":
            answer.error = "finish_reason error"


@dataclass
class Case:
    """One user-visible scenario: its answer through the fleet beside the plain instance's."""

    name: str
    fleet: Answer
    reference: Answer

    @property
    def equal(self) -> bool:
        return self.fleet.ok and self.reference.ok and self.fleet.token_ids == self.reference.token_ids \
            and len(self.fleet.token_ids) > 0

    def row(self) -> dict[str, Any]:
        return {"case": self.name, "equal": self.equal, "fleet_error": self.fleet.error,
                "tokens": self.fleet.token_ids, "reference": self.reference.token_ids}


def metric_total(url: str, name: str) -> float:
    """Sum of the samples of Prometheus metric `name` (every label set) that `url`/metrics reports."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def prompt_text(seed: int, chars: int) -> str:
    """A distinct printable prompt of `chars` characters (one token per byte with the tiny
    models' byte tokenizer)."""
    import random
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(chars))


def edge_cases(endpoint: str, decode_url: str, reference_url: str, block: int, new_tokens: int = 8,
               concurrent: int = 8) -> list[Case]:
    """The P/D edge cases through the router at `endpoint`:

    * a prompt shorter than a block;
    * a full prefix-cache hit on the decode instance and none on the prefill one (the prompt sent
      to the decode instance `decode_url` alone first);
    * a partial hit on the decode instance (a prefix of the prompt sent to it first);
    * completions and chat completions, streamed and not;
    * `concurrent` distinct prompts at once.
    Each answer is compared with the plain instance at `reference_url`.
    """
    cases: list[Case] = []

    def both(name: str, prompt: str, **kw: Any) -> None:
        cases.append(Case(name, request(endpoint, prompt, new_tokens, **kw),
                          request(reference_url, prompt, new_tokens, **kw)))

    both("shorter than a block", prompt_text(1, max(1, block // 3)))
    full = prompt_text(2, 3 * block + 5)
    request(decode_url, full, 1)  # the decode instance caches it; the prefill instance has never seen it
    both("full prefix hit on decode, none on prefill", full)
    partial = prompt_text(3, 4 * block + 7)
    request(decode_url, partial[: 2 * block + 3], 1)
    both("partial prefix hit on decode", partial)
    both("completion, streamed", prompt_text(4, 2 * block), stream=True)
    both("chat completion", prompt_text(5, block + 9), chat=True)
    both("chat completion, streamed", prompt_text(6, block + 11), chat=True, stream=True)
    prompts = [prompt_text(100 + i, block + 13 * i) for i in range(concurrent)]
    with ThreadPoolExecutor(concurrent) as pool:
        answers = list(pool.map(lambda p: request(endpoint, p, new_tokens), prompts))
    for i, (p, a) in enumerate(zip(prompts, answers)):
        cases.append(Case(f"concurrent {i + 1}/{concurrent}", a, request(reference_url, p, new_tokens)))
    return cases


def transfer_events(stats_path: str) -> list[dict[str, Any]]:
    """KVBridgeConnector's per-transfer JSON lines (`stats_path` of the fleet's instances)."""
    try:
        with open(stats_path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def first_json_line(proc: subprocess.Popen, timeout: float, what: str = "kvbridge serve") -> dict:
    """The first line `proc` writes to stdout, as JSON (`kvbridge serve --json`'s summary, printed
    once the fleet serves); an AssertionError with its stderr's tail if it exits or stays silent."""
    end, buf = time.monotonic() + timeout, b""
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            if b"\n" in buf:
                return json.loads(buf.split(b"\n", 1)[0])
        elif proc.poll() is not None:
            break
    raise AssertionError(f"{what} gave no summary (rc {proc.poll()}): {proc.stderr.read()[-3000:]!r}")


__all__ = ["Answer", "Case", "edge_cases", "first_json_line", "prompt_text", "request", "tokenize", "transfer_events"]

"""Shared by the vLLM pool tests: `vllm serve` instances of given shapes, each with the pool
connector, on one real `mooncake_master` and one secret file, with deadlines a starved 2-core host
needs (a late lookup is a miss and opens the breaker, which drops stores)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, vllm_serve_member
from kvbridge.pool.master import MooncakeMaster
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.testing.members import running
from kvbridge.testing.serving import metric_total, prompt_text

START_S = 900.0


@contextmanager
def pool_fleet(vllm_env, work: Path, model: Path, shapes: Sequence[tuple[str, InstanceShape]], secret: bytes,
               dtype: str = "float32", extra_args: Sequence[str] = (), block_tokens: int = 64,
               max_model_len: int = 1024, member_args: dict[str, Sequence[str]] | None = None,
               member_kv: dict[str, dict] | None = None, master_host: str = "127.0.0.1",
               elsewhere: dict[str, tuple[str, str]] | None = None,
               connector: tuple[str, str] = ("KVBridgePoolConnector", "kvbridge.integrations.vllm"),
               member_env: dict[str, dict[str, str]] | None = None) -> Iterator[tuple]:
    """(master, member per shape in order), started; everything stopped on exit. `extra_args`
    go to every `vllm serve`, `member_args[name]` to that member's only, `member_kv[name]` into
    that member's connector settings; `elsewhere[name]` = (network namespace, its address) runs
    that member in that namespace (its Mooncake `local_hostname` goes in `member_kv`), and
    `master_host` is where the master listens (an address the namespace reaches); `connector` is
    the (class, module) vLLM loads, `member_env[name]` added to that member's environment."""
    (work / "pool.key").write_bytes(secret)
    (work / "pool.key").chmod(0o600)
    vllm = str(vllm_env.python.parent / "vllm")
    master = MooncakeMaster.start(work / "master.log", host=master_host)
    config = FleetConfig(model=model, prefill=[], decode=[], log_dir=work, dtype=dtype, max_model_len=max_model_len)
    kv = {"kv_connector": connector[0], "kv_connector_module_path": connector[1],
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
              "master": master.address, "secret_file": str(work / "pool.key"), "block_tokens": block_tokens,
              "segment_mib": 32, "staging_blocks": 16,
              "lookup_timeout_ms": 60_000, "load_timeout_ms": 120_000, "store_timeout_ms": 120_000,
              "release_ms": 120_000,
              "max_backoff_s": 5}}
    ports = free_ports(len(shapes), set(master.ports))
    def own(name: str) -> dict:
        mine = (member_kv or {}).get(name)
        if not mine:
            return kv
        return {**kv, "kv_connector_extra_config": {**kv["kv_connector_extra_config"], **mine}}

    members = [vllm_serve_member(config, vllm, name, shape, ports + i, work, kv=own(name))
               for i, (name, shape) in enumerate(shapes)]
    for (name, _), m in zip(shapes, members):
        m.argv += list(extra_args) + list((member_args or {}).get(name, ()))
        m.env.update((member_env or {}).get(name, {}))
        if name in (elsewhere or {}):  # another 'host': its own network namespace, reached over a veth
            ns, addr = elsewhere[name]
            m.argv[m.argv.index("--host") + 1] = m.argv_host = addr
            m.argv = ["ip", "netns", "exec", ns, *m.argv]
    try:
        with running(members, work, START_S):
            yield (master, *members)
    finally:
        master.stop()


def greedy_logprobs(url: str, text: str, max_tokens: int = 8, timeout: float = 900) -> list[tuple[str, float]]:
    """`max_tokens` greedy tokens of a completion, each with its log-prob."""
    body = {"model": "model", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        lp = json.load(r)["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"]))


def stored_prompt(master, writer, seed: int, length: int, timeout_s: float = 900) -> tuple[str, list, float]:
    """A fresh `length`-token prompt the writer answered (`greedy_logprobs`) and stored, and how many
    objects it stored: fresh prompts until a store lands (a store is dropped while the writer's
    breaker is open, e.g. after its first client start)."""
    keys = lambda: metric_total(master.metrics_url, "master_key_count")  # noqa: E731
    end = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < end, "the writer never stored a prompt"
        text, seed = prompt_text(seed, length), seed + 1000
        before = keys()
        reference = greedy_logprobs(writer.url, text)
        settle = time.monotonic() + 120
        while keys() == before and time.monotonic() < settle:
            time.sleep(0.5)
        time.sleep(5)  # the rest of its stores
        if keys() > before:
            return text, reference, keys() - before

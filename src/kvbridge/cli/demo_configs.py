"""One typed config per demo runner: what `kvbridge demo` builds from its options and runs.

Each config names exactly the options its runner takes (`OPTIONS`), so the command can refuse,
in one line, an option given to a runner that would ignore it. Each `run()` calls its runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec

from kvbridge.core.layout import EngineLayout

_SHARED = frozenset({"model", "prompt_len", "new_tokens", "seed", "as_json"})
_SHAPE = ("tp", "pp", "layer_split", "pcp", "dcp", "cp_interleave", "block_size", "kernel_block_size",
          "group_block_sizes", "layout", "kv_dtype")
"""Each side's shape options (`--prefill-X` / `--decode-X`)."""
_LOSSY = frozenset({"prefill_kv_dtype", "decode_kv_dtype"})
"""KV dtype conversion runs on the local executor's copy path only: the connector's transports
move bytes, and its handshake refuses peers of another KV dtype."""


class _Proof(msgspec.Struct, frozen=True, kw_only=True):
    """What every runner that runs the transformers proof on kvbridge's engines takes."""

    model: str
    prompt_ids: list[int] | None
    prompt_len: int
    new_tokens: int
    seed: int
    dump_decode_cache: Path | None = None


class _Shapes(_Proof, frozen=True, kw_only=True):
    prefill: EngineLayout
    decode: EngineLayout


class LocalDemo(_Shapes, frozen=True, kw_only=True):
    """`--transport local` (default): both engines in this process, the transformers proof."""

    OPTIONS: ClassVar[frozenset[str]] = _SHARED | {
        f"{side}_{name}" for side in ("prefill", "decode") for name in _SHAPE} | {
        "prompt_ids", "num_cached_tokens", "dump_decode_cache", "transport"}
    num_cached_tokens: int = 0

    def run(self) -> Any:
        from kvbridge.proofs.local_demo import run_demo
        return run_demo(self.model, prompt_ids=self.prompt_ids, prompt_len=self.prompt_len,
                        new_tokens=self.new_tokens, seed=self.seed, prefill=self.prefill, decode=self.decode,
                        dump_decode_cache=self.dump_decode_cache, num_cached_tokens=self.num_cached_tokens)


class TransportDemo(_Shapes, frozen=True, kw_only=True):
    """`--transport shm|nixl|mooncake`: every rank its own process, a real engine between them."""

    OPTIONS: ClassVar[frozenset[str]] = (LocalDemo.OPTIONS - {"num_cached_tokens"} - _LOSSY
                                         | {"mode", "requests", "timeout"})
    transport: Literal["shm", "nixl", "mooncake"]
    mode: Literal["pull", "push"] = "pull"
    requests: int = 1
    timeout: float = 120.0

    def run(self) -> Any:
        from kvbridge.proofs.connector_demo import run_multiprocess_demo
        return run_multiprocess_demo(self.transport, self.model, prompt_ids=self.prompt_ids,
                                     prompt_len=None if self.prompt_ids else self.prompt_len,
                                     new_tokens=self.new_tokens, seed=self.seed, prefill=self.prefill,
                                     decode=self.decode, mode=self.mode, dump_decode_cache=self.dump_decode_cache,
                                     num_requests=self.requests, timeout=self.timeout)


class DecodeClient(_Proof, frozen=True, kw_only=True):
    """`--role decode --prefill HOST:PORT`: the decode half against a `kvbridge prefill-server`."""

    OPTIONS: ClassVar[frozenset[str]] = _SHARED | {
        f"decode_{name}" for name in _SHAPE if name != "kv_dtype"} | {
        "prompt_ids", "transport", "mode", "requests", "timeout", "role", "prefill", "dump_decode_cache",
        "secret_file", "insecure"}
    prefill: str
    transport: Literal["shm", "nixl", "mooncake"]
    decode: EngineLayout
    mode: Literal["pull", "push"] = "pull"
    requests: int = 1
    timeout: float = 120.0
    secret_file: Path | None = None
    insecure: bool = False

    def run(self) -> Any:
        from kvbridge.proofs.connector_demo import run_decode_client
        return run_decode_client(self.prefill, transport=self.transport, model=self.model,
                                 prompt_ids=self.prompt_ids, prompt_len=None if self.prompt_ids else self.prompt_len,
                                 new_tokens=self.new_tokens, seed=self.seed, decode=self.decode, mode=self.mode,
                                 num_requests=self.requests, dump_decode_cache=self.dump_decode_cache,
                                 timeout=self.timeout, secret_file=self.secret_file, insecure=self.insecure)


class OffloadDemo(msgspec.Struct, frozen=True, kw_only=True):
    """`--offload`: store a prefix to CPU, evict it, load it back (TP-independent pool), decode."""

    OPTIONS: ClassVar[frozenset[str]] = _SHARED | {"prefill_tp", "decode_tp", "offload"}
    model: str
    prompt_len: int
    new_tokens: int
    seed: int
    store_tp: int
    load_tp: int

    def run(self) -> Any:
        from kvbridge.proofs.offload_demo import run_offload_demo
        return run_offload_demo(self.model, seed=self.seed, prompt_len=self.prompt_len, new_tokens=self.new_tokens,
                                store_tp=self.store_tp, load_tp=self.load_tp,
                                canonical=self.store_tp != self.load_tp)


class VllmDemo(msgspec.Struct, frozen=True, kw_only=True):
    """`--engine vllm`: two real vLLM CPU instances with KVBridgeConnector (needs `make vllm-env`)."""

    OPTIONS: ClassVar[frozenset[str]] = _SHARED | {
        "prompt_ids", "prefill_tp", "decode_tp", "prefill_block_size", "decode_block_size", "transport", "mode",
        "requests", "engine"}
    model_dir: str | None
    prompt_ids: list[int] | None
    prompt_len: int
    new_tokens: int
    seed: int
    prefill_tp: int
    decode_tp: int
    prefill_block_size: int
    decode_block_size: int
    transport: Literal["shm", "nixl", "mooncake"] = "shm"
    mode: Literal["pull", "push"] = "pull"
    requests: int = 1

    def run(self) -> dict[str, Any]:
        from kvbridge.proofs.vllm.demo import run_vllm_demo
        return run_vllm_demo(self.model_dir, self.prefill_tp, self.decode_tp, self.prompt_ids, self.new_tokens,
                             prefill_block_size=self.prefill_block_size, decode_block_size=self.decode_block_size,
                             prompt_len=self.prompt_len, seed=self.seed, transport=self.transport, mode=self.mode,
                             requests=self.requests)


RUNNERS: dict[str, type] = {"local": LocalDemo, "transport": TransportDemo, "decode": DecodeClient,
                            "offload": OffloadDemo, "vllm": VllmDemo}
"""Runner name -> its config, in the order the help lists them."""

RUNNER_FLAGS = {"local": "--transport local", "transport": "--transport shm|nixl|mooncake",
                "decode": "--role decode", "offload": "--offload", "vllm": "--engine vllm"}

DEFAULT_MODEL = {"local": "tiny-llama", "transport": "tiny-llama", "decode": "tiny-llama",
                 "offload": "tiny-gemma2", "vllm": None}
"""Each runner's model when `--model` is not given (offload shows a sliding-window model; vLLM a
tiny Llama directory it writes itself)."""

"""The multi-process proof: a real transformers model decodes from a KV cache that each prefill
rank process sent to each decode rank process through a real transport.

Each case checks the tokens (identical to monolithic `generate`), the rebuilt cache (bit-exact),
replicated heads (equal on every rank), every request's per-rank result, and that every prefill
rank released every request exactly once.
"""

from __future__ import annotations

import pytest
from connector_harness import require
from safetensors.torch import load_file

from kvbridge.proofs.connector_demo import run_multiprocess_demo
from kvbridge.core.layout import EngineLayout

pytestmark = pytest.mark.oracle


def L(tp: int, block: int = 16, blocks: int = 16, **kw) -> EngineLayout:  # noqa: N802
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=blocks, **kw)


SHAPES = {
    "P2>D1": ("tiny-llama", L(2), L(1, 8, 24, kv_order="NHD")),
    "P1<D2": ("tiny-llama", L(1, 32, 8), L(2)),
    "6kv-P3-D2-nondivisible": ("tiny-llama-6kv", L(3), L(2, 8, 24, kv_order="NHD")),
}


def _check(result, num_requests: int = 1) -> None:
    d = result.to_dict()
    failed = [r for r in d["requests"] if not (r["ok"] and r["match"])]
    assert not failed, failed[:3]
    assert result.match and result.cache_equal and result.replicas_equal, result.cache_differences
    assert result.requests_ok == num_requests and result.released_exactly_once, result.releases
    assert all(set(v) == {"done"} and sum(v.values()) == num_requests for v in result.releases.values())
    assert result.tokens_reference == result.tokens_disaggregated and len(result.tokens_reference) == result.new_tokens
    assert result.bytes_moved > 0 and result.bytes_measured == result.bytes_moved
    assert result.ok and d["ok"]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shm_shapes(shape: str, mode: str) -> None:
    model, prefill, decode = SHAPES[shape]
    result = run_multiprocess_demo("shm", model, prompt_len=29, new_tokens=5, seed=1, prefill=prefill, decode=decode,
                                   mode=mode, timeout=60)
    _check(result)
    assert result.processes == prefill.tp_size + decode.tp_size


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_32_requests_in_flight(mode: str) -> None:
    result = run_multiprocess_demo("shm", "tiny-llama", prompt_len=20, new_tokens=3, seed=2, mode=mode,
                                   prefill=L(2, 16, 96), decode=L(2, 8, 192, kv_order="NHD"), num_requests=32,
                                   timeout=90)
    _check(result, 32)
    assert len({tuple(r["tokens_reference"]) for r in result.requests}) > 1  # different prompts, different tokens


@pytest.mark.parametrize("transport, mode", [("nixl", "pull"), ("nixl", "push"), ("mooncake", "pull"),
                                             ("mooncake", "push")])
def test_network_transports(transport: str, mode: str) -> None:
    require(transport)
    result = run_multiprocess_demo(transport, "tiny-llama-6kv", prompt_len=27, new_tokens=4, seed=3,
                                   prefill=L(3), decode=L(2, 8, 24, kv_order="NHD"), mode=mode, timeout=90)
    _check(result)
    assert result.transport == transport


def test_dump_decode_cache(tmp_path) -> None:
    path = tmp_path / "decode.safetensors"
    result = run_multiprocess_demo("shm", "tiny-llama", prompt_len=12, new_tokens=2, seed=4, prefill=L(1),
                                   decode=L(2), dump_decode_cache=path, timeout=60)
    _check(result)
    tensors = load_file(str(path))
    assert sorted(tensors) == ["layers.0.keys", "layers.0.values", "layers.1.keys", "layers.1.values"]
    assert tuple(tensors["layers.0.keys"].shape) == (1, 4, 12, 16)


def test_bad_arguments_fail_before_any_process_starts() -> None:
    from kvbridge.errors import ConfigError, InvalidRequest
    with pytest.raises(InvalidRequest, match="mode must be 'pull' or 'push'"):
        run_multiprocess_demo("shm", mode="sideways")
    with pytest.raises(ConfigError, match="unknown transport 'carrier-pigeon'"):
        run_multiprocess_demo("carrier-pigeon")
    with pytest.raises(InvalidRequest, match=r"decode layout has 2 blocks of 16 tokens; 1 request\(s\) of 40 tokens"):
        run_multiprocess_demo("shm", prompt_len=40, decode=L(1, 16, 2))

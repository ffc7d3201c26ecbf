"""`registration._probe_cpu_kv` reads an fp8 cache as the fp8 bytes vLLM's CPU kernel writes (issue
43, noted and left): it compared the scratch block with an integer cast of K and V, which can
never match, so every fp8 kernel was said to keep "an unknown order" whatever it did. vLLM's
kernel is a stand-in here (no vLLM needed): one that writes the fp8 encoding as kvbridge describes
it (K transposed, V by rows) must be recognised; `tests/vllm/test_vllm_cpu_order.py` runs vLLM's own."""

from __future__ import annotations

import sys
import types

import pytest
import torch


def _fake_vllm(monkeypatch, write) -> None:
    ops = types.SimpleNamespace(cpu_attn_reshape_and_cache=write)
    cpu_attn = types.ModuleType("vllm.v1.attention.backends.cpu_attn")
    cpu_attn._get_attn_isa = lambda *a: "vec"
    vllm = types.ModuleType("vllm")
    vllm._custom_ops = ops
    for name, mod in (("vllm", vllm), ("vllm._custom_ops", ops), ("vllm.v1", types.ModuleType("vllm.v1")),
                      ("vllm.v1.attention", types.ModuleType("vllm.v1.attention")),
                      ("vllm.v1.attention.backends", types.ModuleType("vllm.v1.attention.backends")),
                      ("vllm.v1.attention.backends.cpu_attn", cpu_attn)):
        monkeypatch.setitem(sys.modules, name, mod)


def _described(fp8: torch.dtype | None):
    """A kernel that writes K transposed and V by rows, as fp8 bytes when `fp8` is given."""
    def write(key, value, key_cache, value_cache, slots, isa, k_scale, v_scale, kv_cache_dtype):
        n, _, d = key.shape
        enc = (lambda t: t.to(fp8).view(torch.uint8)) if fp8 is not None else (lambda t: t.to(key_cache.dtype))
        key_cache.view(n * d).copy_(enc(key[:, 0, :]).t().reshape(-1))  # [d, n] row-major
        value_cache.view(n, d).copy_(enc(value[:, 0, :]))
    return write


@pytest.mark.parametrize("cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                              ("fp8_e5m2", torch.float8_e5m2)])
def test_an_fp8_cache_written_as_described_is_recognised(monkeypatch, cache_dtype, fp8) -> None:
    from kvbridge.integrations.vllm.registration import _probe_cpu_kv
    _fake_vllm(monkeypatch, _described(fp8))
    isa, ok, found = _probe_cpu_kv(torch.uint8, 32, 64, cache_dtype, torch.bfloat16)
    assert ok and found.startswith("K transposed and V by rows"), found


def test_an_fp8_cache_in_another_order_is_said_so_and_a_plain_one_unchanged(monkeypatch) -> None:
    from kvbridge.integrations.vllm.registration import _probe_cpu_kv

    def by_rows(key, value, key_cache, value_cache, *rest, **kw):  # K by rows: not what kvbridge describes
        n, _, d = key.shape
        key_cache.view(n, d).copy_(key[:, 0, :].to(torch.float8_e4m3fn).view(torch.uint8))
        value_cache.view(n, d).copy_(value[:, 0, :].to(torch.float8_e4m3fn).view(torch.uint8))

    _fake_vllm(monkeypatch, by_rows)
    _, ok, found = _probe_cpu_kv(torch.uint8, 32, 64, "fp8", torch.bfloat16)
    assert not ok and found == "K by rows and V by rows (float8_e4m3fn bytes)", found
    _fake_vllm(monkeypatch, _described(None))
    _, ok, found = _probe_cpu_kv(torch.bfloat16, 32, 64)
    assert ok and found == "K transposed and V by rows", found

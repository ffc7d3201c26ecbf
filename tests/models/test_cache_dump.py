"""`--dump-decode-cache` writes every tensor the proof moves, under one naming rule
(`proofs.cache_compare.save_cache`): recurrent states always indexed by their state index, and
tensors that share memory in the cache (DeepSeek-V4's K=V window) written each as its own copy,
with the sharing named in the file's metadata. The sweep's CI sample dumps every architecture it
moves and reads each file back (`model_sweep.check_dump`, in `test_sweep_sample`)."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from kvbridge.proofs.cache_compare import dump_names, save_cache


def _cache() -> DynamicCache:
    cache = DynamicCache()
    kv = DynamicLayer()
    window = torch.arange(24, dtype=torch.float32).reshape(1, 1, 3, 8)
    kv.keys, kv.values, kv.is_initialized = window, window, True  # one tensor under two names (K=V)
    one = LinearAttentionLayer(number_of_states=1)
    one.conv_states[0], one.recurrent_states[0] = torch.ones(1, 6, 4), torch.zeros(1, 2, 3, 3)
    three = LinearAttentionLayer(number_of_states=3)
    for j in range(3):
        three.conv_states[j] = torch.full((1, 4, 4), float(j))
    cache.layers = [kv, one, three]
    return cache


def test_shared_memory_is_written_once_per_name_and_named_in_the_metadata(tmp_path):
    path = tmp_path / "cache.safetensors"
    cache = _cache()
    save_cache(cache, path)  # safetensors refuses tensors sharing memory: "Some tensors share memory"
    dumped = load_file(str(path))
    assert torch.equal(dumped["layers.0.keys"], cache.layers[0].keys)
    assert torch.equal(dumped["layers.0.values"], cache.layers[0].values)
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["layers.0.values"] == "layers.0.keys"
        assert "layers.1.conv_states.0" not in f.metadata()


def test_recurrent_states_are_always_indexed(tmp_path):
    path = tmp_path / "cache.safetensors"
    cache = _cache()
    save_cache(cache, path)
    dumped = load_file(str(path))
    assert sorted(dumped) == sorted(dump_names(cache)) == sorted([
        "layers.0.keys", "layers.0.values", "layers.1.conv_states.0", "layers.1.recurrent_states.0",
        "layers.2.conv_states.0", "layers.2.conv_states.1", "layers.2.conv_states.2"])
    assert [float(dumped[f"layers.2.conv_states.{j}"][0, 0, 0]) for j in range(3)] == [0.0, 1.0, 2.0]


def test_deepseek_v4_dump_reads_back_bit_exact(tmp_path):
    """DeepSeek-V4's window layers keep K and V as one tensor: the dump ended in a safetensors
    traceback ("Some tensors share memory")."""
    from transformers import AutoModelForCausalLM

    from kvbridge.proofs.local_demo import run_demo
    from kvbridge.proofs.model_sweep import PAIRS, check_dump, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v4"), dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "m")
    prompt = list(range(3, 27))
    dump = tmp_path / "cache.safetensors"
    _, prefill, decode = PAIRS[0]
    result = run_demo(str(tmp_path / "m"), prompt_ids=prompt, new_tokens=2, prefill=prefill, decode=decode,
                      dump_decode_cache=dump)
    assert result.ok, result.cache_differences
    check_dump(dump, model, prompt)
    with safe_open(str(dump), "pt") as f:
        assert any(k.endswith(".values") and v.endswith(".keys") for k, v in f.metadata().items())

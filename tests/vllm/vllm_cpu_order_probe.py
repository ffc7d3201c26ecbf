"""Run in .venv-vllm by `test_vllm_cpu_order.py`: which of vLLM CPU's attention kernels keep a
block's bytes as kvbridge describes them, and the pool's `byte_order` and sliding windows that
kvbridge derives from vLLM's own group specs. Prints one JSON object."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from kvbridge.integrations.vllm.registration import _probe_cpu_kv, cpu_byte_order, pd_window_note, sliding_window_of


def config(dtype: torch.dtype, groups: list, cache_dtype: str = "auto") -> tuple[SimpleNamespace, SimpleNamespace]:
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(use_mla=False, dtype=dtype),
                                  cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    return vllm_config, SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], g) for i, g in enumerate(groups)])


def main() -> None:
    out: dict = {"amx": bool(torch.cpu._is_amx_tile_supported()), "kernels": [], "orders": {}}
    for dtype in (torch.float32, torch.bfloat16):
        for block in (16, 32, 64):
            for head in (32, 64, 128):
                isa, ok, found = _probe_cpu_kv(dtype, block, head)
                out["kernels"].append({"dtype": str(dtype), "block": block, "head": head, "isa": isa, "ok": ok,
                                       "found": found})
    for dtype in (torch.float32, torch.bfloat16):
        for block in (16, 32, 64):
            full = FullAttentionSpec(block, num_kv_heads=2, head_size=64, dtype=dtype)
            sliding = SlidingWindowSpec(block, num_kv_heads=2, head_size=64, dtype=dtype, sliding_window=128)
            out["orders"][f"{dtype} {block}"] = cpu_byte_order(*config(dtype, [full, sliding]))
    # an fp8 KV cache of a bfloat16 model: whatever the kernel makes of the scratch block, the
    # connector starts, and its instances share only with instances of the same order
    fp8 = FullAttentionSpec(64, num_kv_heads=2, head_size=64, dtype=torch.uint8)
    out["fp8"] = cpu_byte_order(*config(torch.bfloat16, [fp8], cache_dtype="fp8"))
    out["windows"] = {
        "full": sliding_window_of(FullAttentionSpec(64, num_kv_heads=2, head_size=64, dtype=torch.float32)),
        "promoted": sliding_window_of(FullAttentionSpec(64, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                                        sliding_window=128)),
        "sliding": sliding_window_of(SlidingWindowSpec(64, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                                       sliding_window=128))}
    full = FullAttentionSpec(64, num_kv_heads=2, head_size=64, dtype=torch.float32)
    sliding = SlidingWindowSpec(64, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)
    out["pd_notes"] = {name: pd_window_note(config(torch.float32, groups)[1]) for name, groups in
                       (("full", [full]), ("every layer slides", [sliding]), ("full and sliding", [full, sliding]))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

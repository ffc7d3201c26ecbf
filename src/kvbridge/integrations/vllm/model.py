"""A tiny random-weight Llama that vLLM CPU runs, saved with `save_pretrained` (no download).

vLLM's CPU attention takes head sizes 32, 64, 80, ... (not kvbridge's built-in 16), so this
model has its own geometry: GQA with 4 query heads and 2 KV heads of 32 (TP 1 and 2 shard the
KV heads, TP 4 replicates them). Weights are drawn from `seed` with a large initializer range so
that greedy tokens depend on the whole context (a broken cache shows up as different tokens).
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(path: str | Path, *, num_kv_heads: int = 2, num_heads: int = 4, head_dim: int = 32,
                    num_layers: int = 2, vocab_size: int = 256, seed: int = 0) -> Path:
    """Write the model to `path` (config.json + model.safetensors) and return the path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=num_heads * head_dim, intermediate_size=4 * num_heads * head_dim,
                      vocab_size=vocab_size, max_position_embeddings=1024, head_dim=head_dim, initializer_range=0.2,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    import json
    import sys

    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print(make_tiny_llama(sys.argv[1], **args))

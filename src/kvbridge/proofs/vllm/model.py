"""A tiny random-weight Llama that vLLM CPU runs, written as a Hugging Face model directory (no download).

vLLM's CPU attention takes head sizes 32, 64, 80, ... (not kvbridge's built-in 16), so this
model has its own geometry: GQA with 4 query heads and 2 KV heads of 32 (TP 1 and 2 shard the
KV heads, TP 4 replicates them). Weights are drawn from `seed` with a large standard deviation
(0.2) so that greedy tokens depend on the whole context (a broken cache shows up as different
tokens).

The directory is what `LlamaForCausalLM.save_pretrained` writes (config.json,
generation_config.json, model.safetensors with the same tensor names), written with torch and
safetensors only: importing transformers to build it cost 20-90 s of a loaded 2-core host's
time per test run (a subprocess of the vLLM environment), this takes well under a second in
any environment that has kvbridge.
"""

from __future__ import annotations

import json
from pathlib import Path


def make_tiny_llama(path: str | Path, *, num_kv_heads: int = 2, num_heads: int = 4, head_dim: int = 32,
                    num_layers: int = 2, vocab_size: int = 256, seed: int = 0,
                    sliding_window: int | None = None, every_layer_slides: bool = False) -> Path:
    """Write the model to `path` (config.json + model.safetensors) and return the path.

    `sliding_window`: every second layer (1, 3, ...) attends to that many tokens only
    (`layer_types`, which vLLM's Llama reads), so vLLM's hybrid allocator keeps a full and a
    sliding-window KV-cache group; with `every_layer_slides` every layer does (Mistral-7B-v0.1
    style: one sliding-window group)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, std = num_heads * head_dim, 4 * num_heads * head_dim, 0.2
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "dtype": "float32", "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": std, "intermediate_size": inter, "max_position_embeddings": 1024, "mlp_bias": False,
        "num_attention_heads": num_heads, "num_hidden_layers": num_layers, "num_key_value_heads": num_kv_heads,
        "pretraining_tp": 1, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": vocab_size,
    }
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
        config["layer_types"] = ["sliding_attention" if i % 2 or every_layer_slides else "full_attention"
                                 for i in range(num_layers)]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(num_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(num_kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(num_kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, num_heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab_size, hidden)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"_from_model_config": True, "use_cache": True}) + "\n")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def make_tiny_hybrid(path: str | Path, *, kind: str = "nemotron_h", seed: int = 0) -> Path:
    """A tiny random hybrid model that vLLM CPU runs with its hybrid allocator, float32, 4 query
    and 2 KV heads of 32, built with transformers' own classes (the geometry comes from
    transformers' config class, as kvbridge reads it):

    * "nemotron_h": Nemotron-H, pattern "M-*M*" (Mamba2, MLP, attention, Mamba2, attention), 4
      Mamba heads of 32 in 2 groups (TP 1 and 2 split both);
    * "lfm2": LFM2, short conv / attention twice, conv kernel 3 over 128 channels. Its config
      also carries the fields vLLM 0.32's LFM2 reads under older names (`conv_dim`, `block_*`);
    * "qwen3_next": Qwen3-Next, gated delta net / gated attention twice, 2 key and 4 value heads of
      128 (vLLM CPU's GDN kernel takes no other head size), a small MoE. Save it in bfloat16
      (vLLM CPU's GDN runs no float32).
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if kind == "nemotron_h":
        pattern = "M-*M*"
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            **common, num_hidden_layers=len(pattern), hybrid_override_pattern=pattern, head_dim=32,
            mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4))
    elif kind == "lfm2":
        model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            **common, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3, conv_dim=128, conv_dim_out=128, block_dim=128, block_auto_adjust_ff_dim=False,
            block_ffn_dim_multiplier=1.0, block_multiple_of=32))
    elif kind == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **{**common, "max_position_embeddings": 4096}, num_hidden_layers=4, head_dim=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, decoder_sparse_step=1)).to(torch.bfloat16)
    else:
        raise ValueError(f"unknown tiny hybrid kind {kind!r}: nemotron_h, lfm2 or qwen3_next")
    path = Path(path)
    model.save_pretrained(path)
    return path


def make_tiny_mla(path: str | Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """A tiny random DeepSeek-V2 (MLA, dense MLPs) that vLLM CPU runs: its MLA backends take only
    DeepSeek's latent of 576 (kv_lora_rank 512 + rope 64), so those two are real size; 4 query
    heads of 32 + 64 dims, hidden 128. vLLM CPU's AMX backend takes bfloat16 weights only: serve it
    with `--dtype bfloat16`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=num_layers, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    path = Path(path)
    transformers.DeepseekV2ForCausalLM(config).save_pretrained(path)
    return path


def make_tiny_lora(model_dir: str | Path, out_dir: str | Path, *, seed: int, rank: int = 8,
                   targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> Path:
    """A random PEFT LoRA adapter for the tiny llama at `model_dir`, strong enough to change greedy tokens."""
    import torch
    from safetensors.torch import save_file

    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
              "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, c["intermediate_size"]),
              "up_proj": ("mlp", h, c["intermediate_size"]), "down_proj": ("mlp", c["intermediate_size"], h)}
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for i in range(c["num_hidden_layers"]):
        for t in targets:
            block, fan_in, fan_out = shapes[t]
            p = f"base_model.model.model.layers.{i}.{block}.{t}."
            # std 0.2 for A and B with scaling 2: B @ A is about as large as the base weights (std 0.2)
            weights[p + "lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.2
            weights[p + "lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.2
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
              "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def add_byte_tokenizer(path: str | Path) -> Path:
    """Write a byte-level tokenizer of 256 ids (one per byte: every tiny model here has a vocabulary
    of 256) with a plain chat template into model directory `path`, so that `vllm serve` can take
    text and chat messages. Built with the `tokenizers` library in well under a second, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return Path(path)


if __name__ == "__main__":
    import sys

    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print(make_tiny_llama(sys.argv[1], **args))


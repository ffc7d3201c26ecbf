"""Every causal-LM architecture of the installed transformers through the transformers proof.

For each `model_type` in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: a tiny random config (the class's
defaults with every size field that exists shrunk, layer patterns kept), its `ModelSpec`, and the
proof (`run_demo`: prefill, move, decode, compare tokens and every cache bit with plain
`generate`) on two shape pairs: TP1 -> TP2, and a harder one (TP3 -> TP2, blocks of 16 -> 8,
HND -> NHD). The outcome is one row: moved (both pairs bit-exact), mismatch (ran, not exact: a
bug), refused (one line naming the layer and kind) or error (the proof could not run it).
`scripts/models_sweep.py` writes all rows to docs/models.md; tests run a bounded sample.
"""

from __future__ import annotations

import contextlib
import signal
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from kvbridge.core.layout import EngineLayout
from kvbridge.errors import ConfigError, IncompatibleEngines, KVBridgeError, ShardingError

PAIRS: tuple[tuple[str, EngineLayout, EngineLayout], ...] = (
    ("TP1->TP2", EngineLayout(tp_size=1, block_size=16, num_blocks=8), EngineLayout(tp_size=2, block_size=16, num_blocks=8)),
    ("TP3/b16/HND->TP2/b8/NHD", EngineLayout(tp_size=3, block_size=16, num_blocks=8),
     EngineLayout(tp_size=2, block_size=8, num_blocks=16, kv_order="NHD")),
)
# When a kind's units do not split over 3 ranks (one KV head, MQA), the harder pair falls back to this.
FALLBACK_PAIR = ("TP4/b16/HND->TP2/b8/NHD", EngineLayout(tp_size=4, block_size=16, num_blocks=8),
                 EngineLayout(tp_size=2, block_size=8, num_blocks=16, kv_order="NHD"))
NUM_LAYERS = 4
PROMPT_LEN = 40  # > the tiny sliding window / chunk (8), so windows drop tokens
NEW_TOKENS = 4

# Sizes of a tiny model, applied to whichever of these fields the architecture's config has.
TINY: dict[str, Any] = {
    # 12 query and 6 KV heads of 8, so that TP 3 and TP 2 both divide them (a non-divisible pair)
    "hidden_size": 96, "n_embd": 96, "d_model": 96, "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128,
    "num_attention_heads": 12, "n_head": 12, "num_heads": 12, "num_key_value_heads": 6, "num_kv_heads": 6,
    "head_dim": 8, "vocab_size": 256, "unpadded_vocab_size": 256, "max_position_embeddings": 512, "n_positions": 512,
    "sliding_window": 8, "sliding_window_size": 8, "attention_chunk_size": 8,  # Inkling: sliding_window_size
    "attention_window_size": 8,  # RecurrentGemma: its sliding_window is an alias of this field
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24, "index_head_dim": 16, "index_n_heads": 2,
    # Qwen4-Exp's sparse-attention indexer (off in its class defaults; one key head, budget a multiple of the ratio)
    "indexer_head_dim": 16, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_budget": 16, "indexer_compress_ratio": 4,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "num_experts_per_token": 2, "num_expert_group": 1,
    "moe_intermediate_size": 64, "n_shared_experts": 1, "shared_expert_intermediate_size": 64,
    "linear_num_key_heads": 6, "linear_num_value_heads": 12, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_heads": 6, "linear_head_dim": 8,
    # Mamba2: heads * head_dim = expand (2) * hidden; 6 groups split over 3 and 2 ranks
    "mamba_n_heads": 12, "mamba_num_heads": 12, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_n_groups": 6,
    "n_groups": 6, "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_dt_rank": 8,
    "time_step_rank": 8, "n_mamba_heads": 12, "mamba_headdim": 16, "mamba_ngroups": 6,
    "rotary_dim": 8, "dim_head": 8, "initializer_range": 0.2, "tie_word_embeddings": False, "is_decoder": True,
}
# Attention sizes an architecture may also keep per layer kind, under a prefix of its own.
_PER_KIND = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "head_dim")
# Fields whose tiny value depends on the layer count and that no general rule derives.
# Class defaults with no attention layer among the first few get one, so that generate can run.
_TINY_EXTRA: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], NUM_LAYERS // 2]]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "granitemoehybrid": {"layer_types": ["linear_attention"] * (NUM_LAYERS - 1) + ["full_attention"]},
    "lfm2_moe": {"layer_types": ["conv"] * (NUM_LAYERS - 1) + ["full_attention"]},
    # class defaults that cannot build a model in transformers 5.23: the rope settings the modeling code reads
    "dbrx": {"n_heads": 12, "attn_config": {"kv_n_heads": 6, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": 96, "ffn_hidden_size": 128, "moe_num_experts": 4}},
    # the classes' validators: Mamba heads divide expand * hidden; one expert per token
    "falcon_h1": {"mamba_expand": 2, "mamba_d_ssm": 192},
    "zaya": {"num_experts_per_tok": 1},  # its config accepts no other
    # compress rates that divide both pairs' block sizes (8, 16) and close windows in the 40-token
    # prompt: the default rate 128 of the heavily compressed layers is more than the whole prompt
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
    "longcat_flash": {"head_dim": 8},  # its rotary embedding is sized by head_dim, = qk_rope_head_dim
    "reformer": {"axial_pos_embds": False},  # its axial factors must sum to the hidden size
    # xLSTMCache sizes the mLSTM state by head dims rounded up to multiples of 64, its layers do not
    # round: only qk and v widths that are multiples of 64 (hidden * 0.5, hidden * 1) agree; 6 heads
    # (of 32 / 64) split over 3 and 2 ranks
    "xlstm": {"hidden_size": 384, "embedding_dim": 384, "num_heads": 6},
    # Dory's class halves layer counts given in its released (attention, mlp) block format: the tiny
    # pattern in its own format, one input, two looped and one output layer
    "dory": {"layer_types": None, "n_input_layers": 1, "n_output_layers": 1},
    "xmod": {"default_language": "en_XX"},  # it refuses to run without a language adapter chosen
    # its forward sizes the cache by the encoder's layer count (2 by default), the decoder has 24
    "blenderbot": {"encoder_layers": NUM_LAYERS, "decoder_layers": NUM_LAYERS, "encoder_attention_heads": 12,
                   "decoder_attention_heads": 12, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128},
    # CPM-Ant prepends `prompt_length` learned prompt tokens inside the model: its cache holds more
    # positions than the request has tokens, which no serving engine's block table describes
    "cpmant": {"prompt_length": 0},
    "cohere_compass_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
}
# Class defaults that the class's own validation rejects (transformers 5.23): what makes them valid.
_BASE: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False, "use_double_wide_mlp": False}},
}
_NONE = ("bos_token_id", "eos_token_id")  # pad stays: some embeddings need a padding index
SECONDS_PER_ARCH = 240


@dataclass
class SweepRow:
    arch: str
    status: str  # moved | mismatch | refused | error | unbuildable | skipped
    kinds: str = ""
    detail: str = ""
    pairs: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def chosen_types(only: str) -> tuple[list[str], list[str]]:
    """The architectures a sweep's `--only` (comma-separated model types, empty: all) names, and
    those of its names that are no causal LM of this transformers (the sweep scripts refuse them)."""
    known = causal_lm_types()
    archs = [a for a in only.split(",") if a] or known
    return archs, sorted(set(archs) - set(known))


def unknown_types_error(unknown: list[str]) -> str:
    """The one line a sweep script prints for `chosen_types`'s unknown names."""
    return f"error: --only names no causal-LM architecture of this transformers: {', '.join(unknown)[:200]}"


def _shrink_list(values: list[Any], n: int) -> list[Any]:
    """A per-layer pattern cut to `n` layers, keeping every distinct entry it had (if n allows)."""
    seen: list[Any] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    out = list(values[:n])
    for v in seen:  # a kind that first appears after layer n would vanish: put it at the end
        if v not in out:
            out[len(out) - 1 - seen.index(v) % len(out)] = v
    return out


def _shrink_kv_sharing(types: list[Any], shared: int, n: int) -> tuple[int, list[Any]]:
    """KV sharing (Gemma-3n: the last `shared` layers read the K/V of the last earlier layer of their
    type) cut to `n` layers: the shared part scaled, at least one layer, and each part shrunk on its
    own, so that every type a shared layer reads still has a layer producing it (transformers
    refuses the config otherwise; cutting the whole pattern to `n` would leave the producers one type)."""
    kinds = len(dict.fromkeys(types))
    tiny = min(max(1, round(shared * n / len(types))), n - kinds)
    if tiny < 1:
        return 0, _shrink_list(types, n)
    producers, consumers = types[:len(types) - shared], types[len(types) - shared:]
    return tiny, _shrink_list(producers, n - tiny) + _shrink_list(consumers, tiny)


def tiny_config(arch: str) -> Any:
    """The architecture's config class with tiny sizes (only fields it has), float32, no special tokens."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    try:
        base = cls(**_BASE.get(arch, {})).to_dict()
    except Exception as e:  # noqa: BLE001 - the class rejects its own defaults
        raise Unbuildable(one_line(e)) from None
    text = base.get("text_config")
    if isinstance(text, dict) and text.get("num_kv_shared_layers") == text.get("num_hidden_layers"):
        from kvbridge.models import spec_from_hf_config
        spec_from_hf_config(base, warn=False)  # the library's refusal: no layer keeps a cache of its own
    if any(isinstance(base.get(k), dict) for k in ("text_config", "vision_config", "audio_config")):
        raise _Skip("a multimodal wrapper: its text model is swept under its own model_type")
    kw = {k: v for k, v in TINY.items() if k in base}
    if base.get("multi_query") is True:  # the architecture's MQA decides its KV heads
        kw.pop("num_key_value_heads", None)
    if "kv_lora_rank" in base:  # MLA configs use head_dim for the rope part
        kw.pop("head_dim", None)
        if "num_key_value_heads" in kw:  # MLA expands the latent to one K/V per query head
            kw["num_key_value_heads"] = kw["num_attention_heads"]
    # a size kept per layer kind under a prefix (Inkling's sliding layers: swa_num_attention_heads,
    # swa_num_key_value_heads, swa_head_dim) shrinks with the size it varies: left at its default,
    # its layers would have more KV heads than the tiny query heads
    for key, value in base.items():
        own = next((k for k in _PER_KIND if key.endswith("_" + k) and k in kw), None)
        if own and key not in TINY and value is not None:
            kw[key] = kw[own]
    layers_key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in base), None)
    if layers_key:
        kw[layers_key] = NUM_LAYERS
    for key in ("layer_types", "layers_block_type"):
        if isinstance(base.get(key), list) and base[key]:
            kw[key] = _shrink_list(base[key], NUM_LAYERS)
    shared = base.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < base.get("num_hidden_layers", 0) and isinstance(kw.get("layer_types"), list):
        kw["num_kv_shared_layers"], kw["layer_types"] = _shrink_kv_sharing(base["layer_types"], shared, NUM_LAYERS)
    for key in ("attn_layer_indices", "full_attn_idxs"):
        if key in base:  # attention on the last layer only, the other kind before it (as derived by the class)
            kw[key] = [NUM_LAYERS - 1]
            if "layer_types" in base:
                kw["layer_types"] = None
    if "mamba_expand" in base or "expand" in base:  # Mamba2 heads * head_dim = expand * hidden
        if "num_heads" in base and "state_size" in base:  # Mamba2's own names
            kw["num_heads"], kw["head_dim"] = 12, 16
    kw.pop("_", None)
    kw.update(_TINY_EXTRA.get(arch, {}))
    if isinstance(base.get("pad_token_id"), int):  # inside the tiny vocabulary
        kw["pad_token_id"] = min(base["pad_token_id"], 255)
    try:  # no special tokens, so that every run decodes exactly NEW_TOKENS
        return cls(**kw, **{k: None for k in _NONE if k in base}, dtype="float32")
    except Exception as first:  # noqa: BLE001 - the class may require them: keep them inside the tiny vocabulary
        ids = {k: min(int(base[k]), 255) for k in _NONE if isinstance(base.get(k), int)}
        try:
            return cls(**kw, **ids, dtype="float32")
        except Exception:  # noqa: BLE001 - not the tokens: the first reason is the one to report
            raise first from None


def tiny_model(arch: str, seed: int = 0) -> Any:
    """A float32 model of `tiny_config(arch)` in eval mode, weights drawn from `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()


class _Skip(Exception):
    pass


class SweepTimeout(Exception):
    pass


class Unbuildable(Exception):
    """transformers fails on a tiny config of the architecture's own class (its bug, not kvbridge's)."""


def _alarm(signum: int, frame: Any) -> None:
    raise SweepTimeout()


@contextlib.contextmanager
def row_outcome(row: Any, timeout: int, unbuildable: str = "{}") -> Iterator[None]:
    """Run one sweep row's body under a `timeout` s SIGALRM bound, turn its failure into the row's
    status and detail (skipped, unbuildable, error, refused) instead of a crash, and time it; shared
    by the model sweep and the stray-field sweep."""
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        yield
    except _Skip as e:
        row.status, row.detail = "skipped", str(e)
    except Unbuildable as e:
        row.status, row.detail = "unbuildable", unbuildable.format(e)
    except SweepTimeout:
        row.status, row.detail = "error", f"over {timeout} s"
    except ConfigError as e:
        row.status, row.detail = "refused", one_line(e)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign architecture is a row, not a crash
        row.status, row.detail = "error", one_line(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        row.seconds = round(time.perf_counter() - t0, 1)


def one_line(e: BaseException) -> str:
    from kvbridge.models.untrusted import safe_text
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = " ".join(text[:2]) if text and text[0].endswith(":") else (text[0] if text else "")
    return safe_text(f"{type(e).__name__}: {first}" if not isinstance(e, KVBridgeError)
                     else (first or type(e).__name__), 240)


def layer_kinds(spec: Any) -> str:
    counts = Counter(layer.recurrent_type or (f"{layer.kind}(w={layer.window})" if layer.window else
                                              f"{layer.kind}(1/{layer.tokens_per_row})" if layer.tokens_per_row > 1
                                              else layer.kind)
                     for layer in spec.layers)
    return ", ".join(f"{n}x{k}" for k, n in counts.items())


def sweep_one(arch: str, seed: int = 0, timeout: int = SECONDS_PER_ARCH) -> SweepRow:
    """One architecture through config -> spec -> the proof on both pairs."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvbridge.models import spec_from_hf_config
    from kvbridge.proofs.local_demo import run_demo

    row = SweepRow(arch, "error")
    with row_outcome(row, timeout, "transformers cannot build or run it from its config class: {}"):
        config = tiny_config(arch)
        spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype="float32", warn=False)
        row.kinds = layer_kinds(spec)
        torch.manual_seed(seed)
        # a real prompt holds no padding: RoBERTa-style position ids skip pad tokens
        special = {getattr(config, "pad_token_id", None)}
        vocab = [t for t in range(int(config.get_text_config(decoder=True).vocab_size)) if t not in special]
        prompt = [vocab[i] for i in torch.randint(0, len(vocab), (PROMPT_LEN,),
                                                  generator=torch.Generator().manual_seed(seed)).tolist()]
        try:  # transformers itself must build the model and generate with it before kvbridge is asked
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.inference_mode():
                model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)
        except (SweepTimeout, KVBridgeError):
            raise
        except Exception as e:  # noqa: BLE001 - transformers' own failure on its own config class
            raise Unbuildable(one_line(e)) from None
        with tempfile.TemporaryDirectory(prefix=f"kvbridge-{arch}-") as d:
            model.save_pretrained(d)
            spec_from_hf_config(Path(d), warn=False)  # what `kvbridge plan DIR` reads (an engine's view) must take it
            saved = spec_from_hf_config(Path(d) / "config.json", view="transformers", dtype="float32", warn=False)
            if saved.layers != spec.layers:
                raise ConfigError("the saved config.json reads as another geometry than the config it was saved from")
            for name, prefill, decode in PAIRS:
                try:
                    pre_check(spec, prefill, decode)
                except (IncompatibleEngines, ShardingError):
                    name, prefill, decode = FALLBACK_PAIR
                dump = Path(d) / "decode_cache.safetensors" if not row.pairs else None  # the first pair dumps
                result = run_demo(d, prompt_ids=prompt, new_tokens=NEW_TOKENS, seed=seed, prefill=prefill,
                                  decode=decode, dump_decode_cache=dump)
                if not result.ok:
                    row.status = "mismatch"
                    row.detail = (f"{name}: cache {'bit-exact' if result.cache_equal else 'differs'}, greedy tokens "
                                  f"{'match' if result.match else 'differ'}; " + "; ".join(result.cache_differences[:2]))
                    return row
                if dump is not None:
                    check_dump(dump, model, prompt)
                row.pairs.append(name)
        row.status = "moved"
    return row


def check_dump(path: Path, model: Any, prompt: list[int]) -> None:
    """The `--dump-decode-cache` file of a proof that passed: it reads back, holds every tensor of the
    cache a prefill leaves under `dump_names`, and each is bit-equal to it (the proof found the moved
    cache bit-exact, so the file must be too). Raises `RuntimeError` naming the first difference."""
    from safetensors.torch import load_file

    from kvbridge.proofs.cache_compare import _layer_tensors, as_bits, dump_names
    from kvbridge.proofs.proof import prefill

    dumped = load_file(str(path))
    model.eval()  # as the proof runs it (a model fresh from its config is in training mode: dropout)
    reference, _ = prefill(model, prompt)
    want = dump_names(reference)
    if sorted(dumped) != sorted(want):
        raise RuntimeError(f"the decode-cache dump holds {sorted(set(dumped) ^ set(want))[:4]} against the cache")
    for li, layer in enumerate(reference.layers):
        for name, t in _layer_tensors(layer).items():
            got = dumped.get(f"layers.{li}.{name}")
            if t is not None and (got is None or got.shape != t.shape or got.dtype != t.dtype
                                  or not bool((as_bits(got) == as_bits(t.cpu())).all())):
                raise RuntimeError(f"the decode-cache dump's layers.{li}.{name} differs from the cache")


def pre_check(spec: Any, prefill: EngineLayout, decode: EngineLayout) -> None:
    """Raise `IncompatibleEngines` when a layout cannot hold `spec` (units that do not split over its TP)."""
    for layout in (prefill, decode):
        layout.addressing(spec, 0)


def representatives() -> dict[str, str]:
    """One architecture per state kind: the bounded CI sample always runs these."""
    return {"full": "llama", "sliding": "mistral", "sliding+full": "gemma2", "mla": "deepseek_v3",
            "mamba1": "jamba", "mamba2": "bamba", "gdn": "qwen3_next", "short_conv": "lfm2", "mqa": "gpt_bigcode",
            "stateless": "nemotron_h", "attention+state": "falcon_h1", "mamba1_heads": "zamba",
            "kda": "kimi_linear", "indexer": "deepseek_v32", "lightning": "minimax", "cca": "zaya",
            "kv_conv": "inkling2_text", "mla+sliding": "dots3_note_text", "rwkv": "rwkv",
            "mlstm": "xlstm", "compressed": "deepseek_v4", "looped": "dory"}

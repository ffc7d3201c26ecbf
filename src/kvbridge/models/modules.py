"""Geometry from the modules transformers builds: what each layer's attention and mixer will cache.

A config field is what a config.json says; the module is what the model does with it. They part
ways when a config carries a field its architecture never reads (a `num_key_value_heads` copied
from a Llama config into a GPT-NeoX one, whose fused `query_key_value` keeps one KV head per query
head; a `kv_lora_rank` in a model with plain K/V; a sibling's `linear_*` sizes beside a Mamba2
mixer) or when the modeling code derives a size the config does not spell (MiMo-V2's sliding layers
keep twice the config's KV heads). So every head count, head width and state shape comes from the
modules, and config fields only where no module answers.

The whole causal-LM model is built for the text config on the `meta` device (no memory, no
weights: well under a second even for DeepSeek-V3's 61 layers), and its decoder layers are the
`ModuleList` with one entry per config layer. In each layer:

* attention (the first self-attention module: cross-attention is skipped): an MLA module
  (`kv_lora_rank` with its `kv_a_proj_with_mqa` / `kv_b_proj`) caches the latent and the rope part;
  otherwise the key and value projections' widths give the KV heads and dims: separate
  projections (`k_proj` / `v_proj`, BERT's `key` / `value`, CTRL's `Wk` / `Wv`, ...) over the
  module's head width, or a fused QKV projection (`query_key_value`, `c_attn`, `qkv_proj`,
  `Wqkv`, `W_pack`: query heads plus two sets of KV heads) or a fused KV projection (`kv_proj`);
  the query heads (a check: never fewer than KV heads) from the module's attribute, else the
  query projection over the key width, else the output projection over the width it reads (the
  value width with separate projections: MiMo-V2's values of 16 beside keys of 24);
  where the projections are modules of another shape (ZAYA's CCA), the KV heads and head width the
  attention module keeps as attributes;
* recurrent mixers, by the attributes their modules keep: a Mamba2 mixer (`num_heads`,
  `head_dim`, `n_groups`, `ssm_state_size`, `conv_kernel_size`), a gated delta net (`num_k_heads`,
  `num_v_heads`, `head_k_dim`, `head_v_dim`), Zamba's per-head Mamba1 (`n_mamba_heads`,
  `mamba_head_dim`), Mamba1 (`intermediate_size`, `ssm_state_size`), Kimi's delta attention
  (`num_heads`, `head_dim`, `conv_dim` of three), a short conv (its depthwise conv's channels),
  MiniMax's lightning attention (`num_attention_heads`, `head_dim`, no conv);
  the sizes are handed to `recurrent.py` under the names its rules read.

What each K/V layer *caches* is measured too, by one forward of the same model on meta
(`probe.py`), and `as_cached` weighs it against the projections (Falcon's new decoder architecture
caches each computed KV head once per query head). What nothing answers (a model transformers
cannot build or run on meta, a projection of another shape, a mixer with other attributes, state
kept outside any `Cache`) keeps the config's fields, as `config.py` reads them, except an
attention module with K/V projections no reading answers (`BuiltLayers.unreadable`): refused by
name where no forward measured it. `config.py` compares the fields with the modules and, where they
differ, plans with the module and writes one warning line naming the field and the module.

The same built layers say which sparse-attention layers keep an indexer key cache and how wide its
rows are (`module_indexer_dims`): the attention module's `indexer` writes it, or is None where the
layer reuses another layer's selection (HY-V4's and GLM-MoE-DSA's "shared" layers); its width is
the indexer's own head dim, whatever the config calls it.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from kvbridge.core.spec import LayerSpec

_HEAD_DIM = ("head_dim", "head_size", "attention_head_size", "dim_head", "d_head", "depth", "dim_per_head")
_Q_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attention_heads_per_partition")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_kv_heads")
_K = ("k_proj", "key", "key_proj", "Wk", "wk", "k_lin", "project_k")
_V = ("v_proj", "value", "value_proj", "Wv", "wv", "v_lin", "project_v")
_Q = ("q_proj", "query", "query_proj", "Wq", "wq", "q_lin", "project_q")
_O = ("o_proj", "dense", "out_proj", "c_proj", "wo", "Wo", "out_lin", "project_out", "o")
_QKV = ("query_key_value", "c_attn", "qkv_proj", "Wqkv", "W_pack", "qkv")
_SKIP = ("cross", "encoder_attn", "crossattention")


@dataclass(frozen=True)
class BuiltAttention:
    """What one layer's attention module caches: `mla` (latent `lora` + rope `rope`) or K/V."""

    module: str  # the module class, for messages
    mla: bool
    heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    lora: int = 0
    rope: int = 0
    q_heads: int = 0  # the query heads, where the module says (a check: never fewer than KV heads)


@dataclass(frozen=True)
class BuiltMixer:
    """A recurrent mixer's kind (as `recurrent.py` names it) and its sizes under `recurrent.py`'s names."""

    module: str
    kind: str
    sizes: dict[str, int] = field(default_factory=dict)


@dataclass
class BuiltLayers:
    """Per config layer index, what its modules cache (absent: no module answers)."""

    attention: dict[int, BuiltAttention] = field(default_factory=dict)
    mixers: dict[int, BuiltMixer] = field(default_factory=dict)
    layers: Any = None  # the decoder layers (a ModuleList), for the indexer
    # (KV heads, key width, value width) of the K/V the forward caches, measured on meta (`probe.py`);
    # `measured`: whether that forward ran (where it did not, nothing is known of what is cached)
    cached: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    measured: bool = False
    # layers with a self-attention module whose K/V projections no reading above answers: its class
    unreadable: dict[int, str] = field(default_factory=dict)


def _int(obj: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _width(proj: Any) -> int | None:
    """A projection's output width (nn.Linear, GPT-2's Conv1D, anything with a 2-d weight, or a
    wrapper around one: Moshi's and Inkling-2's projections keep theirs as `.linear`)."""
    for name in ("out_features", "nf"):
        value = _int(proj, name)
        if value:
            return value
    weight = getattr(proj, "weight", None)
    shape = getattr(weight, "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] > 0:
        return int(shape[0])
    inner = getattr(proj, "linear", None)
    return _width(inner) if inner is not None and inner is not proj else None


def _in_width(proj: Any) -> int | None:
    """A projection's input width (nn.Linear's in_features; GPT-2's Conv1D keeps [in, out] weights)."""
    value = _int(proj, "in_features")
    if value:
        return value
    shape = getattr(getattr(proj, "weight", None), "shape", None)
    if shape is None or len(shape) != 2:
        inner = getattr(proj, "linear", None)
        return _in_width(inner) if inner is not None and inner is not proj else None
    return int(shape[0]) if _int(proj, "nf") else int(shape[1])


def _child(module: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        child = getattr(module, name, None)
        if child is not None and _width(child):
            return child
    return None


def attention_geometry(module: Any) -> BuiltAttention | None:
    """What `module` caches if it is a self-attention module kvbridge can read, else None."""
    name = type(module).__name__
    lora = _int(module, "kv_lora_rank")
    if lora and any(hasattr(module, n) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "kv_a_proj")):
        rope = _int(module, "qk_rope_head_dim")
        return BuiltAttention(name, True, lora=lora, rope=rope) if rope else None
    k, v = _child(module, _K), _child(module, _V)
    qkv = None if k is not None else _child(module, _QKV)
    kv = None if k is not None or qkv is not None else _child(module, ("kv_proj",))
    if k is None and qkv is None and kv is None:
        # projections of another shape (ZAYA's CCA projection module): the KV heads and width the
        # attention module itself keeps, where it keeps both
        heads, head_dim = _int(module, *_KV_HEADS), _int(module, *_HEAD_DIM)
        q_heads = _int(module, *_Q_HEADS) or 0
        if heads and head_dim and any(hasattr(module, n) for n in _QKV + _O):
            return BuiltAttention(name, False, heads, head_dim, head_dim, q_heads=q_heads)
        return None
    q_heads = _int(module, *_Q_HEADS)
    head_dim = _int(module, *_HEAD_DIM)
    out, q = _child(module, _O), _child(module, _Q)
    if q_heads is None and head_dim and q is not None and _width(q) % head_dim == 0:
        q_heads = _width(q) // head_dim  # queries are as wide as keys
    if q_heads is None and head_dim and out is not None and k is None and _in_width(out) \
            and _in_width(out) % head_dim == 0:
        # a fused projection's query, key and value heads are of one width, which the output
        # projection reads once per query head (with separate projections it reads *value* heads,
        # which may be narrower: MiMo-V2's 16 against keys of 24)
        q_heads = _in_width(out) // head_dim
    if head_dim is None and q_heads:
        if q is not None and _width(q) % q_heads == 0:
            head_dim = _width(q) // q_heads
        elif _int(module, "embed_dim", "hidden_size", "all_head_size") and k is None:
            head_dim = _int(module, "embed_dim", "hidden_size", "all_head_size") // q_heads
    if not head_dim:
        return None
    if k is not None and v is not None:
        if _width(k) % head_dim:
            return None
        heads = _width(k) // head_dim
        if heads < 1 or _width(v) % heads:
            return None
        value_dim = _width(v) // heads
        if not q_heads and out is not None and _in_width(out) and _in_width(out) % value_dim == 0:
            q_heads = _in_width(out) // value_dim  # the output projection reads one value per query head
        return BuiltAttention(name, False, heads, head_dim, value_dim, q_heads=q_heads or 0)
    if kv is not None:  # fused K and V of equal widths
        heads, rest = divmod(_width(kv), 2 * head_dim)
        return BuiltAttention(name, False, heads, head_dim, head_dim, q_heads=q_heads or 0) if heads and not rest else None
    if not q_heads or qkv is None:
        return None
    total, rest = divmod(_width(qkv), head_dim)  # query heads + 2 x KV heads, of one width
    heads, odd = divmod(total - q_heads, 2)
    if rest or odd or heads < 1 or heads > q_heads:
        return None
    return BuiltAttention(name, False, heads, head_dim, head_dim, q_heads=q_heads)


def mixer_geometry(module: Any) -> BuiltMixer | None:
    """A recurrent mixer's kind and sizes from the attributes its module keeps, else None."""
    name = type(module).__name__
    kernel = _int(module, "conv_kernel_size")
    if kernel is None:
        heads, head_dim = _int(module, "num_attention_heads"), _int(module, "head_dim")
        if heads and head_dim and _int(module, "block_size") and hasattr(module, "output_gate"):
            # MiniMax's lightning attention: a decayed K^T V per head, no conv
            return BuiltMixer(name, "lightning", {"num_attention_heads": heads, "head_dim": head_dim})
        return None
    nk, nv, dk, dv = (_int(module, n) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    if nk and nv and dk and dv:
        return BuiltMixer(name, "gdn", {"linear_num_key_heads": nk, "linear_num_value_heads": nv,
                                        "linear_key_head_dim": dk, "linear_value_head_dim": dv,
                                        "linear_conv_kernel_dim": kernel})
    heads, head_dim, groups, d_state = (_int(module, n) for n in ("num_heads", "head_dim", "n_groups", "ssm_state_size"))
    if heads and head_dim and groups and d_state:
        return BuiltMixer(name, "mamba2", {"mamba_n_heads": heads, "mamba_d_head": head_dim, "mamba_n_groups": groups,
                                           "mamba_d_state": d_state, "mamba_d_conv": kernel})
    inter = _int(module, "intermediate_size")
    m_heads = _int(module, "n_mamba_heads")
    if m_heads and d_state and inter:
        return BuiltMixer(name, "mamba1_heads", {"n_mamba_heads": m_heads, "mamba_expand": 1, "hidden_size": inter,
                                                 "mamba_d_state": d_state, "mamba_d_conv": kernel})
    if inter and d_state and not heads:
        return BuiltMixer(name, "mamba1", {"intermediate_size": inter, "state_size": d_state, "conv_kernel": kernel})
    conv_dim = _int(module, "conv_dim")
    if heads and head_dim and conv_dim == 3 * heads * head_dim and not d_state:
        return BuiltMixer(name, "kda", {"linear_num_heads": heads, "linear_head_dim": head_dim,
                                        "linear_conv_kernel_dim": kernel})
    conv = getattr(module, "conv", None)
    channels = _int(conv, "in_channels")
    if channels and _int(conv, "groups") == channels and not (heads or inter or d_state):
        return BuiltMixer(name, "short_conv", {"hidden_size": channels, "conv_L_cache": kernel})  # LFM2's depthwise conv
    return None


def _decoder_layer_class(text: Any) -> Any:
    """The decoder layer class transformers names for `text` (`_no_split_modules` of its causal-LM
    class, else of its base model class), or None; importing it registers the modeling module's
    own cache layer classes (`compressed.py`)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING
    except Exception:  # noqa: BLE001 - no modeling code installed
        return None
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        try:
            model_cls = mapping[type(text)]
            names = list(getattr(model_cls, "_no_split_modules", None) or ())
            layer_cls = getattr(sys.modules[model_cls.__module__], names[0], None) if names else None
        except Exception:  # noqa: BLE001 - no such class for this config
            continue
        if layer_cls is not None:
            return layer_cls
    return None


def _build_model(text: Any) -> Any:
    """The causal-LM model (else the base model) of `text` on the meta device, or None."""
    import torch
    try:
        import transformers.utils.logging as hf_logging
        from transformers import AutoModel, AutoModelForCausalLM
    except Exception:  # noqa: BLE001 - no modeling code installed: the config's numbers stand
        return None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        for auto in (AutoModelForCausalLM, AutoModel):
            with contextlib.suppress(Exception), torch.device("meta"), open_stdout_quiet():
                return auto.from_config(text)
        return None
    finally:
        hf_logging.set_verbosity(verbosity)


@contextlib.contextmanager
def open_stdout_quiet() -> Any:
    """Some constructors print (a model's notice about an optional kernel); plan's stdout is its output."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _decoder_layers(model: Any, n: int) -> Any:
    """The model's ModuleList of `n` decoder layers (the first such list), or None."""
    import torch
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    return None


def _self_modules(layer: Any) -> Any:
    for name, module in layer.named_modules():
        if not any(s in name.lower() for s in _SKIP):
            yield module


def built_layers(text: Any, num_layers: int) -> BuiltLayers:
    """What each of the `num_layers` decoder layers transformers builds for `text` caches."""
    out = BuiltLayers()
    model = _build_model(text)
    layers = None if model is None else _decoder_layers(model, num_layers)
    if layers is None:
        if model is not None:  # no list of one module per cache layer (HRM's two stacks): one geometry for all
            _uniform(model, num_layers, out)
        return out
    out.layers = layers
    for i, layer in enumerate(layers):
        for module in _self_modules(layer):
            if i not in out.attention:
                geometry = attention_geometry(module)
                if geometry is not None:
                    out.attention[i] = geometry
                elif i not in out.unreadable and _has_kv_projections(module):
                    out.unreadable[i] = type(module).__name__
            if i not in out.mixers:
                mixer = mixer_geometry(module)
                if mixer is not None:
                    out.mixers[i] = mixer
        if i in out.attention:
            out.unreadable.pop(i, None)
    _measure(model, num_layers, out)  # last: it casts the model, whose attributes are read above
    return out


def _measure(model: Any, num_layers: int, out: BuiltLayers) -> None:
    from kvbridge.models.probe import cached_kv
    cached = cached_kv(model, num_layers)
    out.cached, out.measured = cached or {}, cached is not None


def _has_kv_projections(module: Any) -> bool:
    """Whether `module` holds key / value (or fused QKV / KV) projections of its own: an attention
    module kvbridge should be able to read."""
    return any(_width(getattr(module, n)) for n in (*_K, *_QKV, "kv_proj") if getattr(module, n, None) is not None)


def _uniform(model: Any, num_layers: int, out: BuiltLayers) -> None:
    """Where the modules do not map one to one onto the cache layers, what every self-attention
    module (and every mixer) of the model caches, if they all agree: then it is every layer's."""
    attention = {g for g in map(attention_geometry, _self_modules(model)) if g is not None}
    mixers = [m for m in map(mixer_geometry, _self_modules(model)) if m is not None]
    if len(attention) == 1:
        out.attention = dict.fromkeys(range(num_layers), attention.pop())
    if mixers and all(m == mixers[0] for m in mixers):
        out.mixers = dict.fromkeys(range(num_layers), mixers[0])
    _measure(model, num_layers, out)


def as_cached(built: BuiltAttention | None, cached: tuple[int, int, int] | None,
              name: str = "attention") -> tuple[BuiltAttention | None, int]:
    """What a K/V layer keeps: (the attention an engine keeps, the KV heads transformers' cache holds).

    `built` is what the layer's modules compute (`attention_geometry`), `cached` what its forward
    caches (`probe.cached_kv`; None: not measured). Measured K/V of the module's widths with a
    whole multiple of its KV heads is the module's heads, each cached that many times (Falcon's new
    decoder architecture broadcasts its KV heads over their query groups): engines keep the
    module's heads, transformers' cache the repeated ones. Any other measurement wins over the
    module (the forward is what transformers runs), and stands alone where no module answers.
    An MLA module is left to the module (transformers caches its latent and rope parts as K and V)."""
    if cached is None or (built is not None and built.mla):
        return built, built.heads if built is not None else 0
    heads, key_dim, value_dim = cached
    if built is not None and (built.key_dim, built.value_dim) == (key_dim, value_dim) and heads % built.heads == 0:
        return built, heads
    return BuiltAttention(built.module if built is not None else name, False, heads, key_dim, value_dim,
                          q_heads=built.q_heads if built is not None else 0), heads


def module_kv_geometry(text: Any, layer_types: tuple[str, ...]) -> dict[int, tuple[int, int, int]]:
    """{layer index: (kv_heads, key_dim, value_dim)} of the layers whose attention module keeps K/V."""
    built = built_layers(text, len(layer_types))
    return {i: (a.heads, a.key_dim, a.value_dim) for i, a in built.attention.items() if not a.mla}


def module_indexer_dims(text: Any, layer_types: tuple[str, ...], built: BuiltLayers | None = None) -> dict[int, int]:
    """{layer index: indexer key width, 0 for a layer whose attention has no indexer of its own}
    for each "indexed_attention" layer transformers builds; layers it cannot build (or that have
    no `indexer` attribute) are left out and keep the config's numbers."""
    built = built if built is not None else built_layers(text, len(layer_types))
    if built.layers is None:
        return {}
    out: dict[int, int] = {}
    for i, lt in enumerate(layer_types):
        if lt != "indexed_attention":
            continue
        dim = _indexer_dim(built.layers[i])
        if dim is not None:
            out[i] = dim
    return out


def _indexer_dim(layer: Any) -> int | None:
    for module in layer.modules():
        if not hasattr(module, "indexer"):
            continue
        indexer = module.indexer
        if indexer is None:
            return 0
        for key in ("index_head_dim", "head_dim"):
            dim = getattr(indexer, key, None)
            if isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
                return dim
        return None
    return None


def built_spec(built: BuiltAttention, mla_view: str, window: int | None, lt: str) -> LayerSpec:
    """The spec layer of what an attention module caches (`modules.attention_geometry`)."""
    if built.mla:
        if mla_view == "latent":
            return LayerSpec("mla", 1, built.lora + built.rope, window=window)
        return LayerSpec("mla", 1, built.lora, built.rope, window)
    return LayerSpec("full" if window is None else "sliding", built.heads, built.key_dim, built.value_dim, window)


def geometry_words(spec: LayerSpec, fields: dict[str, str]) -> str:
    """An attention layer's geometry in words, naming the config fields it came from (if any)."""
    def named(key: str) -> str:
        return f" ({fields[key]})" if key in fields else ""
    if spec.kind == "mla":
        return f"an MLA latent of {spec.key_dim}+{spec.value_dim or 0}{named('mla')}"
    dims = f"{spec.key_dim}" if spec.key_dim == spec.value_dim else f"{spec.key_dim}/{spec.value_dim}"
    return (f"{spec.num_kv_heads} KV heads{named('heads')} of {dims}{named('dim')}"
            + (f", values {spec.value_dim}{named('value')}" if "value" in fields and fields["value"] == "v_head_dim"
               and spec.value_dim != spec.key_dim else ""))


def state_words(spec: LayerSpec) -> str:
    """A recurrent layer's state in words: its kind and component shapes."""
    parts = " | ".join(f"{c.name} {c.heads}x{c.dim}" for c in spec.state)
    return f"a {spec.recurrent_type} state [{parts}]"


def span(layers: list[int]) -> str:
    """'layer 3', 'layers 0-3' or 'layers 0, 2, 5' (the first eight)."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")


def per_kind_says(layer: Any, fields: dict[str, str], spec: LayerSpec, module: LayerSpec) -> bool:
    """True when the config does say what the module caches, in a field kept per layer kind under a
    prefix of its own (Inkling's sliding layers: `swa_num_key_value_heads`): no conflict to name."""
    if spec.kind != module.kind or "heads" not in fields:
        return False
    values = layer.to_dict() if hasattr(layer, "to_dict") else {}
    for have, want, key in ((spec.num_kv_heads, module.num_kv_heads, fields["heads"]),
                            (spec.key_dim, module.key_dim, fields["dim"]), (spec.value_dim, module.value_dim, fields["value"])):
        if have != want and not any(k.endswith("_" + key) and v == want for k, v in values.items()):
            return False
    return True

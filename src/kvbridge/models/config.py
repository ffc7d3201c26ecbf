"""Model geometry from a Hugging Face `config.json`: the one place kvbridge reads configs.

The config goes through its own transformers config class (`CONFIG_MAPPING[model_type]`), so
defaults, derived fields, `layer_types`, `text_config` nesting and each architecture's own names
(`n_layer`, `num_layers`, `n_head`, ...: the class's `attribute_map`) are exactly what transformers
uses. Each layer's state kind is the cache layer class a `DynamicCache` builds for that config
(`transformers.cache_utils.get_layer_types_and_kwargs` and its `DYNAMIC_LAYER_TYPE_MAPPING`), not a
list of model types, so a new plain-attention architecture needs nothing here:

* `DynamicLayer` -> K/V per token ("full"), or an MLA latent when the config has `kv_lora_rank`;
* `DynamicSlidingWindowLayer` -> "sliding" (sliding and chunked attention: transformers keeps the
  last `window - 1` tokens for both, with `window` the chunk size for chunked attention), or an
  "mla" layer with that `window` when the config has `kv_lora_rank` (dots3's sliding MLA layers:
  the latent rows of the last `window - 1` tokens, vLLM's `SlidingWindowMLASpec`);
* `LinearAttentionLayer` -> "recurrent", geometry from `recurrent.py`;
* `DummyLayer` -> "stateless": the layer stores nothing (an MLP / MoE block of a hybrid stack such
  as Nemotron-H, or a layer reading another layer's K/V); it keeps its index and moves nothing;
* `LinearAttentionAnd{Full,SlidingWindow}AttentionLayer` ("hybrid", "hybrid_sliding": Zamba2's
  shared-attention layers, Falcon-H1, ZAYA's convolutional attention, Inkling's K/V convs) -> two
  logical layers, the attention part then the recurrent part, as vLLM registers them (one attention
  and one Mamba cache layer per decoder layer). The transformers bridge maps both back to the one
  cache layer by its class. The recurrent part may depend on the attention part (Inkling convolves
  each KV head's keys and values) and on the conv states transformers gives the layer
  (`number_of_states`);
* `DynamicIndexedLayer` ("indexed_attention": DeepSeek-V3.2, GLM-MoE-DSA) -> the attention layer,
  then its sparse-attention indexer key cache as a layer of its own: one `index_head_dim` row per
  token that every TP rank holds whole, which is what vLLM allocates for it (`DeepseekV32IndexerCache`:
  an `MLAAttentionSpec` with one KV head), so it is an "mla" layer. Whether a layer has an indexer
  and its key width come from the decoder layer transformers builds (`modules.module_indexer_dims`):
  a layer that reuses another layer's selection (HY-V4's "shared" `indexer_types`) never writes
  indexer keys and is its attention layer alone;
* a compressed cache layer (DeepSeek-V4's "heavily_compressed_attention" and
  "compressed_sparse_attention") -> its K=V window as a sliding "mla" layer, one "mla" layer per
  compressor keeping one row per `compress_rate` tokens (`tokens_per_row`), then a "recurrent"
  layer ("compressed") of the open window's raw rows, gates and overlaps, all read from the cache
  layer transformers builds (`compressed.py`);
* anything else: refused with one line naming the layer and its kind;
* a model whose recurrent state is in no transformers `Cache` at all (RWKV, xLSTM: transformers
  would lay them out as attention): RWKV's `state` list and xLSTM's `xLSTMCache` make every layer
  recurrent (`own_state.py`; geometry in `recurrent.py`, from the config class, including sizes it
  derives in properties such as xLSTM's rounded `qk_head_dim`); any other is refused before any
  layer is read, naming the state and its per-layer shapes;
* a looped model keeping K/V per loop (Dory's `recurrent_kv_cache_mode="per_loop"`): the spec
  appends the copies of the looped layers that its forward appends to the cache (`looped.py`);
* a model with no cache of its own: every layer a `DummyLayer` (a draft model whose layers all
  read its target's K/V, Gemma-4's assistants), or a class whose forward takes no cache or keeps
  `mems` / LSH buckets instead of K/V (GPT-1, XLNet, Reformer: `no_cache.py`), is refused in one
  line after its layers are read.

Head counts, head widths and state shapes come from the modules transformers builds for the config
(the whole model on the meta device, `modules.py`): each attention module's key / value projections
(or MLA latent), each recurrent mixer's sizes; and what each K/V layer caches from one forward of
that model on meta where it runs there (`probe.py`), which wins over the projections: where the
forward caches each computed KV head several times (Falcon's new decoder architecture), an engine
keeps the computed heads and the transformers view the cached ones, named in one warning line. The
config's fields, read as below, are the fallback where nothing answers (no module, no forward on
meta); an attention module with K/V projections kvbridge cannot read and no forward to measure is
refused by name. Fields are compared with the modules everywhere else: a field the architecture
ignores (a sibling's `num_key_value_heads`, `kv_lora_rank` or `linear_*` sizes copied into
config.json) or a size the modeling code derives (MiMo-V2's doubled sliding KV heads) is planned as
the module builds it, with one warning line naming the fields and the module. A recurrent mixer's
kind is named by signal fields of the config's own class only (`recurrent.without_stray_signals`).

The config is untrusted (`untrusted.py` checks it first). A cache-sizing field that config.json
omits and transformers fills from its class default (attention and recurrent sizes alike: a gated
delta net without its `linear_*` sizes plans on the flagship's) is named on stderr, in one line.

Length: about 520 lines, one reading (config class -> cache layer types -> a spec layer per kind,
each kind's fallback and refusal beside its rule); the module and forward readings live apart.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError
from kvbridge.models.compressed import COMPRESSED_TYPES, compressed_layers
from kvbridge.models.modules import (BuiltAttention, BuiltMixer, as_cached, built_spec, geometry_words, per_kind_says,
                                     span, state_words)
from kvbridge.models.untrusted import _NESTED, error_line, load_config, safe_text

# The cache layer classes transformers builds, by the layer-type name `get_layer_types_and_kwargs`
# gives; the kind each is to kvbridge, and for refused ones, what it holds (for the refusal line).
_ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# attention K/V and recurrent state in one cache layer: described as the attention part, then the recurrent part
_HYBRID_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
# Layer types that older transformers (5.19, which vLLM 0.32 pins) mapped to an empty
# LinearAttentionLayer and newer ones to DummyLayer: an MLP / MoE block of a hybrid stack stores
# nothing whichever class holds its place.
_STATELESS_TYPES = ("dummy", "mlp", "moe")


def spec_from_hf_config(config: dict[str, Any] | str | Path, *, dtype: str | None = None,
                        mla_view: Literal["latent", "heads"] = "latent",
                        view: Literal["engine", "transformers"] = "engine",
                        state_dtype: str | None = None, warn: bool = True) -> ModelSpec:
    """Geometry from a Hugging Face `config.json` (dict, file or model directory).

    `view="engine"` describes the cache as serving engines (vLLM) hold it: MLA as one latent
    row (kv_lora_rank + rope dims), conv states with `kernel - 1` columns. `view="transformers"`
    as `transformers` >= 5 holds it: MLA as two replicated single-head tensors (the normalized
    latent and the rotated rope part), conv states with `kernel` columns.
    `mla_view="heads"` alone selects the transformers view of MLA. `state_dtype` is the SSM /
    recurrent state dtype when it differs from the KV dtype (vLLM's mamba_ssm_cache_dtype).

    Warnings (`warn`), one line each on stderr, each once per process for a config.json file: sizes
    config.json leaves to the config class's defaults, and layers whose modules cache another
    geometry than the config's fields describe (planned with the module's).
    """
    if view == "transformers":
        mla_view = "heads"
    raw = load_config(config)
    obj = hf_config(raw)
    try:
        text = obj.get_text_config(decoder=True)
    except Exception as e:  # noqa: BLE001 - a nesting transformers cannot resolve
        raise ConfigError(f"config of {raw.get('model_type')!r} has no usable text config: "
                          f"{safe_text(str(e).splitlines()[0] if str(e) else type(e).__name__)}") from None
    if not hasattr(text, "model_type"):
        raise ConfigError(f"config of {raw.get('model_type')!r}: its text config is a {type(text).__name__}")
    raw_text = next((raw[k] for k in _NESTED if isinstance(raw.get(k), dict)), raw)
    reader = _Reader(text, raw_text)
    arch = str(getattr(text, "model_type", "") or raw.get("model_type"))
    name = safe_text(raw.get("_name_or_path") or raw_text.get("_name_or_path") or arch or "model")
    dtype = normalize_dtype(dtype or raw.get("torch_dtype") or raw.get("dtype") or raw_text.get("torch_dtype")
                            or raw_text.get("dtype") or "bfloat16")
    try:
        # the modules are built from the config itself where it is the text model's own (a
        # derived text config can differ: Blenderbot's keeps the class's 24 decoder layers)
        layers = _layers(text, reader, raw_text, arch, mla_view, view, state_dtype,
                         obj if type(obj) is type(text) else text)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted input never ends in a traceback
        raise ConfigError(f"config of {arch!r}: transformers' {type(text).__name__} cannot be read as a cache "
                          f"geometry: {error_line(e)}") from None
    if all(layer.is_stateless for layer in layers):
        raise ConfigError(_no_cache_of_its_own(text, arch, len(layers)))
    from kvbridge.models.no_cache import no_kv_cache_refusal
    refusal = no_kv_cache_refusal(obj)  # after the layers: a draft model's shared layers say more
    if refusal:
        raise ConfigError(refusal)
    if warn:
        lines = reader.conflict_lines()
        if reader.filled:
            lines.insert(0, f"config.json omits {', '.join(reader.filled)}; using transformers' "
                            f"{type(text).__name__} defaults")
        source = None
        if isinstance(config, (str, Path)):  # a model directory and its config.json are one source
            path = Path(config)
            source = str((path / "config.json" if path.is_dir() else path).resolve())
        for line in lines:
            _warn(f"warning: {name}: {line}", source)
    return ModelSpec(layers, dtype, name)


_WARNED: set[tuple[str, str]] = set()


def _warn(line: str, source: str | None) -> None:
    """One warning line on stderr; about a config.json file (`source`), once per process and file
    (a demo reads the same file several times: its checks, then its model)."""
    if source is None or (source, line) not in _WARNED:
        if source is not None:
            _WARNED.add((source, line))
        sys.stderr.write(line + "\n")


def hf_config(raw: dict[str, Any]) -> Any:
    """The transformers config object for a checked config dict (one line on any failure)."""
    from transformers import CONFIG_MAPPING

    arch = raw.get("model_type")
    if not arch:
        raise ConfigError("config has no model_type; kvbridge reads configs through transformers' config classes")
    if not isinstance(arch, str) or arch not in CONFIG_MAPPING:
        import transformers
        raise ConfigError(f"model_type {safe_text(repr(arch))} has no config class in the installed transformers "
                          f"{transformers.__version__}")
    _check_layer_types(raw)
    for key in _NESTED:
        if isinstance(raw.get(key), dict):
            _check_layer_types(raw[key])
    try:
        import transformers.utils.logging as hf_logging
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            # kvbridge reads the dtype itself (transformers would resolve a "torch.float16" spelling as an attribute)
            return CONFIG_MAPPING[arch](**{k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype", "dtype")})
        finally:
            hf_logging.set_verbosity(verbosity)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers rejects the config: its reason, on one line
        msg = str(e).strip().splitlines()
        raise ConfigError(f"transformers' {CONFIG_MAPPING[arch].__name__} rejects this config: "
                          f"{safe_text(msg[-1] if msg else type(e).__name__)}") from None


def _layer_pattern_length(raw: dict[str, Any]) -> int | None:
    """The layer count a config.json spells as a per-layer pattern instead (Nemotron-H's
    `layers_block_type` or `hybrid_override_pattern`, a `layer_types` list): transformers derives
    `num_hidden_layers` from it, so it is not a default filled in behind the user's back."""
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        value = raw.get(key)
        if isinstance(value, (list, str)) and value:
            return len(value)
    return None


def _global(config: Any, key: str, ambiguous: Any) -> Any:
    """A config attribute, or `ambiguous` where a heterogeneous config keeps it per layer only."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError
        return ambiguous


def _check_layer_types(raw: dict[str, Any]) -> None:
    types, n = raw.get("layer_types"), raw.get("num_hidden_layers")
    if types is not None and n is not None and len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")


@functools.lru_cache(maxsize=64)
def _class_default_of(cls: type) -> Any:
    try:
        return cls()
    except Exception:  # noqa: BLE001 - classes whose defaults fail their own validation
        return None


def _class_default(text: Any) -> Any:
    """The architecture's config class with its own defaults (None when it cannot be built bare)."""
    return _class_default_of(type(text))


class _Reader:
    """Reads geometry fields from a transformers config, noting those config.json left to defaults."""

    def __init__(self, text: Any, raw: dict[str, Any]) -> None:
        self.text, self.raw = text, raw
        # attribute_map: the standard name -> the architecture's own (num_hidden_layers -> n_layer)
        self.own_name = dict(getattr(text, "attribute_map", {}) or {})
        self.filled: list[str] = []
        # (what the fields say, the module, what it caches) -> the layers where they differ
        self.conflicts: dict[tuple[str, str, str, str], list[int]] = {}
        # (layer type, module, KV heads computed, heads cached) -> the layers transformers caches repeated
        self.repeats: dict[tuple[str, str, int, int], list[int]] = {}

    def conflict(self, i: int, lt: str, fields: str, module: str, built: str) -> None:
        """Layer `i`'s config fields describe `fields`, transformers' `module` caches `built`."""
        self.conflicts.setdefault((lt, fields, module, built), []).append(i)

    def conflict_lines(self) -> list[str]:
        return [f"{span(layers)} ({lt}): the config's fields give {fields}, but transformers' {module} caches "
                f"{built}; planning with the module's" for (lt, fields, module, built), layers in self.conflicts.items()] + [
            f"{span(layers)} ({lt}): transformers' {module} computes {heads} KV heads and caches each {cached // heads} "
            f"times ({cached} heads); an engine keeps the {heads}, transformers' cache (the proof's view) the {cached}"
            for (lt, module, heads, cached), layers in self.repeats.items()]

    def read(self, key: str, value: Any) -> None:
        """A recurrent rule read `key` from the config (with its class defaults): noted as filled
        when config.json omits it and the value is the class default (not derived from other fields)."""
        if key in self.filled or self.given(key) or value is None:
            return
        default = getattr(_class_default(self.text), key, None)
        if default is not None and default == value:
            self.filled.append(key)

    def given(self, key: str) -> bool:
        return any(self.raw.get(k) is not None for k in (key, self.own_name.get(key)) if k)

    def get(self, layer: Any, key: str, derived: Any = None) -> Any:
        """`key` of a (per-layer) config; absent from config.json and not derived -> noted as filled."""
        value = getattr(layer, key, None)
        if value is not None and not self.given(key) and value != derived and key not in self.filled:
            self.filled.append(key)
        return value

    def int(self, layer: Any, key: str, derived: Any = None) -> int:
        value = self.get(layer, key, derived)
        if value is None and not self.given(key) and getattr(_class_default(self.text), key, None) is None:
            # not a malformed config: the architecture has no such size (BLT has no single decoder
            # stack), so transformers' cache layout does not describe it
            subs = [k for k, v in vars(self.text).items() if k.endswith("_config") and hasattr(v, "to_dict")]
            why = (f"layer 0: its layers are split over sub-models ({', '.join(subs) or 'no single stack'}), and "
                   f"transformers' DynamicCache(config) cannot lay out one cache for them (it needs "
                   f"num_hidden_layers), so it exposes no cache to move" if key == "num_hidden_layers" else
                   "transformers lays the layer out as attention, but its mixer keeps a state of its own that "
                   "kvbridge does not know")
            raise ConfigError(f"config of {self.text.model_type!r}: {type(self.text).__name__} has no {key}, not even "
                              f"as a default; {why}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config of {self.text.model_type!r}: {key} must be a positive integer, got "
                              f"{safe_text(repr(value))}")
        return value


def _layers(text: Any, reader: _Reader, raw: dict[str, Any], arch: str, mla_view: str, view: str,
            state_dtype: str | None, model_config: Any = None) -> tuple[LayerSpec, ...]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    num_layers = reader.int(text, "num_hidden_layers", _layer_pattern_length(raw))
    state_list = False
    if _global(text, "num_attention_heads", True) is None:
        # no attention heads at all, yet no layer_types: RWKV, xLSTM keep a recurrent state in no Cache
        # (see own_state); models with heads but no cache of their own are refused after the layers (no_cache)
        from kvbridge.models.own_state import moved_outside_cache, outside_cache_refusal
        state_list = moved_outside_cache(text)
        refusal = None if state_list else outside_cache_refusal(text, num_layers)
        if refusal:
            raise ConfigError(refusal)
    try:
        types, kwargs = get_layer_types_and_kwargs(text)
        if state_list:  # every layer is the recurrent mixer that transformers lays out as attention
            types, kwargs = ["linear_attention"] * num_layers, [{} for _ in range(num_layers)]
    except Exception as e:  # noqa: BLE001 - a config transformers cannot lay out
        raise ConfigError(f"config of {arch!r}: transformers cannot derive its cache layers: "
                          f"{safe_text(str(e).splitlines()[0] if str(e) else type(e).__name__)}") from None
    types = list(types)
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    per_layer = text.per_layer_config
    # what the modules transformers builds cache, layer by layer (`modules.py`): they win over fields
    from kvbridge.models.looped import loop_copies
    # a per-loop cache appends copies of the looped layers (`looped.py`); its bounds are checked
    # before the modules are built and run (a forward on meta runs every loop)
    copies = loop_copies(text, num_layers)
    from kvbridge.models.modules import BuiltLayers, built_layers, module_indexer_dims
    built = BuiltLayers() if state_list else built_layers(model_config or text, num_layers)
    indexers: dict[int, int] = {}
    if "indexed_attention" in types:
        indexers = module_indexer_dims(text, tuple(types), built)
    out: list[LayerSpec] = []
    # recurrent geometries derived so far, by what they depend on besides the config: the attention
    # part of the same cache layer (Inkling's K/V convs) and the number of conv states
    recurrent: dict[Any, LayerSpec] = {}
    spans: list[tuple[int, int]] = []  # the spec layers of each config layer
    for i, (lt, kw) in enumerate(zip(types, kwargs)):
        first = len(out)
        # what the forward caches, and an attention module nothing reads where that forward did not run
        seen = (built.cached.get(i), None if built.measured else built.unreadable.get(i))
        try:
            parts = (_HYBRID_TYPES[lt], "linear_attention") if lt in _HYBRID_TYPES else (lt,)
            if lt == "indexed_attention":  # the attention, then its indexer key cache (see the module doc)
                out.append(_layer(text, reader, per_layer[i], "full_attention", kw, i, mla_view, view, state_dtype,
                                  recurrent, built.attention.get(i), seen=seen))
                parts = ()
                # the indexer transformers builds (none: the layer reuses another's selection, no keys of its own)
                dim = indexers[i] if i in indexers else reader.int(per_layer[i], "index_head_dim")
                if dim:
                    out.append(LayerSpec("mla", 1, dim))
            if lt in COMPRESSED_TYPES:  # window, compressed rows, open window (see the module doc)
                out += compressed_layers(text, per_layer[i], lt, kw, reader.int)
                parts = ()
            for part in parts:
                attention = out[-1] if part == "linear_attention" and len(parts) == 2 else None
                out.append(_layer(text, reader, per_layer[i], part, kw, i, mla_view, view, state_dtype, recurrent,
                                  built.attention.get(i), lt, attention, built.mixers.get(i),
                                  seen))
        except ConfigError as e:  # every refusal names the layer and its kind
            if str(e).startswith("layer "):
                raise
            raise ConfigError(f"layer {i} ({lt}): {e}") from None
        spans.append((first, len(out)))
    if copies is not None:
        looped, extra = copies
        out += [layer for _ in range(extra) for i in looped for layer in out[spans[i][0]:spans[i][1]]]
    return tuple(out)


def _layer(text: Any, reader: _Reader, layer: Any, lt: str, kw: dict[str, Any], i: int, mla_view: str, view: str,
           state_dtype: str | None, previous: dict[Any, LayerSpec], built: BuiltAttention | None,
           shown: str = "", attention: LayerSpec | None = None, mixer: BuiltMixer | None = None,
           seen: tuple[tuple[int, int, int] | None, str | None] = (None, None)) -> LayerSpec:
    """One spec layer for transformers layer type `lt` (`shown`: the type to name in a refusal, when
    `lt` is one part of it; `attention`: the attention part when `lt` is the recurrent part;
    `built` / `mixer`: what the attention / mixer module transformers builds computes, which wins
    over the config's fields, a difference noted by `reader.conflict`; `seen`: the K/V its forward
    caches as measured on meta (`probe.py`), and the attention module whose projections could not
    be read, if any)."""
    if lt in _ATTENTION_TYPES:
        window = None
        if lt != "full_attention":
            window = kw.get("sliding_window")
            if window is None:
                raise ConfigError(f"layer {i} is {lt} but config has no "
                                  f"{'sliding_window' if lt == 'sliding_attention' else 'attention_chunk_size'}")
            if isinstance(window, bool) or not isinstance(window, int) or window < 2:
                raise ConfigError(f"layer {i} is {lt} with window {safe_text(repr(window))}; needs an integer >= 2")
        cached, unreadable = seen
        if built is None and getattr(layer, "kv_lora_rank", None):
            cached = None  # an MLA cache read by fields: its K and V are the latent and rope parts
        built, cached_heads = as_cached(built, cached, unreadable or "attention")
        if built is None and unreadable:  # K/V projections no reading answers, and nothing measured
            raise ConfigError(f"layer {i} ({shown or lt}): the K/V heads of transformers' {unreadable} cannot be "
                              "read from its projections, and its forward does not run on the meta device to measure "
                              "its cache; kvbridge refuses rather than plan the config's fields")
        if built is None:  # no module answers: the config's fields (the documented fallback)
            return _attention_layer(layer, reader, mla_view, window, i)[0]
        if cached is None and not built.mla and built.heads > (built.q_heads or built.heads):
            raise ConfigError(f"layer {i}: {built.heads} KV heads but only {built.q_heads} query heads "
                              f"(transformers' {built.module})")
        module = built_spec(built, mla_view, window, lt)
        if cached_heads != built.heads:  # transformers caches each KV head several times (`as_cached`)
            reader.repeats.setdefault((shown or lt, built.module, built.heads, cached_heads), []).append(i)
        try:
            spec, fields = _attention_layer(layer, reader, mla_view, window, i)
        except ConfigError:  # the fields cannot even be read: the module says what is cached
            spec = fields = None
        if spec is not None and spec != module and not per_kind_says(layer, fields, spec, module):
            reader.conflict(i, shown or lt, geometry_words(spec, fields), built.module, geometry_words(module, {}))
        if view == "transformers" and cached_heads != built.heads:
            module = msgspec.structs.replace(module, num_kv_heads=cached_heads)
        return module
    if lt in ("linear_attention", "conv"):
        states = kw.get("number_of_states", 1)
        key = (attention, states, None if mixer is None else (mixer.kind, tuple(sorted(mixer.sizes.items()))))
        if key not in previous:
            from kvbridge.models.recurrent import recurrent_layer, without_stray_signals
            rows_extra = -1 if view == "engine" else 0
            try:
                spec = recurrent_layer(without_stray_signals(_with_derived(text), text), rows_extra, state_dtype, i, shown or lt, attention, states,
                                       reads=reader.read)
                err = None
            except ConfigError as e:
                spec, err = None, e
            if mixer is not None:
                module = recurrent_layer(dict(mixer.sizes), rows_extra, state_dtype, i, shown or lt, attention,
                                         states, kind=mixer.kind)
                if spec is not None and spec != module:
                    reader.conflict(i, shown or lt, state_words(spec), mixer.module, state_words(module))
                spec = module
            elif err is not None:
                raise err
            previous[key] = spec
        return previous[key]
    if lt in _STATELESS_TYPES:  # transformers' DummyLayer (or an old name for it) stores no cache for this layer
        return LayerSpec("stateless")
    raise ConfigError(f"layer {i} has type {lt!r} (a cache layer kvbridge does not know); kvbridge cannot move it yet")


def _no_cache_of_its_own(text: Any, arch: str, n: int) -> str:
    """Why a model whose every layer transformers lays out as `DummyLayer` has nothing to move."""
    shared = getattr(text, "num_kv_shared_layers", None)
    span = "layer 0" if n == 1 else f"layers 0-{n - 1}"
    if isinstance(shared, int) and not isinstance(shared, bool) and shared >= n:
        return (f"{span} of {arch!r} all read another model's K/V (num_kv_shared_layers {shared} of "
                f"{n} layers: a draft model reading its target's cache): transformers gives it no cache "
                "of its own, so there is nothing to move")
    return f"{span} of {arch!r} keep no cache (transformers lays every one out as a DummyLayer): nothing to move"


def _with_derived(text: Any) -> dict[str, Any]:
    """The config's fields plus the sizes its class derives in properties of its own, which
    `to_dict()` leaves out (xLSTM's `qk_head_dim` / `v_head_dim`, rounded up as its cache is sized);
    a field the dict has wins, and a property that cannot be read is left out."""
    out = text.to_dict()
    for cls in type(text).__mro__:
        if not cls.__module__.startswith("transformers.models."):  # PretrainedConfig's own properties are no sizes
            continue
        for name, value in vars(cls).items():
            if isinstance(value, property) and name not in out:
                with contextlib.suppress(Exception):  # a property of another configuration state: left out
                    out[name] = getattr(text, name)
    return out


def _attention_layer(layer: Any, reader: _Reader, mla_view: str, window: int | None,
                     i: int) -> tuple[LayerSpec, dict[str, str]]:
    """The attention layer the config's fields describe, and the field each size came from."""
    kv_lora = getattr(layer, "kv_lora_rank", None)
    if kv_lora:  # with a window: the same rows for the last window - 1 tokens (vLLM's SlidingWindowMLASpec)
        lora = reader.int(layer, "kv_lora_rank")
        rope = reader.int(layer, "qk_rope_head_dim")
        fields = {"mla": "kv_lora_rank", "rope": "qk_rope_head_dim"}
        if mla_view == "latent":
            return LayerSpec("mla", 1, lora + rope, window=window), fields
        return LayerSpec("mla", 1, lora, rope, window), fields
    q_heads = reader.int(layer, "num_attention_heads")
    kv_heads, heads_field = _kv_heads(layer, reader, q_heads)
    if kv_heads > q_heads:
        raise ConfigError(f"layer {i}: {kv_heads} KV heads but only {q_heads} query heads")
    hidden = getattr(layer, "hidden_size", None)
    derived = hidden // q_heads if isinstance(hidden, int) and not isinstance(hidden, bool) else None
    dim_field = "head_dim"
    head_dim = reader.get(layer, "head_dim", derived)
    for spelling in ("dim_head", "attention_head_dim"):  # CPM-Ant's, Zamba's spelling
        if head_dim is None and getattr(layer, spelling, None) is not None:
            head_dim, dim_field = reader.get(layer, spelling, derived), spelling
    if head_dim is None:
        head_dim, dim_field = reader.int(layer, "hidden_size") // q_heads, "hidden_size / num_attention_heads"
        if head_dim < 1:
            raise ConfigError(f"layer {i}: hidden_size {hidden} is smaller than {q_heads} heads")
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ConfigError(f"layer {i}: head_dim must be a positive integer, got {safe_text(repr(head_dim))}")
    value_dim, value_field = head_dim, dim_field
    if getattr(layer, "v_head_dim", None) is not None:  # values narrower or wider than keys (MiMo-V2)
        value_dim, value_field = reader.int(layer, "v_head_dim", head_dim), "v_head_dim"
    kind = "full" if window is None else "sliding"
    return (LayerSpec(kind, kv_heads, head_dim, value_dim, window),
            {"heads": heads_field, "dim": dim_field, "value": value_field})


def _kv_heads(layer: Any, reader: _Reader, q_heads: int) -> tuple[int, str]:
    """KV heads as the architecture spells them, and the field: Falcon's `num_kv_heads` under its
    new decoder architecture, else `multi_query` (one KV head, GPT-BigCode / Falcon), else
    num_key_value_heads (or its attribute_map alias), else one per query head."""
    if getattr(layer, "new_decoder_architecture", False) is True and getattr(layer, "num_kv_heads", None):
        return reader.int(layer, "num_kv_heads", q_heads), "num_kv_heads"
    if getattr(layer, "multi_query", False) is True:
        return 1, "multi_query"
    for key in ("num_key_value_heads", "num_kv_heads"):
        if getattr(layer, key, None) is not None:
            return reader.int(layer, key, q_heads), key
    return q_heads, "num_attention_heads"

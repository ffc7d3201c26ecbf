"""Model KV-cache geometry: what state a model keeps per token, independent of any engine.

A `ModelSpec` lists every layer's attention state as *components* (K and V, or one MLA latent),
each with a head count and a per-head row width. Engines shard heads over TP ranks and lay
the rows out in blocks; both of those live elsewhere (`shard`, `layout`). Layers that share a
block table form a *group* (full attention, each sliding window, MLA) and a request carries one
block-id list per group, as vLLM's hybrid allocator does. A *stateless* layer (an MLP or MoE
block in a hybrid stack, or a layer that reads another layer's K/V) keeps no cache: it has no
components, belongs to no group and gets no memory region, yet keeps its index so that layer
numbers (and pipeline stages) stay those of the model.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Literal

import msgspec

from kvbridge.errors import ConfigError, IncompatibleEngines

LayerKind = Literal["full", "sliding", "mla", "recurrent", "stateless"]
RecurrentType = Literal["", "mamba1", "mamba1_heads", "mamba2", "gdn", "kda", "short_conv", "lightning", "rglru", "cca",
                        "kv_conv", "rwkv", "mlstm", "compressed"]

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def normalize_dtype(name: str) -> str:
    """Return the canonical dtype name (torch's spelling) or raise naming the choices."""
    key = str(name).removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_SIZES:
        raise ConfigError(f"unsupported KV dtype {name!r}; choose one of {', '.join(DTYPE_SIZES)}")
    return key


class Component(msgspec.Struct, frozen=True):
    """One tensor of a layer's state: `heads` units of `dim` elements, sharded over TP by unit.

    Attention: K, V (per token, units are KV heads) or an MLA latent (one unit, replicated).
    Recurrent state (per request): each conv segment and the SSM state is its own component, so
    each is sharded on its own — a Mamba2 conv state is x (units: heads), B and C (units: groups,
    replicated when TP exceeds them); never the flat concatenation.
    """

    name: str  # "k", "v", "latent", "conv_x", "conv_b", "ssm", ...
    heads: int
    dim: int
    dtype: str | None = None  # None: the model's KV dtype


class LayerSpec(msgspec.Struct, frozen=True):
    """State of one layer.

    `window` is the sliding window in tokens (query i sees keys j with i - j < window), so a
    sliding layer keeps only its last `window - 1` tokens, as vLLM and transformers do.
    MLA keeps one latent row per token that every TP rank holds whole; an MLA layer with a
    `window` (vLLM's `SlidingWindowMLASpec`) keeps those rows for its last `window - 1` tokens
    only. Which tokens a layer keeps follows `window` alone, its rows follow `kind`. A recurrent layer
    (Mamba, gated delta net, short conv) keeps one state per request: its `state` components.
    A stateless layer keeps nothing (transformers gives it a `DummyLayer`, vLLM no cache at all).
    """

    kind: LayerKind
    num_kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    window: int | None = None
    state: tuple[Component, ...] = ()
    recurrent_type: RecurrentType = ""
    conv_rows: int = 0  # values per conv channel kept in the state (kernel - 1, or kernel)
    # How many conv components each of the layer's conv states holds, in state order, when it keeps
    # more than one (Inkling: a K conv, a V conv and two residual-stream convs, each its own tensor);
    # empty: one conv state, the concatenation of all conv components (Mamba2 [x | B | C]).
    conv_states: tuple[int, ...] = ()
    # Tokens per row of an MLA-like layer that keeps one row per `tokens_per_row` tokens of complete
    # windows only (DeepSeek-V4's compressed caches; vLLM's `tokens_per_state`): a block of
    # `block_size` tokens holds `block_size // tokens_per_row` rows. 1: one row per token.
    tokens_per_row: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("full", "sliding", "mla", "recurrent", "stateless"):
            raise ConfigError(f"unknown layer kind {self.kind!r}")
        if isinstance(self.tokens_per_row, bool) or not isinstance(self.tokens_per_row, int) or self.tokens_per_row < 1:
            raise ConfigError(f"tokens_per_row must be a positive integer, got {self.tokens_per_row!r}")
        if self.tokens_per_row > 1 and (self.kind != "mla" or self.window is not None):
            raise ConfigError(f"only an MLA layer without a window keeps one row per {self.tokens_per_row} tokens "
                              f"(kind {self.kind!r}, window {self.window})")
        if self.kind == "stateless":
            if (self.state or self.num_kv_heads or self.key_dim or self.value_dim or self.window
                    or self.recurrent_type or self.conv_rows or self.conv_states):
                raise ConfigError("a stateless layer has no KV heads, dims, window or state components")
            return
        if self.kind == "recurrent":
            if not self.state or self.num_kv_heads or self.key_dim or self.value_dim or self.window:
                raise ConfigError("a recurrent layer has state components and no KV heads, dims or window")
            for c in self.state:
                if c.heads < 1 or c.dim < 1:
                    raise ConfigError(f"state component {c.name!r} needs units and dim >= 1, got {c.heads}, {c.dim}")
                if c.dtype is not None:
                    normalize_dtype(c.dtype)
            convs = sum(c.name.startswith("conv") for c in self.state)
            if self.conv_states and (min(self.conv_states) < 1 or sum(self.conv_states) != convs):
                raise ConfigError(f"conv states of {self.conv_states} components do not cover the {convs} conv "
                                  f"components")
            return
        if self.state or self.conv_states:
            raise ConfigError(f"only recurrent layers have state components (kind {self.kind!r})")
        if self.num_kv_heads < 1 or self.key_dim < 1:
            raise ConfigError(f"layer needs >= 1 KV head and key_dim >= 1, got {self.num_kv_heads}, {self.key_dim}")
        if self.kind == "sliding" and (self.window is None or self.window < 2):
            raise ConfigError(f"a sliding layer needs window >= 2, got {self.window}")
        if self.kind not in ("sliding", "mla") and self.window is not None:
            raise ConfigError(f"only sliding and MLA layers have a window (kind {self.kind!r}, window {self.window})")
        if self.window is not None and self.window < 2:
            raise ConfigError(f"a windowed layer needs window >= 2, got {self.window}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ConfigError(f"an MLA layer has one latent row per token (num_kv_heads=1), got {self.num_kv_heads}")
        if self.kind != "mla" and self.value_dim < 1:
            raise ConfigError(f"attention layer needs value_dim >= 1, got {self.value_dim}")

    @property
    def replicated(self) -> bool:
        """True when every TP rank holds the whole state (MLA)."""
        return self.kind == "mla"

    @property
    def is_recurrent(self) -> bool:
        return self.kind == "recurrent"

    @property
    def is_stateless(self) -> bool:
        """True when the layer keeps no cache (no components, no group, no region)."""
        return self.kind == "stateless"

    @property
    def is_attention(self) -> bool:
        """True for per-token K/V state (full, sliding, MLA)."""
        return self.kind in ("full", "sliding", "mla")

    @property
    def components(self) -> tuple[Component, ...]:
        if self.kind == "stateless":
            return ()
        if self.kind == "recurrent":
            return self.state
        if self.kind == "mla":
            if self.value_dim:  # transformers keeps the normalized latent and the rotated rope part apart
                return (Component("latent", 1, self.key_dim), Component("rope", 1, self.value_dim))
            return (Component("latent", 1, self.key_dim),)
        return (Component("k", self.num_kv_heads, self.key_dim), Component("v", self.num_kv_heads, self.value_dim))

    @property
    def group_key(self) -> tuple[str, int | None, int]:
        return (self.kind, self.window, self.tokens_per_row)

    def rows(self, num_tokens: int) -> int:
        """Rows the layer holds after `num_tokens` tokens: one per token, or one per complete
        window of `tokens_per_row` tokens."""
        return num_tokens // self.tokens_per_row

    def moved_positions(self, num_tokens: int, num_cached: int = 0) -> range:
        """Positions a move of `num_tokens` tokens writes, the first `num_cached` held already:
        tokens, or rows of complete windows for a layer keeping one row per several tokens, from
        the first one the layer still keeps (the planner, verification, checksums and dtype checks
        all read positions through this)."""
        rows = self.rows(num_tokens)
        return range(max(self.rows(num_cached), self.tokens_kept(rows)), rows)

    def tokens_kept(self, num_tokens: int) -> int:
        """Index of the first token this layer still needs after `num_tokens` tokens."""
        if self.is_recurrent:
            return num_tokens  # no per-token state; the per-request state is moved whole
        if self.window is None:
            return 0
        return max(0, num_tokens - (self.window - 1))


class ModelSpec(msgspec.Struct, frozen=True, dict=True):
    """The KV geometry of one model: its layers and the dtype of the cache."""

    layers: tuple[LayerSpec, ...]
    dtype: str = "bfloat16"
    name: str = "model"

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a model needs at least one layer")
        if all(layer.is_stateless for layer in self.layers):
            raise ConfigError("a model needs at least one layer that keeps a cache (every layer is stateless)")
        msgspec.structs.force_setattr(self, "dtype", normalize_dtype(self.dtype))

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def component_dtype(self, comp: Component) -> str:
        return normalize_dtype(comp.dtype) if comp.dtype else self.dtype

    def component_itemsize(self, comp: Component) -> int:
        return DTYPE_SIZES[self.component_dtype(comp)]

    @property
    def max_components(self) -> int:
        return max(len(layer.components) for layer in self.layers)

    @cached_property
    def row_rates(self) -> tuple[int, ...]:
        """The distinct `tokens_per_row` above 1, sorted: empty when every layer keeps one row per token
        (asked on the planner's path, so computed once)."""
        return tuple(sorted({layer.tokens_per_row for layer in self.layers} - {1}))

    @property
    def has_recurrent(self) -> bool:
        return any(layer.is_recurrent for layer in self.layers)

    def recurrent_groups(self) -> tuple[int, ...]:
        """Indices of groups that hold per-request recurrent state (never expanded to kernel blocks)."""
        return tuple(g for g in range(len(self.groups)) if self.group_layer(g).is_recurrent)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Layer indices per KV-cache group, groups in order of first appearance (stateless layers
        are in none)."""
        order: dict[tuple[str, int | None, int], list[int]] = {}
        for i, layer in enumerate(self.layers):
            if not layer.is_stateless:
                order.setdefault(layer.group_key, []).append(i)
        return tuple(tuple(v) for v in order.values())

    @cached_property
    def layer_group(self) -> tuple[int, ...]:
        """Group of each layer; -1 for a stateless layer."""
        out = [-1] * self.num_layers
        for g, layers in enumerate(self.groups):
            for i in layers:
                out[i] = g
        return tuple(out)

    def group_layer(self, group: int) -> LayerSpec:
        return self.layers[self.groups[group][0]]

    @property
    def total_kv_heads(self) -> int:
        """vLLM's `total_num_kv_heads`: the head count of the attention layers (1 for MLA)."""
        return max((layer.num_kv_heads for layer in self.layers if layer.is_attention), default=0)

    @property
    def is_mla(self) -> bool:
        return all(layer.kind == "mla" for layer in self.layers if layer.is_attention)

    def bytes_per_token(self) -> int:
        """Bytes of KV state one token adds over all attention layers on a TP=1 engine (a layer
        keeping one row per `tokens_per_row` tokens counts that share of a row, rounded down)."""
        return sum(c.heads * c.dim * self.component_itemsize(c) // layer.tokens_per_row for layer in self.layers
                   if layer.is_attention for c in layer.components)

    def state_bytes(self) -> int:
        """Bytes of recurrent state one request holds over all layers on a TP=1 engine."""
        return sum(c.heads * c.dim * self.component_itemsize(c) for layer in self.layers
                   if layer.is_recurrent for c in layer.components)

    def check_compatible(self, other: ModelSpec, mine: str = "local", theirs: str = "remote") -> None:
        """Raise `IncompatibleEngines` naming the first geometry field where two engines differ."""
        if self.dtype != other.dtype:
            raise IncompatibleEngines(f"KV dtype differs: {mine} {self.dtype}, {theirs} {other.dtype}")
        if self.num_layers != other.num_layers:
            raise IncompatibleEngines(f"layer count differs: {mine} {self.num_layers}, {theirs} {other.num_layers}")
        for i, (x, y) in enumerate(zip(self.layers, other.layers)):
            for f in ("kind", "num_kv_heads", "key_dim", "value_dim", "window", "recurrent_type", "conv_rows",
                      "conv_states", "tokens_per_row"):
                if getattr(x, f) != getattr(y, f):
                    raise IncompatibleEngines(
                        f"layer {i} {f} differs: {mine} {getattr(x, f)}, {theirs} {getattr(y, f)}")
            if len(x.state) != len(y.state):
                raise IncompatibleEngines(
                    f"layer {i} state components differ: {mine} {[c.name for c in x.state]}, "
                    f"{theirs} {[c.name for c in y.state]}")
            for cx, cy in zip(x.state, y.state):
                ours = (cx.name, cx.heads, cx.dim, self.component_dtype(cx))
                peer = (cy.name, cy.heads, cy.dim, other.component_dtype(cy))
                if ours != peer:
                    raise IncompatibleEngines(
                        f"layer {i} recurrent state {cx.name!r} differs (name, units, dim, dtype): "
                        f"{mine} {ours}, {theirs} {peer}")

    def fingerprint(self) -> str:
        """Stable digest of the geometry (not the name), exchanged at handshake."""
        # every field, state components included; `conv_states` only where set and `tokens_per_row`
        # only where it is not 1, so that a spec without them keeps the digest it had before the
        # fields existed (older peers agree)
        default = {"conv_states": (), "tokens_per_row": 1}
        layers = [{k: v for k, v in msgspec.structs.asdict(layer).items() if k not in default or v != default[k]}
                  for layer in self.layers]
        payload = msgspec.json.encode((layers, self.dtype))
        return hashlib.sha256(payload).hexdigest()[:16]

    def describe(self) -> str:
        kinds = ", ".join(
            f"{len(layers)}x{self.layers[layers[0]].kind}"
            + (f"(w={self.layers[layers[0]].window})" if self.layers[layers[0]].window else "")
            + (f"(1 row/{self.layers[layers[0]].tokens_per_row} tokens)" if self.layers[layers[0]].tokens_per_row > 1
               else "")
            for layers in self.groups
        )
        stateless = sum(layer.is_stateless for layer in self.layers)
        kinds += f", {stateless}xstateless" if stateless else ""
        first = next((layer for layer in self.layers if layer.is_attention), None)
        attn = (f", {first.num_kv_heads} KV heads, head dim {first.key_dim}/{first.value_dim or '-'}"
                if first else "")
        state = ""
        if self.has_recurrent:
            rec = next(layer for layer in self.layers if layer.is_recurrent)
            state = f", {rec.recurrent_type} state [{' | '.join(f'{c.name}:{c.heads}x{c.dim}' for c in rec.state)}]"
        return f"{self.name}: {self.num_layers} layers [{kinds}]{attn}{state}, {self.dtype}"

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "bfloat16",
                name: str = "model", kinds: tuple[LayerKind, ...] | None = None, window: int | None = None) -> ModelSpec:
        """A model whose layers share one geometry; `kinds` may alternate full/sliding."""
        kinds = kinds or ("full",)
        layers = []
        for i in range(num_layers):
            kind = kinds[i % len(kinds)]
            if kind == "mla":
                layers.append(LayerSpec("mla", 1, head_dim))
            else:
                layers.append(LayerSpec(kind, num_kv_heads, head_dim, head_dim, window if kind == "sliding" else None))
        return cls(tuple(layers), dtype, name)

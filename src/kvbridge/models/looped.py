"""Looped (recurrent-depth) models: a cache with one copy of the looped layers per extra loop.

Dory runs its middle `n_recurrent_layers` layers `n_recurrent_loops` times. With
`recurrent_kv_cache_mode="per_loop"` every loop keeps its own K/V: transformers' forward appends
`n_recurrent_loops - 1` copies of those layers' cache layers after the model's own, so the cache
holds more layers than the config has. Read as one cache layer per config layer, such a model
would lose every extra loop's K/V; so the spec gets the same copies, in the same order (all spec
layers of each looped config layer: `config._layers`), and the proof's empty cache is extended the way the forward extends it. transformers says this in no
general way (the forward does it), hence the config fields by name; `"last_loop"` keeps one cache
layer per config layer and needs nothing.
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.models.untrusted import MAX_LAYERS

MAX_LOOPS = 1024


def loop_copies(text: Any, num_layers: int) -> tuple[range, int] | None:
    """(the looped layers' indices, extra copies of them the cache holds), or None when the cache
    holds one layer per config layer."""
    loops = getattr(text, "n_recurrent_loops", None)
    if loops is None or getattr(text, "recurrent_kv_cache_mode", "per_loop") != "per_loop":
        return None
    start, count = getattr(text, "n_input_layers", None), getattr(text, "n_recurrent_layers", None)
    for name, value in (("n_recurrent_loops", loops), ("n_input_layers", start), ("n_recurrent_layers", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config field {name} must be a non-negative integer, got {value!r}")
    if loops > MAX_LOOPS:
        raise ConfigError(f"config field n_recurrent_loops is {loops}, above kvbridge's bound {MAX_LOOPS}")
    if start + count > num_layers:
        raise ConfigError(f"looped layers {start}..{start + count - 1} lie beyond the model's {num_layers} layers")
    if loops < 2 or count == 0:
        return None
    total = num_layers + (loops - 1) * count
    if total > MAX_LAYERS:
        raise ConfigError(f"{loops} loops of {count} layers make a cache of {total} layers, above kvbridge's "
                          f"bound {MAX_LAYERS}")
    return range(start, start + count), loops - 1


__all__ = ["MAX_LOOPS", "loop_copies"]

"""What transformers' forward caches, measured on the meta device: each K/V layer's heads and widths.

The modules transformers builds say what a layer's projections compute (`modules.py`). What the
layer *caches* is what its forward hands `Cache.update`, and a projection's width does not always
say it: Falcon's new decoder architecture computes `num_kv_heads` key and value heads in its fused
`query_key_value` and broadcasts each over its group of query heads before caching, so its cache
holds one K/V head per query head. So the causal-LM model already built on the meta device for
`modules.py` runs one forward over two tokens there (no memory, no arithmetic: shapes only, well
under a second for a tiny model, a few for DeepSeek-V3's 61 layers), and the cache it returns gives,
per layer, the K/V heads and the key and value widths transformers keeps.

Not every forward runs on meta: value-dependent code (`.item()` on a position or a mask, MoE
routing through `nonzero`; about one causal LM in seven) raises, and then nothing is measured: the
modules, and the config's fields where no module answers, stand alone (`config.py`). The model is
cast to bfloat16 first (MoE grouped matmuls take no other dtype; on meta this costs nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import threading
import warnings
from typing import Any

TOKENS = 2  # the probe's prompt: the cache's token axis must read 2 (any other value is not a K/V layer)
PROBE_SECONDS = 30.0
"""The forward's bound: DeepSeek-V3's 61 layers take a few seconds on meta; a forward past this
(a loop that never ends on meta, a modeling file that waits) is stopped and nothing is measured,
said in one line, instead of holding `kvbridge plan` or a fleet's start without end."""

logger = logging.getLogger("kvbridge")


class _TooLong(Exception):
    """Raised in the probing thread when its forward outlives `PROBE_SECONDS`."""


@contextlib.contextmanager
def _bounded(seconds: float):
    """Raise `_TooLong` in this thread once `seconds` pass (at its next Python instruction: a
    forward on meta is Python), whichever thread it is; the timer's raise and the block's end
    are ordered by a lock, so it never lands after the block."""
    state = {"done": False, "fired": False}
    lock = threading.Lock()
    tid = threading.get_ident()

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_TooLong))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
        with lock:
            state["done"] = True
    finally:
        with lock:
            state["done"] = True
        timer.cancel()


def cached_kv(model: Any, num_layers: int) -> dict[int, tuple[int, int, int]] | None:
    """{layer index: (KV heads, key width, value width)} of the K/V tensors transformers' forward
    caches for each of the first `num_layers` cache layers, from one forward of `model` on the meta
    device (empty: it ran and cached no K/V); None where the forward cannot run there."""
    import torch
    try:
        import transformers.utils.logging as hf_logging
    except Exception:  # noqa: BLE001 - no modeling code installed
        return None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    quiet = io.StringIO()  # a forward's notices (deprecations, kernels) are not plan's output
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), warnings.catch_warnings(), \
                torch.no_grad():
            warnings.simplefilter("ignore")
            model.to(torch.bfloat16)
            with _bounded(PROBE_SECONDS):
                out = model(torch.zeros(1, TOKENS, dtype=torch.long, device="meta"), use_cache=True)
            return kv_shapes(_cache(out), num_layers)
    except _TooLong:
        logger.warning("%s: its forward on the meta device ran past %.0f s and was stopped: the cached K/V heads "
                       "are not measured (its modules and config decide)", type(model).__name__, PROBE_SECONDS)
        return None
    except Exception:  # noqa: BLE001 - value-dependent code cannot run on meta: nothing measured
        return None
    finally:
        hf_logging.set_verbosity(verbosity)


def _cache(out: Any) -> Any:
    cache = None
    for name in ("cache", "past_key_values", "cache_params"):  # transformers 5's name first, older ones after
        cache = getattr(out, name, None)
        if cache is not None:
            break
    return getattr(cache, "self_attention_cache", cache)  # an encoder-decoder cache: the decoder's own


def kv_shapes(cache: Any, num_layers: int, tokens: int = TOKENS) -> dict[int, tuple[int, int, int]]:
    """{layer index: (heads, key width, value width)} of a cache's layers holding [batch, heads,
    `tokens`, width] keys and values (the layers holding no K/V, or other shapes, are left out)."""
    out: dict[int, tuple[int, int, int]] = {}
    layers = list(getattr(cache, "layers", None) or ())
    for i, layer in enumerate(layers[:num_layers]):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        shapes = [tuple(getattr(t, "shape", ())) for t in (keys, values)]
        if all(len(s) == 4 and s[0] == 1 and s[2] == tokens and s[1] > 0 and s[3] > 0 for s in shapes) \
                and shapes[0][1] == shapes[1][1]:
            out[i] = (int(shapes[0][1]), int(shapes[0][3]), int(shapes[1][3]))
    return out

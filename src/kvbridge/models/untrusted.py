"""config.json is untrusted input: bounds and types before transformers or kvbridge do any work.

A config comes from a model directory someone else wrote. Before it reaches a transformers
config class (which may loop over `num_hidden_layers`, allocate per-layer lists, or coerce types
silently), every value is checked here: the document must be a JSON object of bounded size and
depth, with no integer wider than 64 bits anywhere, and every field that sizes the cache
must be a plain positive int within a sane bound (a bool, a float such as 32.0,
a string or a list where an int belongs is refused, never coerced). Each failure is one line
(`ConfigError`), which the CLI turns into exit 2.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError

MAX_CONFIG_BYTES = 8 << 20  # the largest hub configs (with per-layer lists) are well under 1 MiB
MAX_DEPTH = 8  # text_config / vision_config / rope_scaling nest two or three levels
MAX_NODES = 200_000
MAX_INT = 1 << 63

MAX_LAYERS = 4096
MAX_HEADS = 16384
MAX_DIM = 1 << 18  # hidden sizes, head dims, latent ranks, state sizes
MAX_KERNEL = 1024
MAX_WINDOW = 1 << 31

_BOUNDS: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), MAX_LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "num_key_value_heads", "num_kv_heads",
                     "n_head_kv", "num_global_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                     "mamba_n_heads", "mamba_num_heads", "mamba_n_groups", "mamba_ngroups", "n_groups",
                     "linear_num_heads"), MAX_HEADS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "head_dim", "global_head_dim", "kv_lora_rank",
                     "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim", "mamba_d_state",
                     "ssm_state_size", "state_size", "index_head_dim", "mamba_expand", "expand"), MAX_DIM),
    **dict.fromkeys(("mamba_d_conv", "conv_kernel", "linear_conv_kernel_dim", "conv_L_cache", "d_conv"), MAX_KERNEL),
    **dict.fromkeys(("sliding_window", "attention_chunk_size"), MAX_WINDOW),
}
"""Fields that size the cache, with their upper bound. `None` means "absent" (transformers'
default applies, with a warning); `"auto"` is allowed where configs use it (mamba_d_head)."""

_ZERO_OK = {"sliding_window", "attention_chunk_size"}  # 0: no window (Qwen2-MoE writes it so)
_AUTO_OK = {"mamba_d_head", "mamba_head_dim", "mamba_headdim"}
_NESTED = ("text_config", "language_config", "llm_config")


def load_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """The config as a checked dict: a dict, a config.json file or a model directory."""
    if isinstance(config, dict):
        check_config(config)
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; not a model config")
    try:
        # NaN/Infinity parse, bare or as transformers >= 5.24 writes them ({"__float__": "Infinity"},
        # e.g. Mamba2's time_step_limit); sizes refuse them
        cfg = json.loads(raw, object_hook=_special_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, int digit limit, UTF-8 errors
        raise ConfigError(f"{path} is not valid JSON: {_one_line(str(e))}") from None
    check_config(cfg, str(path))
    return cfg


_SPECIAL_FLOATS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _special_float(obj: dict[str, Any]) -> Any:
    """transformers' tag for a float JSON cannot spell (`{"__float__": "Infinity"}`), as the float."""
    if len(obj) == 1 and isinstance(obj.get("__float__"), str) and obj["__float__"] in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def check_config(cfg: Any, where: str = "config") -> None:
    """Structure and cache-sizing fields of a config (and of its nested text config)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where} is a JSON {type(cfg).__name__}, not an object")
    _walk(cfg, "", 0, [0])
    _check_fields(cfg, "")
    for key in _NESTED:
        if isinstance(cfg.get(key), dict):
            _check_fields(cfg[key], f"{key}.")
        elif cfg.get(key) is not None:
            raise ConfigError(f"config field {key} must be an object, got {_kind(cfg[key])}")


def _walk(value: Any, path: str, depth: int, count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_NODES:
        raise ConfigError(f"config has more than {MAX_NODES} values; not a model config")
    if depth > MAX_DEPTH:
        raise ConfigError(f"config nests deeper than {MAX_DEPTH} levels at {path or 'the top'}")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):  # int keys: id2label of a to_dict()
                raise ConfigError(f"config key {safe_text(repr(k))} at {path or 'the top'} is not a string")
            _walk(v, f"{path}.{k}" if path else k, depth + 1, count)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", depth + 1, count)
    elif isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT <= value < MAX_INT:
        raise ConfigError(f"config field {safe_text(path)} is an integer of {len(str(abs(value))) if abs(value) < 10 ** 4000 else 'thousands of'} digits")


def _check_fields(cfg: dict[str, Any], prefix: str) -> None:
    for key, bound in _BOUNDS.items():
        if key not in cfg:
            continue
        value = cfg[key]
        if value is None or (key in _AUTO_OK and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field {prefix}{key} must be an integer, got {_kind(value)} {_short(value)}")
        if value < 1 and not (value == 0 and key in _ZERO_OK):
            raise ConfigError(f"config field {prefix}{key} must be >= 1, got {value}")
        if value > bound:
            raise ConfigError(f"config field {prefix}{key} is {value}, above kvbridge's bound {bound}")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ConfigError(f"config field {prefix}layer_types must be a list of strings")
        if len(types) > MAX_LAYERS:
            raise ConfigError(f"config field {prefix}layer_types has {len(types)} entries, above {MAX_LAYERS}")


def _kind(value: Any) -> str:
    return {bool: "a bool", float: "a float", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = safe_text(repr(value))
    return text if len(text) <= 40 else text[:37] + "..."


def _one_line(text: str) -> str:
    return safe_text(text.splitlines()[0] if text else text)


def error_line(e: BaseException) -> str:
    """`Type: first line of its message`, safe to print: a foreign library's failure on an untrusted
    config, as the one line a refusal ends with."""
    return f"{type(e).__name__}: {_one_line(str(e).strip())}"


def safe_text(text: str, limit: int = 200) -> str:
    """`text` without control characters or console markup, at most `limit` characters: names
    from configs (`_name_or_path`) end up in logs, tables and terminals."""
    out = []
    for ch in str(text):
        if ch in "[]<>`":
            out.append("_")
        elif unicodedata.category(ch)[0] == "C":
            out.append("?")
        else:
            out.append(ch)
    s = "".join(out)
    return s if len(s) <= limit else s[:limit - 3] + "..."

"""The `kvbridge` typer app and what every command shares: consoles, one-line errors, bounds.

Every command prints a readable summary or, with `--json`, one JSON object. Bad input exits 2
with one line naming the problem; a failed proof or verification exits 1.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from kvbridge.errors import ConfigError, InvalidRequest, KVBridgeError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"max_content_width": 80},
                  help="Move LLM KV caches between engines of any TP size, block size and layout, byte-exact.")
console = Console()
if not console.is_terminal:  # piped output: wide enough for the plan table, never squeezed to 80
    console = Console(width=160)
err_console = Console(stderr=True)


class Order(str, Enum):
    """NHD (token-major) or HND (head-major) inside a block; any case on the command line."""

    NHD = "NHD"
    HND = "HND"


def _choices(name: str, *values: str) -> type[Enum]:
    """A str Enum whose members are `values` (typer's choices)."""
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


Transport = _choices("Transport", "local", "shm", "nixl", "mooncake")
Mode = _choices("Mode", "pull", "push")
Engine = _choices("Engine", "kvbridge", "vllm")
Role = _choices("Role", "both", "decode")


# Upper bounds of numeric inputs, from real deployments with a wide margin (the largest TP/PP
# groups served today are 64-128 GPUs; contexts reach 1-10M tokens on whole clusters, one
# request here is planned in memory). Beyond a bound: exit 2 with one line naming it.
BOUNDS: dict[str, int] = {
    "tp": 256,                # TP size of one engine (peers are bounded the same: connector/peer_bounds.py)
    "block_size": 65_536,     # tokens per block
    "tokens": 65_536,         # tokens of one planned request: ~2 s and ~0.2 GB (per-token figures do not change beyond)
    "prompt_len": 8_192,      # prompts of the transformers proof (tiny models on CPU)
    "new_tokens": 1_024,
    "requests": 256,          # requests in flight in a demo
    "cases": 100_000,         # verify's random cases
    "repeats": 1_000,
    "link_gbps": 100_000,     # GB/s a transfer time is computed for (a 400G NIC is 50)
    "timeout": 86_400,        # seconds
}


def check_bounds(**values: int | float | None) -> None:
    """Raise `ConfigError` (exit 2) naming the first option above its bound in `BOUNDS`."""
    for name, value in values.items():
        if value is None:
            continue
        key = name.removeprefix("prefill_").removeprefix("decode_").removesuffix("_kernel")
        bound = BOUNDS.get(key)
        if bound is not None and value > bound:
            raise ConfigError(f"--{name.replace('_', '-')} {value} is above kvbridge's bound of {bound:,} "
                              f"({key.replace('_', ' ')})")


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn kvbridge's own errors into one line on stderr and exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVBridgeError as e:
            line = " ".join(str(e).split())  # one line, whatever the message held
            err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    return wrapper


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InvalidRequest(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def load_spec(model: str):  # -> ModelSpec
    """A config.json path or model DIR (an existing path wins), else a preset or built-in tiny model NAME."""
    from kvbridge.models.presets import PRESETS, preset_spec
    path = Path(model)
    if path.exists():
        from kvbridge.models import spec_from_hf_config
        return spec_from_hf_config(path)
    if model in PRESETS:
        return preset_spec(model)  # stored: no transformers import
    from kvbridge.proofs.tiny_models import BUILTIN_MODELS, spec_for
    if model in BUILTIN_MODELS:
        return spec_for(BUILTIN_MODELS[model]())
    names = ", ".join(list(PRESETS) + list(BUILTIN_MODELS))
    raise ConfigError(f"unknown model {model!r}: give a config.json path, a model directory or one of: {names}")


class nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

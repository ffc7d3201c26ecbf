"""The `kvbridge` typer app and what every command shares: consoles, one-line errors, bounds.

Every command prints a readable summary or, with `--json`, one JSON object. Bad input exits 2
with one line naming the problem; a failed proof or verification exits 1.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.2x carries its own click; older ones use click's
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as _click_errors  # type: ignore[no-redef]

from kvbridge.errors import ConfigError, InvalidRequest, KVBridgeError

class _OneLineErrors(TyperGroup):
    """The command group with click's usage errors (a bad value, a missing argument, an unknown
    option) as one line naming the option, exit 2, like kvbridge's own errors."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except _click_errors.NoArgsIsHelpError as e:  # no arguments: the help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        except _click_errors.UsageError as e:
            where = e.ctx.command_path if e.ctx else "kvbridge"
            line = " ".join(e.format_message().split())
            err_console.print(f"[bold red]error:[/] {escape(line)} (`{escape(where)} --help` lists the options)",
                              highlight=False, soft_wrap=True)
            sys.exit(2)
        except _click_errors.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:  # (typer keeps Abort in typer.exceptions, not in its vendored click)
            err_console.print("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  cls=_OneLineErrors,
                  context_settings={"max_content_width": 80},
                  help="Move LLM KV caches between engines of any TP size, block size and layout, byte-exact.")


def _version(value: bool) -> None:
    if value:
        from kvbridge import __version__
        sys.stdout.write(f"kvbridge {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print kvbridge's version and exit.")) -> None:
    """Move LLM KV caches between engines of any TP size, block size and layout, byte-exact."""


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
    "tokens": 16_777_216,     # tokens of one planned request (plan: beyond `plan.CHUNK_TOKENS`, in chunks, summarised)
    "bench_tokens": 65_536,   # tokens bench allocates and moves in this process (Llama-3-8B: 8 GiB per side)
    "prompt_len": 8_192,      # prompts of the transformers proof (tiny models on CPU)
    "new_tokens": 1_024,
    "requests": 256,          # requests in flight in a demo
    "cases": 100_000,         # verify's random cases
    "repeats": 1_000,
    "link_gbps": 1_000_000,   # Gbit/s a transfer time is computed for (a 400G NIC is 400)
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


# Library words -> the flags a user of the command line typed (the library names its own fields).
_CLI_WORDS = (("insecure=True", "--insecure"), ("ConnectorConfig.secret", "--secret-file"),
              ("secret_file=", "--secret-file"), ("secret_file", "--secret-file"),
              ("num_cached_tokens", "--num-cached-tokens"))


def cli_words(line: str) -> str:
    """`line` with the library's field names replaced by the command-line flags that set them."""
    for lib, flag in _CLI_WORDS:
        line = re.sub(rf"(?<![\w-]){re.escape(lib)}(?![\w])", flag, line)
    return line


_VALIDATION = re.compile(r"Value error, (.+?)(?: \[type=|$)", re.M)


def error_summary(message: str, limit: int = 400) -> str:
    """One line for `message`. A long message of several lines (a foreign failure with its traceback
    or log tail, e.g. a vLLM instance's) becomes its first line, a validation error (pydantic's
    "Value error, ...") its sentence, and the whole text goes to a file the line names."""
    line = " ".join(message.split())
    if len(line) <= limit or "\n" not in message.strip():
        return line
    first = " ".join(message.strip().splitlines()[0].split())
    found = _VALIDATION.search(message)
    if found:
        head = first.split(":")[0] if ":" in first else first
        first = f"{head}: {' '.join(found.group(1).split())}"
    import tempfile
    fd, path = tempfile.mkstemp(prefix="kvbridge-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(message)
    return f"{first[:limit]} (the whole message: {path})"


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn kvbridge's own errors into one line on stderr and exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVBridgeError as e:
            line = cli_words(error_summary(str(e)))  # one line, in the command line's words
            err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    return wrapper


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def parse_ints(text: str, flag: str, low: int = 0, high: int | None = None) -> list[int]:
    """Comma-separated integers in [low, high]; an empty item (`1,,3`, a trailing comma) is refused, not skipped."""
    items = text.split(",")
    values = []
    for item in items:
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            what = "an empty item" if not item else repr(item)
            raise InvalidRequest(f"{flag} takes comma-separated integers, got {text!r} ({what} is not one)") from None
        if value < low or (high is not None and value > high):
            bound = f"[{low:,}, {high:,}]" if high is not None else f"at least {low}"
            raise InvalidRequest(f"{flag} takes integers {bound}, got {value} in {text!r}")
        values.append(value)
    return values


def parse_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    """Token ids: non-negative integers, comma-separated."""
    return parse_ints(text, flag, 0)


def check_secret_file(path: Path | None) -> None:
    """Read `--secret-file` as the side channel will (a 0600 regular file of this user, bounded):
    refused in one line before any work, not after the model is built."""
    if path is None:
        return
    from kvbridge.core.secrets import read_secret_file
    try:
        read_secret_file(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("secret file ", "--secret-file ", 1)) from None


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or "/" in text or os.sep in text or text.endswith(".json")


def load_spec(model: str, flag: str = "MODEL", presets: bool = True):  # -> ModelSpec
    """A config.json path or model DIR (an existing path wins), else a preset or built-in tiny model NAME.

    `presets=False` for commands that run the model (demo, prefill-server): a preset has a geometry
    but no weights, so it is neither accepted nor offered; a config.json file is not a model DIR."""
    from kvbridge.models.presets import PRESETS, preset_spec
    path = Path(model).expanduser()
    if path.exists():
        if not presets and not path.is_dir():
            raise ConfigError(f"{flag} {model}: a file; this command runs a model: give its DIR (config.json and "
                              f"optional weights) or a built-in model name")
        from kvbridge.models import spec_from_hf_config
        return spec_from_hf_config(path)
    if presets and model in PRESETS:
        return preset_spec(model)  # stored: no transformers import
    if model in PRESETS:  # `kvbridge plan llama-3-8b` takes it: say why this command does not
        from kvbridge.proofs.tiny_models import BUILTIN_MODELS
        raise ConfigError(f"{flag} {model}: a preset geometry that `kvbridge plan` and `bench` take (no weights); "
                          f"this command runs a model: give its DIR (config.json; weights optional) or one of: "
                          f"{', '.join(BUILTIN_MODELS)}")
    from kvbridge.proofs.tiny_models import BUILTIN_MODELS, spec_for
    if model in BUILTIN_MODELS:
        return spec_for(BUILTIN_MODELS[model]())
    if _looks_like_path(model):
        raise ConfigError(f"{flag} {model}: no such file or directory (the path does not exist)")
    names = ", ".join((list(PRESETS) if presets else []) + list(BUILTIN_MODELS))
    what = "a config.json path, a model directory" if presets else "a model directory"
    raise ConfigError(f"unknown model {model!r} ({flag}): give {what} or one of: {names}")


class nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

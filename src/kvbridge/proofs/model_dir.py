"""A model from a local directory for the proofs: its saved weights, or random ones drawn from its config.

`kvbridge plan DIR` needs only config.json, so a user tries `kvbridge demo --model DIR` on the same
directory: without weights the model is built from the config with weights drawn from the seed
(every byte of the proof is still compared; only the weights are not the checkpoint's). The proof
runs in float32 on the CPU, so the model's size is counted first, on the meta device (no memory,
about a second even for a 671B config), and a model above `MAX_MODEL_BYTES` is refused in one line
instead of filling the machine's memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvbridge.errors import ConfigError
from kvbridge.models.untrusted import error_line

MAX_MODEL_BYTES = 4 << 30
"""Largest float32 model a demo builds or loads (4 GiB, a 1B-parameter model); `KVBRIDGE_DEMO_MAX_GIB` raises it."""

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _limit() -> int:
    raw = os.environ.get("KVBRIDGE_DEMO_MAX_GIB")
    if raw is None:
        return MAX_MODEL_BYTES
    try:
        gib = float(raw)
    except ValueError:
        raise ConfigError(f"KVBRIDGE_DEMO_MAX_GIB must be a number of GiB, got {raw!r}") from None
    if not 0 < gib < 1 << 20:
        raise ConfigError(f"KVBRIDGE_DEMO_MAX_GIB must be in (0, 1048576) GiB, got {raw!r}")
    return int(gib * (1 << 30))


def float32_bytes(config: PretrainedConfig) -> int:
    """Bytes the model takes in float32, counted on the meta device (nothing allocated): its
    parameters, and its buffers in their own dtypes (GPT-Neo's causal mask is `max_positions`
    squared booleans per layer, however few its parameters)."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - transformers' own failure on this config: one line
        raise ConfigError(f"transformers cannot build a causal LM from this config: {error_line(e)}") from None
    return 4 * sum(p.numel() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())


def has_weights(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _WEIGHT_FILES)


def checked_config(directory: str | Path) -> PretrainedConfig:
    """The directory's transformers config, after kvbridge's own checks of the untrusted config.json
    (types, bounds, the cache geometry: one line on any failure, where transformers would raise a
    traceback or build whatever the file asks for). Its warnings (sizes config.json leaves to the
    class's defaults, fields the modules transformers builds do not follow) go to stderr here, once:
    the spec the demos plan with is read from the loaded config, where every default is filled in."""
    from kvbridge.models import spec_from_hf_config

    d = Path(directory)
    if not (d / "config.json").is_file():
        raise ConfigError(f"{d} is a directory without config.json")
    spec_from_hf_config(d / "config.json")
    try:
        return AutoConfig.from_pretrained(d, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - what kvbridge's checks let through and transformers still rejects
        raise ConfigError(f"{d}: transformers cannot read its config.json: {error_line(e)}") from None


def load_dir_model(directory: str | Path, seed: int) -> PreTrainedModel:
    """The directory's model in float32: its weights, or (config.json alone) weights drawn from `seed`."""
    d = Path(directory)
    config = checked_config(d)
    size, limit = float32_bytes(config), _limit()
    if size > limit:
        raise ConfigError(f"{d}: the model takes {size / (1 << 30):.1f} GiB in float32, above the demo's "
                          f"{limit / (1 << 30):.1f} GiB (the proof runs it on the CPU; set KVBRIDGE_DEMO_MAX_GIB "
                          f"to allow more, or use `kvbridge plan` for its geometry)")
    if not has_weights(d):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign checkpoint: one line, not a traceback
        raise ConfigError(f"{d}: cannot load its weights: {error_line(e)}") from None


__all__ = ["MAX_MODEL_BYTES", "checked_config", "float32_bytes", "has_weights", "load_dir_model"]

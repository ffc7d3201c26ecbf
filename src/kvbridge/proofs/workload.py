"""The multi-process demos' workload: prompts, request ids, engine layouts sized to them, block tables.

Both halves of the two-host demo derive the same workload from the same arguments (model, prompt,
seed, number of requests), as a proxy sends both engines the same prompt.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import ConfigError, InvalidRequest


def model_config(model: str) -> Any:
    """The model's transformers config without loading weights (for spec and vocabulary)."""
    from kvbridge.proofs.tiny_models import BUILTIN_MODELS
    if model in BUILTIN_MODELS:
        config = BUILTIN_MODELS[model]()
    elif Path(model).is_dir():
        from kvbridge.proofs.model_dir import checked_config
        config = checked_config(model)
    else:
        raise ConfigError(f"unknown model {model!r}: not a local model directory; builtin models: "
                          f"{', '.join(BUILTIN_MODELS)}")
    config.name_or_path = model
    return config


@dataclass
class Workload:
    """Request ids and prompts: the same on both hosts for the same arguments."""

    model: str
    spec: ModelSpec
    ids: list[str]
    prompts: list[list[int]]

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]


def workload(model: str, prompt: Sequence[int] | int | None, prompt_ids: Sequence[int] | None,
              prompt_len: int | None, seed: int, num_requests: int) -> Workload:
    from kvbridge.proofs.proof import make_prompt_ids
    from kvbridge.proofs.tiny_models import spec_for
    if prompt is not None and prompt_ids is not None:
        raise InvalidRequest("give the prompt once: positional `prompt` or `prompt_ids`, not both")
    if num_requests < 1:
        raise InvalidRequest(f"num_requests must be >= 1, got {num_requests}")
    if prompt is None:
        prompt = prompt_ids if prompt_ids is not None else (32 if prompt_len is None else prompt_len)
    config = model_config(model)
    spec = spec_for(config, "float32")
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    prompts = [make_prompt_ids(prompt, vocab, seed + i) for i in range(num_requests)]
    return Workload(model, spec, [f"req-{seed}-{i}" for i in range(num_requests)], prompts)


def sized_layout(layout: EngineLayout | None, spec: ModelSpec, lengths: list[int], tp: int, side: str) -> EngineLayout:
    """The given layout (checked to hold every request) or a default with room to scatter blocks."""
    groups = len(spec.groups)
    if layout is None:
        need = groups * sum(math.ceil(n / 16) for n in lengths)
        return EngineLayout(tp_size=tp, block_size=16, num_blocks=max(4, 2 * need + 2))
    need = sum(layout.block_ids_needed(g, n) for n in lengths for g in range(groups))
    if need > layout.num_blocks:
        raise InvalidRequest(f"{side} layout has {layout.num_blocks} blocks of {layout.block_size} tokens; "
                             f"{len(lengths)} request(s) of {sum(lengths)} tokens over {groups} KV-cache group(s) need "
                             f"{need} (set num_blocks >= {need})")
    return layout


def block_tables(spec: ModelSpec, layout: EngineLayout, lengths: list[int],
                  rng: random.Random) -> list[tuple[tuple[int, ...], ...]]:
    """Disjoint random block ids for every request and group (one permutation, sliced); a block id
    covers `block_size x CP size` tokens of its group (`EngineLayout.block_ids_needed` ids a request)."""
    perm = list(range(layout.num_blocks))
    rng.shuffle(perm)
    out, at = [], 0
    for n in lengths:
        groups = []
        for g in range(len(spec.groups)):
            per = layout.block_ids_needed(g, n)
            groups.append(tuple(perm[at:at + per]))
            at += per
        out.append(tuple(groups))
    return out

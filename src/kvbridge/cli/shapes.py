"""One engine side's shape from the command line: the `--prefill-*` / `--decode-*` options as an `EngineLayout`.

`demo` and `plan` take the same shape options on both sides (TP, PP and its layer split, PCP,
DCP and its interleave, block and kernel block sizes, per-group block sizes, layout, KV dtype);
this module turns one side's values into a checked layout, with one-line errors naming the
option, so the two commands cannot drift apart.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import msgspec
import typer

from kvbridge.cli.app import BOUNDS, parse_ints
from kvbridge.core.layout import EngineLayout
from kvbridge.core.shard import cp_block_span
from kvbridge.core.spec import ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError, KVBridgeError


SHAPES = "Engine shapes (each --prefill-X has a --decode-X)"


def _opt(help: str | None = None, **kw: Any) -> Any:
    return typer.Option(help=help, rich_help_panel=SHAPES, **kw)


# The axes beyond TP and blocks, declared once for `demo` and `plan` (help on the prefill side).
PrefillPP = Annotated[int, _opt("Pipeline stages.", min=1)]
DecodePP = Annotated[int, _opt(min=1)]
PrefillLayerSplit = Annotated[Optional[str], _opt("Layers per PP stage, e.g. 10,6 (VLLM_PP_LAYER_PARTITION) "
                                                  "[default: even].")]
DecodeLayerSplit = Annotated[Optional[str], _opt()]
PrefillPCP = Annotated[int, _opt("Context parallel ranks (PCP).", min=1)]
DecodePCP = Annotated[int, _opt(min=1)]
PrefillDCP = Annotated[int, _opt("Decode context parallel ranks (inside TP).", min=1)]
DecodeDCP = Annotated[int, _opt(min=1)]
PrefillInterleave = Annotated[int, _opt("Tokens per CP rank in turn (cp_kv_cache_interleave_size).", min=1)]
DecodeInterleave = Annotated[int, _opt(min=1)]
PrefillGroupBlocks = Annotated[Optional[str], _opt("One block size per KV-cache group, e.g. 16,64.")]
DecodeGroupBlocks = Annotated[Optional[str], _opt()]
DecodeKvDtype = Annotated[Optional[str], _opt()]


class SideShape(msgspec.Struct, frozen=True, kw_only=True):
    """What the command line says about one engine (`side` is 'prefill' or 'decode')."""

    side: str
    tp: int = 1
    pp: int = 1
    layer_split: str | None = None
    pcp: int = 1
    dcp: int = 1
    cp_interleave: int = 1
    block_size: int | None = None  # None: `default_block_size(spec)`
    kernel_block_size: int | None = None
    group_block_sizes: str | None = None
    layout: str = "HND"
    kv_dtype: str | None = None

    def ints(self, text: str | None, option: str) -> tuple[int, ...]:
        if not text:
            return ()
        return tuple(parse_ints(text, f"--{self.side}-{option}", 1, BOUNDS["block_size"]))

    def layout_for(self, spec: ModelSpec, num_tokens: int, requests: int = 1, **extra: Any) -> EngineLayout:
        """The side's layout with room for `requests` requests of `num_tokens` tokens, checked against `spec`."""
        for name, value in (("pp", self.pp), ("pcp", self.pcp), ("dcp", self.dcp)):
            if value > BOUNDS["tp"]:
                raise ConfigError(f"--{self.side}-{name} {value} is above kvbridge's bound of {BOUNDS['tp']}")
        if self.cp_interleave > BOUNDS["block_size"]:
            raise ConfigError(f"--{self.side}-cp-interleave {self.cp_interleave} is above kvbridge's bound of "
                              f"{BOUNDS['block_size']:,}")
        split = self.ints(self.layer_split, "layer-split")
        if split and len(split) != self.pp:
            raise ConfigError(f"--{self.side}-layer-split {self.layer_split} names {len(split)} stages, "
                              f"--{self.side}-pp is {self.pp}")
        groups = self.ints(self.group_block_sizes, "group-block-sizes")
        if groups and self.block_size is not None:  # one of them would be ignored
            raise ConfigError(f"--{self.side}-block-size and --{self.side}-group-block-sizes both give the block "
                              f"size: drop one")
        if self.cp_interleave > 1 and self.pcp * self.dcp == 1:
            raise ConfigError(f"--{self.side}-cp-interleave {self.cp_interleave} takes effect with context parallel "
                              f"only: add --{self.side}-pcp or --{self.side}-dcp above 1, or drop it")
        if groups and len(groups) != len(spec.groups):
            raise ConfigError(f"--{self.side}-group-block-sizes gives {len(groups)} sizes; {spec.name} has "
                              f"{len(spec.groups)} KV-cache group(s)")
        dtype = normalize_dtype(self.kv_dtype) if self.kv_dtype else None
        block = groups[0] if groups else (self.block_size or default_block_size(spec))
        cp = self.pcp * self.dcp
        per_request = sum(cp_block_span(0, num_tokens, groups[g] if groups else block, cp, self.cp_interleave)[1]
                          for g in range(len(spec.groups)))
        try:
            layout = EngineLayout(
                tp_size=self.tp, pp_size=self.pp, layer_split=split, pcp_size=self.pcp, dcp_size=self.dcp,
                cp_interleave=self.cp_interleave, block_size=block, kernel_block_size=self.kernel_block_size,
                group_block_sizes=groups if len(set(groups)) > 1 else (), kv_order=self.layout.upper(),
                kv_dtype=dtype, num_blocks=max(2, (per_request + 8) * requests), **extra)
        except KVBridgeError as e:
            raise type(e)(f"{self.side} engine: {e}") from None
        layout.check_model(spec, f"{self.side} engine")
        return layout


def default_block_size(spec: ModelSpec, base: int = 16) -> int:
    """The block size an engine gets when the command line names none: `base` tokens, or the
    smallest multiple of it holding whole rows of every layer that keeps one row per several
    tokens (DeepSeek-V4's compressed layers: 128 for a 128-token compress rate)."""
    rates = spec.row_rates
    size = math.lcm(base, *rates)
    if size > BOUNDS["block_size"]:
        raise ConfigError(f"no default block size: whole rows of compress rates {', '.join(map(str, rates))} need "
                          f"blocks of {size:,} tokens, above kvbridge's bound of {BOUNDS['block_size']:,}")
    return size


__all__ = ["SHAPES", "SideShape", "default_block_size"]

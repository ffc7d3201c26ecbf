"""Stray fields: does `kvbridge plan` describe what transformers builds when a config.json carries
fields its architecture does not read (copied from a sibling architecture's config)?

For each causal-LM architecture (its sweep tiny config, `model_sweep.tiny_config`) and each group
of `STRAYS` whose fields the architecture's config class does not define, the fields are added,
the tiny model is built from that config and runs a prefill, and the spec kvbridge reads from the
same config.json must hold that cache exactly: every layer's KV heads, head widths and recurrent
state shapes are checked by exporting the prefill cache into one rank's paged cache (the proof's
own bridge, `hf_cache.export_cache`, which refuses any shape the spec does not describe). The
outcome per (architecture, group) is a `StrayRow`: `ok` (the spec holds the cache), `mismatch`
(kvbridge planned another geometry than the model builds: a bug), `refused` (kvbridge refused the
config in one line although transformers runs it: a bug unless the stray field truly changes the
model) or `unbuildable` (transformers itself cannot build or run the model with that field).
`scripts/models_sweep.py` runs every moved architecture; tests run a bounded sample.

Besides a sibling's fields, the sweep sets the architecture's *own* fields to other values than
the tiny config's, where a class can read them one way and its modeling code another:

* `own_kv_heads` / `own_head_dim`: its KV-head and head-width fields (and their per-layer-kind
  copies under a prefix, `swa_num_key_value_heads`, at yet another value), so that every layer
  kind's heads and widths are checked at sizes where a wrong derivation shows (MiMo-V2's sliding
  layers with keys of 24 against values of 16: read from the output projection, 8 query heads);
* `flip_<field>`: each boolean field of the class (not `PretrainedConfig`'s own, not `FLIP_SKIP`:
  those shape no cache) toggled, so that a field the class ignores under one switch and reads
  under the other is exercised both ways (Falcon's `num_kv_heads` with `new_decoder_architecture`:
  6 KV heads computed, 12 cached).
"""

from __future__ import annotations

import io
import random
from contextlib import redirect_stderr
from dataclasses import asdict, dataclass
from typing import Any

# Fields that sibling architectures define, grouped so that each group is one plausible copy: values
# that differ from the tiny configs' own (12 query heads of 8 over a hidden size of 96).
STRAYS: dict[str, dict[str, Any]] = {
    "gqa": {"num_key_value_heads": 6},  # Llama-family GQA, into an MHA or fused-QKV architecture
    "kv_heads": {"num_kv_heads": 4},  # Falcon's spelling
    "head_dim": {"head_dim": 16},  # Gemma/Qwen3's explicit width, into one that derives hidden / heads
    "mqa": {"multi_query": True},  # GPT-BigCode / Falcon-7B's flag
    "v_head_dim": {"v_head_dim": 16},  # MLA / MiMo's value width
    "mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16},  # DeepSeek's latent
    "gdn": {"linear_num_key_heads": 6, "linear_num_value_heads": 12, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4},  # Qwen3-Next's mixer sizes
    "mamba2": {"mamba_n_heads": 12, "mamba_n_groups": 6, "mamba_d_state": 8, "mamba_d_head": 16,
               "mamba_d_conv": 4},  # Nemotron-H / Bamba's mixer sizes
}
# The architecture's own fields at other values than the tiny config's (12 query heads, 6 KV heads of 8).
_KV_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads")
OWN: dict[str, tuple[tuple[str, ...], int, int]] = {  # group: (fields, value, value of a per-kind copy)
    "own_kv_heads": (_KV_FIELDS, 4, 3),
    "own_head_dim": (("head_dim",), 24, 16),
}
# Boolean fields that shape no cache (or make a model that keeps none, which is not the question here).
FLIP_SKIP = frozenset({
    "tie_word_embeddings", "use_cache", "output_router_logits", "is_decoder", "add_cross_attention",
    "is_encoder_decoder", "return_dict", "torchscript", "use_return_dict", "use_mambapy", "use_mamba_kernels",
    "use_mem_eff_path", "summary_use_proj", "summary_proj_to_labels", "is_encoder", "use_mems_eval", "use_mems_train",
})
PROMPT_LEN = 12
SECONDS = 120


@dataclass
class StrayRow:
    arch: str
    group: str
    status: str  # ok | mismatch | refused | unbuildable | skipped | error
    detail: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _defaults(arch: str) -> dict[str, Any] | None:
    from transformers import CONFIG_MAPPING
    try:
        return CONFIG_MAPPING[arch]().to_dict()
    except Exception:  # noqa: BLE001 - classes that cannot be built bare: the tiny config says
        return None


def stray_groups(arch: str, own: bool = True, flips: bool = True) -> list[str]:
    """The groups of `STRAYS` whose every field the architecture's config class leaves undefined;
    then (`own`) the groups of `OWN` with a field the class defines, and (`flips`) one `flip_<field>`
    per boolean field of the class (see the module doc)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig
    cls = CONFIG_MAPPING[arch]
    defaults = _defaults(arch)
    if defaults is None:
        return []
    names = set(defaults) | set(getattr(cls, "attribute_map", {}) or {})
    groups = [g for g, fields in STRAYS.items() if not names & set(fields) and not any(hasattr(cls, f) for f in fields)]
    if own:
        mla = defaults.get("kv_lora_rank") is not None  # an MLA class's head_dim is its rope part
        groups += [g for g, (fields, _, _) in OWN.items() if _own_fields(defaults, fields)
                   and not (mla and g == "own_head_dim")]
    if flips:
        base = set(PretrainedConfig().to_dict())
        groups += [f"flip_{k}" for k, v in defaults.items() if isinstance(v, bool) and k not in base
                   and k not in FLIP_SKIP and not k.startswith("_")]
    return groups


def _own_fields(defaults: dict[str, Any], fields: tuple[str, ...]) -> list[str]:
    """The fields of `fields` the class defines, and their per-layer-kind copies (`swa_head_dim`;
    as the tiny config reads them: a field with a tiny size of its own, `v_head_dim`, is no copy)."""
    from kvbridge.proofs.model_sweep import TINY
    return [k for k in defaults if k in fields or (k not in TINY and any(k.endswith("_" + f) for f in fields))]


def group_fields(arch: str, group: str, base: dict[str, Any]) -> dict[str, Any]:
    """The fields a group sets on the tiny config `base` of `arch` (a dict of its fields)."""
    if group in STRAYS:
        return dict(STRAYS[group])
    if group.startswith("flip_"):
        key = group[len("flip_"):]
        return {key: not base.get(key)}
    fields, value, per_kind = OWN[group]
    return {k: value if k in fields else per_kind for k in _own_fields(_defaults(arch) or base, fields)}


def check_stray(arch: str, group: str, seed: int = 0, timeout: int = SECONDS) -> StrayRow:
    """The tiny `arch` with the fields of `group` (`group_fields`) set: does kvbridge's spec hold its cache?"""
    import torch
    from transformers import AutoModelForCausalLM

    from kvbridge.core.layout import EngineLayout
    from kvbridge.errors import KVBridgeError
    from kvbridge.models import spec_from_hf_config
    from kvbridge.proofs.hf_cache import export_cache
    from kvbridge.proofs.model_sweep import one_line, SweepTimeout, Unbuildable, row_outcome, tiny_config
    from kvbridge.proofs.proof import prefill
    from kvbridge.proofs.verify import random_request
    from kvbridge.transport.cache import RankCache

    row = StrayRow(arch, group, "error")
    with row_outcome(row, timeout):
        base = tiny_config(arch)
        raw = {**base.to_dict(), **group_fields(arch, group, base.to_dict())}
        try:  # the class's own validation may reject the fields: transformers cannot build it either
            config = type(base)(**{k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")})
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            vocab = int(config.get_text_config(decoder=True).vocab_size)
            special = {getattr(config, "pad_token_id", None)}
            ids = [t for t in random.Random(seed).sample(range(vocab), PROMPT_LEN + 2) if t not in special][:PROMPT_LEN]
            cache, _ = prefill(model, ids)
        except (SweepTimeout, KVBridgeError):
            raise
        except Exception as e:  # noqa: BLE001 - transformers cannot run the model with this field
            raise Unbuildable(one_line(e)) from None
        with redirect_stderr(io.StringIO()):  # the warnings are the CLI's business; the geometry is checked here
            spec = spec_from_hf_config(raw, view="transformers", dtype="float32")
        layout = EngineLayout(tp_size=1, block_size=16, num_blocks=max(4, 2 * len(spec.groups) + 2))
        ranks = RankCache.allocate_engine(spec, layout, fill=None)
        request = random_request(spec, layout, layout, PROMPT_LEN, 0, random.Random(seed))
        try:
            export_cache(cache, spec, ranks, request.src_block_ids, PROMPT_LEN)
        except KVBridgeError as e:
            row.status, row.detail = "mismatch", one_line(e)
            return row
        row.status = "ok"
    return row


def sweep_strays(archs: list[str], echo: Any = None) -> list[StrayRow]:
    rows = []
    for arch in archs:
        for group in stray_groups(arch):
            row = check_stray(arch, group)
            rows.append(row)
            if echo:
                echo(row)
    return rows


def render_strays(rows: list[StrayRow]) -> str:
    """The docs/models.md section of a stray-field sweep: counts, then every row that is not ok."""
    from collections import Counter

    counts = Counter(r.status for r in rows)
    archs = len({r.arch for r in rows})
    lines = [
        "## Stray fields: does plan describe what transformers builds?",
        "",
        (f"Each moved architecture's tiny config with the fields of a sibling architecture added (only fields its "
         "class does not define), its own KV-head and head-width fields (and their per-layer-kind copies) at other "
         "values, and each of its boolean fields toggled "
         f"({len(rows)} cases over {archs} architectures), the model built and run from that "
         "config, and its prefill cache exported through the spec kvbridge reads from the same config "
         "(`kvbridge.proofs.stray_sweep`): **ok** the spec holds every layer's cache exactly, **mismatch** kvbridge "
         "planned another geometry (a bug), **refused** kvbridge refused a config transformers runs, **unbuildable** "
         "transformers itself cannot run the model with that field."),
        "",
        "| fields | from |", "|---|---|",
        *[f"| {g}: {', '.join(f'`{k}`' for k in fields)} | {_FROM[g]} |" for g, fields in STRAYS.items()],
        *[f"| {g}: {', '.join(f'`{k}`' for k in fields)} = {value} (a per-kind copy, `swa_{fields[0]}`: {kind}) | "
          "the class's own |" for g, (fields, value, kind) in OWN.items()],
        "| flip_*field*: a boolean field toggled | the class's own |",
        "",
        "| result | count |", "|---|---|",
        *[f"| {k} | {counts.get(k, 0)} |" for k in ("ok", "mismatch", "refused", "error", "unbuildable", "skipped")],
        "",
    ]
    rest = [r for r in rows if r.status != "ok"]
    if rest:
        lines += ["| architecture | stray | fields | result | detail |", "|---|---|---|---|---|"]
        lines += [f"| {r.arch} | {r.group} | {', '.join(f'`{k}`' for k in _fields_named(r))} | {r.status} | "
                  f"{r.detail.replace('|', '/')} |" for r in rest]
    return "\n".join(lines) + "\n"


def _fields_named(row: StrayRow) -> list[str]:
    if row.group in STRAYS:
        return list(STRAYS[row.group])
    if row.group.startswith("flip_"):
        return [row.group[len("flip_"):]]
    defaults = _defaults(row.arch)
    return _own_fields(defaults, OWN[row.group][0]) if defaults else list(OWN[row.group][0])


_FROM = {"gqa": "Llama-family GQA", "kv_heads": "Falcon", "head_dim": "Gemma / Qwen3", "mqa": "GPT-BigCode / Falcon-7B",
         "v_head_dim": "DeepSeek MLA / MiMo", "mla": "DeepSeek-V2/V3", "gdn": "Qwen3-Next", "mamba2": "Nemotron-H / Bamba"}

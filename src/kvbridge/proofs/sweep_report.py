"""docs/models.md, the zoo sweep's report: written by `scripts/models_sweep.py` from the rows of
`model_sweep.sweep_one` (and the stray-field rows of `stray_sweep`), and read back to merge a
re-run subset without sweeping everything again. Apart from the sweep: text, not a proof."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from kvbridge.proofs.model_sweep import NEW_TOKENS, NUM_LAYERS, PAIRS, PROMPT_LEN, SweepRow
from kvbridge.proofs.stray_sweep import render_strays

TP_RULES = """\
## State kinds and how each is sharded over TP

Each kind is split the way vLLM splits it (both sides of a move use the same rule; a TP pair is
allowed when, per component, one of the unit count and the TP size divides the other, and ranks
beyond the units hold replicas):

| kind | what transformers caches | units sharded over TP |
|---|---|---|
| full | `DynamicLayer`: K and V `[heads, tokens, dim]` (key dim may differ from value dim) | KV heads (MQA: one head, replicated) |
| sliding | `DynamicSlidingWindowLayer`: the last `window - 1` tokens | KV heads |
| chunked (Llama 4) | `DynamicSlidingWindowLayer` with the chunk size as its window | KV heads |
| mla | `DynamicLayer` holding the normalized latent and the rope part, one head each | none: every rank holds the whole latent |
| sliding mla (dots3) | `DynamicSlidingWindowLayer` holding the same two tensors for the last `window - 1` tokens | none, as mla; only the window's tokens move (vLLM `SlidingWindowMLASpec`) |
| mamba1 | conv `[intermediate, kernel]`, SSM `[intermediate, d_state]` | expanded channels (vLLM `mamba1_state_shape`) |
| mamba2 | conv `[x \\| B \\| C, kernel]`, SSM `[heads, head_dim, d_state]` | x and SSM by heads, B and C by groups (replicated when TP > groups, vLLM `mamba_mixer2`) |
| gdn | conv `[Q \\| K \\| V, kernel]`, state `[v_heads, k_dim, v_dim]` | Q, K by key heads; V and state by value heads (vLLM `qwen3_next`) |
| short_conv | conv `[hidden, L_cache]` | hidden channels (vLLM `short_conv`) |
| attention+state (Zamba2, Falcon-H1) | `LinearAttentionAnd{Full,SlidingWindow}AttentionLayer`: K/V and a recurrent state in one layer | two logical layers, each by its own rule (vLLM registers an attention and a Mamba cache per such decoder layer) |
| mla indexer (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, Qwen4-Exp) | `DynamicIndexedLayer`: the attention K/V (MLA latent or heads), plus indexer keys `[tokens, index_head_dim]` | the indexer is a layer of its own after its attention, one row per token held whole by every rank (vLLM `DeepseekV32IndexerCache`, an `MLAAttentionSpec` of one KV head); a layer reusing another's selection (HY-V4 "shared") keeps none |
| kda (Kimi-Linear, Bailing hybrid) | conv `[Q \\| K \\| V, kernel]`, state `[heads, head_dim, head_dim]` | heads, Q, K, V and state alike (vLLM `kda_state_shape`) |
| mamba1_heads (Zamba) | conv `[intermediate, kernel]`, SSM `[heads, head_dim, d_state]` | Mamba heads, conv channels with their head (no vLLM model; derived: the mixer's x_proj / dt_proj are per head) |
| lightning (MiniMax-Text-01) | `MiniMaxCache.linear_cache`: no conv, state `[heads, head_dim, head_dim]` (its decayed K^T V), beside `DynamicLayer` K/V | heads (vLLM `linear_attention_state_shape`, each rank its heads' decay slopes) |
| rglru (RecurrentGemma) | nothing in a cache: the module keeps conv `[lru_width, kernel - 1]` and a float32 state `[lru_width]` as attributes; the proof copies them into the layer's `LinearAttentionLayer` after the prefill and back onto a model's modules before decoding (`module_state.py`) | RG-LRU gate blocks (`num_attention_heads` of `lru_width / heads`; no vLLM model: derived, the gates are block-diagonal) |
| cca (ZAYA) | attention+state layer: K/V, then conv `[Q \\| K, (t0-1)+(t1-1)]` (that many columns in both views) and the last token's delayed value projection `[kv_heads * head_dim / 2]` | Q heads, K and the delayed value by KV head (no vLLM model; derived: the grouped conv's groups are whole heads, `v_proj_delayed` splits by KV head like `v_proj_current`) |
| kv_conv (Inkling, Inkling-2) | attention+state layer: K/V, then `number_of_conv_states` conv states, each its own tensor: K conv `[kv_heads * key_dim, kernel]`, V conv, then residual-stream convs `[hidden, kernel]`, all float32 | K and V convs by the layer's KV heads like K/V; residual-stream convs whole on every rank (no vLLM model; derived: the K/V convs are depthwise per KV head, the others follow the all-reduced output projections) |
| rwkv (RWKV) | nothing in a cache layer: the forward returns `state`, 5 tensors `[batch, hidden, layers]`, viewed per layer as one recurrent state per component: token shifts `ffn_x`, `att_x` `[hidden]` (model dtype), WKV `att_num`, `att_den`, `att_max` `[hidden]` (float32) | WKV state by channel, token shifts whole on every rank (no vLLM model; derived: key / value / receptance are column-parallel, the WKV recurrence is per channel, and the shifts are the whole input of those projections) |
| mlstm (xLSTM) | nothing in a cache layer: the forward returns an `xLSTMCache` (not a transformers `Cache`) whose `rnn_state` holds per layer `C` `[heads, qk_head_dim, v_head_dim]`, `n` `[heads, qk_head_dim]`, `m` `[heads, 1]` (model dtype), viewed per layer as one recurrent state per component | heads, C, n and m alike (no vLLM model; derived: q / k / v, the output gate and the per-head input / forget gates are column-parallel by head, the recurrence and its norm per head, `out_proj` row-parallel) |
| compressed (DeepSeek-V4) | `DeepseekV4HCACache` / `DeepseekV4CSACache`: K=V window rows, per compressor (`compressor`, `indexer`) one compressed row per `compress_rate` tokens, the open window's raw rows and gates, overlaps (CSA) | the window and each compressor's rows are mla layers (one row per `compress_rate` tokens: vLLM `tokens_per_state`), held whole by every rank; the open window is a recurrent layer of replicated components (vLLM `CircularBufferSpec`); CP refused |
| looped (Dory) | per-loop K/V: the forward appends `n_recurrent_loops - 1` copies of the looped layers' cache layers after the model's own | each copy by its layer's own rule (the spec appends the same copies, `models/looped.py`) |
| stateless | `DummyLayer` (MLP / MoE blocks of Nemotron-H, layers reading another layer's K/V): nothing | nothing to shard: no components, no group, no region (vLLM allocates no cache for it) |

Serving engines keep `kernel - 1` conv columns, transformers `kernel`; `spec_from_hf_config(view=...)`
describes either.
"""


NOTES = """\
## Reading the table

* **moved**: both pairs bit-exact (every cache tensor, and the greedy tokens equal plain `generate`).
* **refused**: one line; from the spec it names the layer and its kind (`indexed_attention`,
  `hybrid`, an unknown recurrent mixer...); from the proof, its reason (for example a
  model whose forward returns no per-layer cache: GPT-1, XLM, XLNet's memories, Reformer's buckets).
* **mismatch**: the proof ran and something differed (a kvbridge bug).
* **error**: kvbridge or the proof failed on an architecture transformers runs (a bug to fix).
  The reason is shown.
* **unbuildable**: transformers itself cannot build the model from a tiny config of its own class
  or cannot `generate` with it (checked before kvbridge is asked); its error is shown.
* **skipped**: multimodal wrappers; their text model is a row of its own.
"""


DUMP = """\
## The decode-cache dump (`kvbridge demo --dump-decode-cache FILE`)

The decode engine's cache, imported back into transformers, as one safetensors file; the sweep
writes it for every architecture it moves and reads it back bit for bit. One naming rule,
`layers.{layer}.{tensor}` with `layer` the transformers cache layer:

| tensor | what |
|---|---|
| `keys`, `values` | attention K/V `[1, heads, tokens held, dim]` (MLA: the latent and the rope part) |
| `indexer_keys`, `indexer_position_ids` | a sparse-attention indexer's keys (DeepSeek-V3.2) and its position history |
| `conv_states.{j}`, `recurrent_states.{j}` | recurrent state `j` of the layer, always indexed: `.0` for a layer with one state, `.0`, `.1`, ... for several (Inkling's K, V and residual convs) |
| `{compressed_kv,buffer_kv,buffer_gate,overlap_kv,overlap_gate}.{compressor}`, `entry_count.{compressor}` | a compressed layer's rows per compressor (DeepSeek-V4) |

Every name is its own copy. Where the cache keeps one tensor under two names (DeepSeek-V4's window
layers hold K and V as one tensor) each name is written as a clone, and the file's metadata maps
the second name to the first (`"layers.3.values": "layers.3.keys"`).
"""


def parse_markdown(text: str) -> tuple[list[SweepRow], float]:
    """The rows and total seconds of a docs/models.md that `render_markdown` wrote (to merge a re-run
    subset into it without sweeping everything again)."""
    seconds = float(m.group(1)) if (m := re.search(r"MAPPING_NAMES`\) in (\d+) s", text)) else 0.0
    rows = []
    for m in re.finditer(r"^\| (\S+) \| ([^|]*) \| (moved|refused|mismatch|error|unbuildable|skipped) \| (.*) \|$", text, re.MULTILINE):
        arch, kinds, status, why = m.groups()
        moved = status == "moved"
        rows.append(SweepRow(arch, status, "" if kinds == "-" else kinds, "" if moved else why,
                             why.split(", ") if moved else []))
    return rows, seconds


def render_markdown(rows: list[SweepRow], version: str, seconds: float, strays: list[Any] | None = None) -> str:
    counts = Counter(r.status for r in rows)
    lines = [
        "# Models: every causal LM of the installed transformers",
        "",
        "Generated by `scripts/models_sweep.py` (`make models`); do not edit by hand.",
        f"transformers {version}; {len(rows)} architectures (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) in {seconds:.0f} s.",
        "",
        "Each architecture: a tiny random config (its config class's defaults, sizes shrunk, "
        f"{NUM_LAYERS} layers with every layer kind kept), its spec, the model saved with `save_pretrained` "
        "(its config.json read back as `kvbridge plan DIR` reads it, to the same geometry) and the transformers proof "
        f"from that directory, as `kvbridge demo --model DIR` runs it ({PROMPT_LEN}-token prompt, {NEW_TOKENS} new "
        "tokens; greedy tokens and every cache bit compared with plain `generate`) on "
        + " and ".join(f"`{p[0]}`" for p in PAIRS) + ".",
        "",
        "| status | count |", "|---|---|",
        *[f"| {k} | {counts.get(k, 0)} |" for k in ("moved", "refused", "mismatch", "error", "unbuildable", "skipped")],
        "",
        TP_RULES,
        NOTES,
        DUMP,
        "## Every architecture",
        "",
        "| architecture | layer kinds | result | pairs / why not |", "|---|---|---|---|",
    ]
    for r in rows:
        why = ", ".join(r.pairs) if r.status == "moved" else r.detail.replace("|", "/")
        lines.append(f"| {r.arch} | {r.kinds or '-'} | {r.status} | {why} |")
    text = "\n".join(lines) + "\n"
    if strays:
        text += "\n" + render_strays(strays)
    return text

__all__ = ["DUMP", "NOTES", "TP_RULES", "parse_markdown", "render_markdown"]

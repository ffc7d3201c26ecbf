"""Would vLLM's own P/D connectors accept this engine pair? The rules, written down, with no vLLM import.

`kvbridge plan` shows this beside its own plan so a user sees what kvbridge adds. The rules are
those of vLLM's NixlConnector (pull mode) and MooncakeConnector as recorded in our reference
notes on vLLM's source (`shared/reference/topology.md` §2.7-2.11, `mooncake_plan.md`,
`anchors.md`): each refusal names the rule and, where the notes have one, the vLLM issue. A
pair these rules accept may still fail inside vLLM for reasons the notes do not cover (backend
support, hardware); a pair they refuse is refused by vLLM's code (an assertion or a handshake
check), never silently corrupted by kvbridge.
"""

from __future__ import annotations

from typing import NamedTuple

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec


class Verdict(NamedTuple):
    """A vLLM connector's answer for a pair: accepted, or the rules that refuse it."""

    connector: str
    reasons: tuple[str, ...]
    conditions: tuple[str, ...] = ()  # accepted only with these settings

    @property
    def accepts(self) -> bool:
        return not self.reasons

    def describe(self) -> str:
        if self.reasons:
            return f"{self.connector}: refuses: " + "; ".join(self.reasons)
        return f"{self.connector}: accepts" + (f" (with {'; '.join(self.conditions)})" if self.conditions else "")


def _tp_divides(p: EngineLayout, d: EngineLayout) -> str | None:
    lo, hi = sorted((p.tp_size, d.tp_size))
    if hi % lo:
        return f"TP {p.tp_size} -> {d.tp_size}: one TP size must divide the other (vLLM's tp_ratio asserts)"
    return None


def _block_sizes(layout: EngineLayout, spec: ModelSpec) -> tuple[int, ...]:
    return tuple(layout.group_block_size(g) for g in range(len(spec.groups)))


def _same_dtype(spec: ModelSpec, p: EngineLayout, d: EngineLayout) -> str | None:
    sp, sd = p.engine_spec(spec).dtype, d.engine_spec(spec).dtype
    if sp != sd:
        return f"KV dtype {sp} -> {sd}: vLLM moves bytes unchanged and its compatibility hash requires one cache_dtype"
    if p.kv_scales != d.kv_scales:
        return "different KV scales: vLLM transfers no scales and assumes the same static scales on both sides"
    return None


def _hybrid(spec: ModelSpec) -> bool:
    return spec.has_recurrent or len(spec.groups) > 1


_UNCOVERED = "the caveat that our notes on vLLM do not cover layers keeping one row per several tokens (DeepSeek-V4)"


def nixl_verdict(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout) -> Verdict:
    """vLLM NixlConnector, pull mode (the decode side reads)."""
    reasons: list[str] = []
    conditions: list[str] = []
    for reason in (_tp_divides(prefill, decode), _same_dtype(spec, prefill, decode)):
        if reason:
            reasons.append(reason)
    pb, db = _block_sizes(prefill, spec), _block_sizes(decode, spec)
    if pb != db:
        if _hybrid(spec):
            reasons.append(f"block sizes {'/'.join(map(str, pb))} -> {'/'.join(map(str, db))}: with several KV-cache "
                           f"groups (hybrid allocator) the block-size ratio must be 1 (vLLM #42895)")
        elif any(d % p for p, d in zip(pb, db)) or pb[0] > db[0]:
            reasons.append(f"block size {pb[0]} -> {db[0]}: only a prefill block that divides the decode block "
                           f"(\"only nP < nD supported\")")
        elif prefill.tp_size > decode.tp_size:
            reasons.append(f"block size {pb[0]} -> {db[0]} with prefill TP > decode TP: the block ratio must be 1")
    if prefill.pp_size > 1 or decode.pp_size > 1:
        reasons.append("pipeline parallel: pull mode refuses PP (vLLM #43366, #52913); push mode takes prefill PP to "
                       "a decode without PP on non-hybrid models")
    for side, layout in (("prefill", prefill), ("decode", decode)):
        if layout.dcp_size not in (1, layout.tp_size):
            reasons.append(f"{side} DCP {layout.dcp_size}: vLLM supports DCP 1 or DCP = TP ({layout.tp_size}) only")
        if layout.pcp_size > 1:
            reasons.append(f"{side} PCP {layout.pcp_size}: context parallel across ranks (PCP) is not a NixlConnector "
                           f"feature")
    if prefill.dcp_size > 1 and not spec.is_mla:
        reasons.append(f"prefill DCP {prefill.dcp_size}: a DCP-sharded source is read for MLA models only")
    if prefill.kv_order != decode.kv_order:
        conditions.append(f"{prefill.kv_order} -> {decode.kv_order} needs enable_permute_local_kv (receive-side permute)")
    if spec.row_rates:
        conditions.append(_UNCOVERED)
    return Verdict("vLLM NixlConnector (pull)", tuple(reasons), tuple(conditions))


def mooncake_verdict(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout) -> Verdict:
    """vLLM MooncakeConnector (the prefill side writes)."""
    reasons: list[str] = []
    for reason in (_tp_divides(prefill, decode), _same_dtype(spec, prefill, decode)):
        if reason:
            reasons.append(reason)
    if _block_sizes(prefill, spec) != _block_sizes(decode, spec):
        reasons.append("different block sizes: the Mooncake connector moves whole blocks of one size")
    if prefill.kernel_size != prefill.block_size or decode.kernel_size != decode.block_size:
        reasons.append("kernel block size != block size: open in the Mooncake RFC (physical block != config block)")
    if prefill.kv_order != decode.kv_order:
        reasons.append(f"{prefill.kv_order} -> {decode.kv_order}: mixed layouts are unsupported (vLLM #36948)")
    for side, layout in (("prefill", prefill), ("decode", decode)):
        if layout.cp_size > 1:
            reasons.append(f"{side} context parallel (CP {layout.cp_size}): not a MooncakeConnector feature")
    if spec.has_recurrent and prefill.tp_size != decode.tp_size:
        reasons.append("recurrent state with different TP: open in vLLM (#53078)")
    return Verdict("vLLM MooncakeConnector", tuple(reasons), (_UNCOVERED,) if spec.row_rates else ())


def vllm_verdicts(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout) -> tuple[Verdict, ...]:
    return nixl_verdict(spec, prefill, decode), mooncake_verdict(spec, prefill, decode)


__all__ = ["Verdict", "mooncake_verdict", "nixl_verdict", "vllm_verdicts"]

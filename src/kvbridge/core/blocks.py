"""Logical vs kernel blocks and vLLM's prefix-cache trimming, for engines that speak vLLM's ids.

kvbridge's own planner takes *logical* block ids on both sides plus token counts and works at
token granularity, so it never needs these rules: different kernel ratios, partial prefix hits
and recurrent groups are exact by construction. These functions exist for peers that exchange
vLLM's kernel-granular id lists (and as the reference the tests check vLLM's vectors against).

Recurrent (Mamba / GDN / short-conv) groups are never expanded: one logical block holds one
whole state.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvbridge.errors import InvalidRequest


def compute_physical_blocks_per_logical(ssm_sizes: Sequence[int], block_len: int) -> int:
    """Kernel blocks one logical block must span so that a whole recurrent state fits its page."""
    if block_len <= 0:
        raise InvalidRequest(f"block_len must be positive, got {block_len}")
    return -(-sum(ssm_sizes) // block_len)


def logical_to_kernel_block_ids(block_ids: Sequence[Sequence[int]], ratio: int,
                                recurrent_groups: Collection[int] = ()) -> list[list[int]]:
    """Expand logical ids to kernel ids with `ratio` kernel blocks per logical block.

    For a *remote* engine's ids pass the **remote** ratio (stride and count): using the local
    ratio reads the wrong memory (vLLM's Qwen3.5 4P2D corruption).
    """
    if ratio < 1:
        raise InvalidRequest(f"kernel blocks per logical block must be >= 1, got {ratio}")
    if ratio == 1:
        return [list(ids) for ids in block_ids]
    return [list(ids) if g in recurrent_groups else [b * ratio + j for b in ids for j in range(ratio)]
            for g, ids in enumerate(block_ids)]


def apply_prefix_caching(local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]],
                         local_ratio: int = 1, remote_ratio: int = 1, recurrent_groups: Collection[int] = (),
                         has_recurrent: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Align kernel id lists after a local (destination) prefix-cache hit, as vLLM does.

    Without recurrent state: keep the last `len(local)` remote ids (a local group with no ids
    takes none; vLLM's slice would keep them all). With recurrent state: a recurrent group with
    fewer local ids keeps only the last remote id; attention groups with equal ratios end-trim;
    otherwise both sides are front-trimmed to the shorter length, which is only right without a
    prefix hit — hence `check_prefix_caching` at handshake.
    """
    if len(local_ids) != len(remote_ids):
        raise InvalidRequest(f"local has {len(local_ids)} KV-cache groups, remote {len(remote_ids)}")
    out_local, out_remote = [], []
    for g, (loc, rem) in enumerate(zip(local_ids, remote_ids)):
        loc, rem = list(loc), list(rem)
        nl, nr = len(loc), len(rem)
        if not has_recurrent:
            if nl > nr:
                raise InvalidRequest(f"group {g}: {nl} local block ids but only {nr} remote ones")
            out_local.append(loc)
            out_remote.append(rem[nr - nl:] if nl else [])
            continue
        if g in recurrent_groups and nl < nr:
            if nl != 1:
                raise InvalidRequest(f"group {g}: a recurrent group holds one local block, got {nl}")
            out_local.append(loc)
            out_remote.append(rem[-1:])
        elif local_ratio == remote_ratio and nl < nr:
            out_local.append(loc)
            out_remote.append(rem[nr - nl:] if nl else [])
        else:
            padding = max(local_ratio, remote_ratio)
            if abs(nl - nr) >= padding:
                raise InvalidRequest(f"Group {g}: |{nl} - {nr}| >= max_padding {padding}")
            n = min(nl, nr)
            out_local.append(loc[:n])
            out_remote.append(rem[:n])
    return out_local, out_remote


def check_prefix_caching(local_ratio: int, remote_ratio: int, has_recurrent: bool, prefix_caching: bool) -> None:
    """Refuse what vLLM's kernel-id protocol cannot move: a hybrid model whose engines differ in
    kernel blocks per logical block, with prefix caching on (front-trimming pairs a remote prefix
    with a local suffix: silent corruption)."""
    if has_recurrent and prefix_caching and local_ratio != remote_ratio:
        raise RuntimeError(
            f"Prefix caching with heterogeneous physical_blocks_per_logical is not supported for hybrid "
            f"(Mamba) models when block ids are exchanged as kernel ids. Local: {local_ratio}, Remote: "
            f"{remote_ratio}. Disable prefix caching (--no-enable-prefix-caching), or exchange logical block "
            f"ids, which kvbridge plans at token granularity.")

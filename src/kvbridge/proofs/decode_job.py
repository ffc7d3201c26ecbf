"""What decode rank 0 does after the transfer: gather every rank's cache and prove it with a model.

The proof is `proof.prove_cache`, the one every demo makes, here across processes: rank 0's
own cache plus the other ranks' region bytes gathered through the parent are the decode
engine's ranks. The reference runs in this process too, with the same weights (built-in models
are drawn from the seed) and one thread like every rank process, so it is comparable bit for bit.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from kvbridge.proofs.proof import greedy_config, prove_cache
from kvbridge.proofs.tiny_models import load_model
from kvbridge.transport.cache import TORCH_DTYPES, RankCache


def gathered_caches(own: RankCache, others: dict[int, list[np.ndarray]]) -> list[RankCache]:
    """Rank 0's live cache plus the other ranks' caches rebuilt from their region bytes, in rank order."""
    spec, layout = own.spec, own.layout
    caches = {own.rank: own}
    dtype = TORCH_DTYPES[spec.dtype]
    for rank, regions in others.items():
        tensors = [torch.from_numpy(np.ascontiguousarray(r)).view(dtype) for r in regions]
        caches[int(rank)] = RankCache(spec, layout, int(rank), tensors)
    return [caches[r] for r in sorted(caches)]


@torch.inference_mode()
def run_decode_job(own: RankCache, job: dict[str, Any]) -> dict[str, Any]:
    """Per request id: reference tokens, disaggregated tokens, cache and replica differences
    (the fields of `CacheProof`)."""
    model, _ = load_model(job["model"], job["seed"])
    model.generation_config = greedy_config()
    caches = gathered_caches(own, job.get("others", {}))
    out: dict[str, Any] = {}
    for i, req in enumerate(job["requests"]):
        first = req.get("first_token")
        proof = prove_cache(model, list(req["prompt_ids"]), caches, tuple(tuple(g) for g in req["block_ids"]),
                            int(job["new_tokens"]), first_token=None if first is None else int(first),
                            dump=(job.get("dump") or None) if i == 0 else None)
        out[req["id"]] = msgspec.structs.asdict(proof)
    return out


__all__ = ["gathered_caches", "run_decode_job"]

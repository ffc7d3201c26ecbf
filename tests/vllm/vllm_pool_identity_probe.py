"""Probe, run with .venv-vllm's python: the pool keys of real vLLM `Request`s, next to vLLM's own block hashes.

Why: `kvbridge.integrations.vllm.pool_identity.request_pool_keys` must separate exactly what
vLLM's prefix cache separates (cache salt, LoRA adapter, multimodal items, prompt embeds) and
nothing else, or the shared pool would serve one tenant's, adapter's or image's KV to another.
So the requests here are vLLM's own `vllm.v1.request.Request` objects (no mocks), built the way
vLLM's engine builds them, and every case prints both the pool keys and the hashes vLLM's own
`get_request_block_hasher` gives the same request at the same block size: the test checks the
pool keys against kvbridge's plain chain and against vLLM's notion of "same KV".

Prints one JSON object: {"vllm_version", "block_tokens", "cases": {name: {"tokens", "pool", "vllm"}}}
with keys and hashes in hex.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

BT = 16  # pool block tokens, and vLLM's hash block size, so the blocks line up one to one
N = 64  # tokens per request: four blocks
BASE = list(range(1000, 1000 + N))
IMG = 32000  # an image placeholder token id
MM_TOKENS = BASE[:16] + [IMG] * 32 + BASE[48:]  # placeholders over tokens 16..47
HIDDEN = 8  # width of the prompt embeddings


def _request(rid: str, tokens: list[int] | None, hasher: Any, *, sampling: Any = None, **kw: Any) -> Any:
    """A real vLLM request, hashed by vLLM's own block hasher at construction (as the engine does)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = sampling if sampling is not None else SamplingParams(max_tokens=8)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   block_hasher=hasher, **kw)


def _image(identifier: str, offset: int, length: int = 16) -> Any:
    """One image item as the engine core receives it (data None: already in the encoder cache)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def build_cases(hasher: Any) -> dict[str, Any]:
    """Name -> Request. Groups compared by the test share token ids, so only the extras differ."""
    import torch
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(N, HIDDEN, generator=gen)
    embeds_row40 = embeds.clone()
    embeds_row40[40, 3] += 1.0  # one row of block 2 differs

    lora_a = LoRARequest("adapter-a", 1, "/adapters/a")
    lora_b = LoRARequest("adapter-b", 2, "/adapters/b")
    lora_a_moved = LoRARequest("adapter-a", 1, "/adapters/a-v2")  # same name, re-pointed at other weights

    r = _request
    return {
        # 1 and 6: plain requests; request id, sampling, priority, arrival, client are not identity
        "plain": r("plain-1", BASE, hasher),
        "plain_again": r("plain-2", list(BASE), hasher),
        "plain_other_meta": r("other-id", list(BASE), hasher, priority=5, arrival_time=123.0, client_index=3,
                              sampling=SamplingParams(max_tokens=3, temperature=0.7, top_p=0.5, seed=9,
                                                      extra_args={"kv_transfer_params": {"x": 1}})),
        # 2: cache salt
        "salt_a": r("salt-a", BASE, hasher, cache_salt="a"),
        "salt_a_again": r("salt-a2", list(BASE), hasher, cache_salt="a"),
        "salt_b": r("salt-b", BASE, hasher, cache_salt="b"),
        # 3: LoRA
        "lora_a": r("lora-a", BASE, hasher, lora_request=lora_a),
        "lora_a_again": r("lora-a2", list(BASE), hasher, lora_request=LoRARequest("adapter-a", 1, "/adapters/a")),
        "lora_b": r("lora-b", BASE, hasher, lora_request=lora_b),
        "lora_a_moved": r("lora-a-moved", BASE, hasher, lora_request=lora_a_moved),
        # 4: multimodal, same placeholder ids; the item spans tokens 20..35 (blocks 1 and 2)
        "mm_none": r("mm-none", MM_TOKENS, hasher),
        "mm_a": r("mm-a", MM_TOKENS, hasher, mm_features=[_image("img-a", 20)]),
        "mm_a_again": r("mm-a2", list(MM_TOKENS), hasher, mm_features=[_image("img-a", 20)]),
        "mm_b": r("mm-b", MM_TOKENS, hasher, mm_features=[_image("img-b", 20)]),
        "mm_a_shifted": r("mm-a-shift", MM_TOKENS, hasher, mm_features=[_image("img-a", 24)]),
        # 5: prompt embeds, as the engine passes an embeds prompt: no token ids (all_token_ids are 0s)
        "embeds": r("emb", None, hasher, prompt_embeds=embeds),
        "embeds_again": r("emb2", None, hasher, prompt_embeds=embeds.clone()),
        "embeds_row40": r("emb-row40", None, hasher, prompt_embeds=embeds_row40),
        "zeros_no_embeds": r("zeros", [0] * N, hasher),  # the same token ids the embeds requests carry
    }


def main() -> None:
    from vllm import __version__ as vllm_version
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from kvbridge.integrations.vllm.pool_identity import request_pool_keys

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BT, sha256)
    cases: dict[str, dict[str, Any]] = {}
    for name, req in build_cases(hasher).items():
        tokens = list(req.all_token_ids)
        cases[name] = {"tokens": tokens,
                       "pool": [k.hex() for k in request_pool_keys(req, tokens, BT)],
                       "vllm": [bytes(h).hex() for h in req.block_hashes]}
    print(json.dumps({"vllm_version": vllm_version, "block_tokens": BT, "cases": cases}))


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()) as noise:  # vLLM prints at import
        import vllm  # noqa: F401
    sys.stderr.write(noise.getvalue())
    main()

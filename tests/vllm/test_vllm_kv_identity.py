"""One KV identity for real vLLM configs (issue 43 point 1): instances of one model directory
agree; an `--hf-overrides` that changes RoPE, another KV cache dtype or other weights of the same
shape make another identity, naming the field, so they share no pool object (the identity's
digest is in the namespace) and a P/D handshake refuses them (`Fingerprint.check_compatible`)."""

from __future__ import annotations

import pytest

from kvbridge.connector.messages import Fingerprint, HandshakeRefused
from kvbridge.core.kv_identity import KVIdentity
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.pool.tier import PoolConfig, object_layout

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cases(run_probe) -> dict[str, dict]:
    return run_probe("vllm_kv_identity_probe.py", timeout_s=600)


def _identity(case: dict) -> KVIdentity:
    return KVIdentity(tuple(sorted(case["fields"].items())))


@pytest.mark.parametrize("other, field", [("rope_override", "config.rope_"), ("fp8_cache", "kv_cache_dtype"),
                                          ("other_weights", "weights")])
def test_what_changes_kv_changes_the_identity_naming_the_field(cases, other, field):
    plain = _identity(cases["plain"])
    assert _identity(cases["plain_again"]) == plain and cases["plain_again"]["digest"] == cases["plain"]["digest"]
    differs = plain.first_difference(_identity(cases[other]))
    assert differs is not None and differs[0].startswith(field), differs
    assert cases[other]["digest"] != cases["plain"]["digest"]
    # The P/D handshake refuses the pair, naming the field; the pool puts them in other namespaces.
    spec, layout = ModelSpec.uniform(2, 2, 32, "float32"), EngineLayout(tp_size=1, num_blocks=8)
    with pytest.raises(HandshakeRefused, match=f"KV identity differs in {field}"):
        Fingerprint.of(spec, layout, plain).check_compatible(Fingerprint.of(spec, layout, _identity(cases[other])))
    names = [object_layout(spec, PoolConfig(model_id="m", block_tokens=16, insecure=True,
                                            kv_identity=cases[c]["digest"])).namespace for c in ("plain", other)]
    assert names[0] != names[1]

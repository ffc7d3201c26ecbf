"""What makes two engines' KV interchangeable beyond its geometry: one definition, used everywhere.

Why: the geometry fingerprint (`ModelSpec.fingerprint`) says where bytes are, not what they
mean. Two instances of one model directory, one started with an `--hf-overrides` that changes
RoPE, or with other weights of the same shape, another quantization or another compute dtype,
write different K and V for the same tokens, and every seal and check still passes. So an
engine states its KV identity: named fields (the weights' digest, the compute and KV dtypes,
quantization and load format, every model-config value after overrides), each carried as a
short value or a digest of a long one. The shared pool keys its namespace by the identity's
digest (engines that differ share no object), and a P/D handshake compares the fields and
refuses a peer in one line that names the first that differs, with both values.

Integrations fill it (`integrations.vllm.kv_identity` for vLLM); this module only compares.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

MAX_FIELDS = 512
MAX_NAME = 96
MAX_SHOWN = 48
"""Values whose canonical JSON is at most this long are carried as they are; longer ones as a digest."""

FieldName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
FieldValue = Annotated[str, Meta(max_length=MAX_SHOWN + 8)]


def canonical(value: Any) -> str:
    """A value as canonical JSON (sorted keys, no spaces); what JSON cannot say, as its repr."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def shown(value: Any) -> str:
    """How a field's value is carried: its canonical JSON when short, else a digest of it."""
    text = canonical(value)
    if len(text) <= MAX_SHOWN:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:MAX_SHOWN - 7]


class KVIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Named fields, sorted by name, each a short value or a digest (see the module)."""

    fields: Annotated[tuple[tuple[FieldName, FieldValue], ...], Meta(max_length=MAX_FIELDS)]

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> KVIdentity:
        return cls(tuple(sorted((str(k)[:MAX_NAME], shown(v)) for k, v in values.items())))

    def digest(self) -> str:
        """One hex digest of every field: what the pool's namespace folds in."""
        return hashlib.sha256(canonical(self.fields).encode()).hexdigest()

    def first_difference(self, other: KVIdentity) -> tuple[str, str, str] | None:
        """(field, this value, other value) of the first field (by name) that differs; a field
        one side lacks shows as `(absent)`. None when both are the same identity."""
        mine, theirs = dict(self.fields), dict(other.fields)
        for name in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(name, "(absent)"), theirs.get(name, "(absent)")
            if a != b:
                return name, a, b
        return None


__all__ = ["KVIdentity", "canonical", "shown"]

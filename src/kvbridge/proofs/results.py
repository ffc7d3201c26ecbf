"""The shape of what every demo reports, so that the CLI, the tests and a reader see one vocabulary.

Every demo proves a moved cache against `transformers` and reports the model, its cache
geometry, and whether the tokens matched and the cache was bit-exact; each adds what its own
path measured. `to_dict` is what `kvbridge demo --json` prints (the fields in declaration order,
then `ok`). No torch or transformers here: the multi-process demo's parent imports this without
loading a model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ProofResult:
    """Base of every demo's result: which model, which geometry; `ok` and `describe` per demo."""

    model: str
    spec: str

    @property
    def ok(self) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        """One line on what ran and what was measured (after the verdict in `summary`)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        return f"{'OK' if self.ok else 'MISMATCH'}: {self.describe()}"


@dataclass
class DisaggregationResult(ProofResult):
    """A prefill engine's cache moved to a decode engine and decoded there, against plain `generate`."""

    prefill: str
    decode: str
    prompt_len: int
    new_tokens: int
    tokens_reference: list[int]
    tokens_disaggregated: list[int]
    match: bool
    cache_equal: bool
    replicas_equal: bool
    bytes_moved: int  # what the plans move
    num_runs: int
    transfer_seconds: float
    plan_seconds: float
    cache_differences: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.match and self.cache_equal and self.replicas_equal

    def verdicts(self) -> str:
        return (f"tokens {'match' if self.match else 'differ'}, cache "
                f"{'bit-exact' if self.cache_equal else 'differs'}")


__all__ = ["DisaggregationResult", "ProofResult"]

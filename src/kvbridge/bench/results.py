"""What every bench returns: a flat record of figures that prints as one JSON object."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class BenchFigures:
    """Base of the bench results; subclasses list their figures as dataclass fields."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

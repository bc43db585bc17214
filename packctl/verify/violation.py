"""A broken rule, as every check of `packctl verify` reports it.

    data/train-00000.parquet row 12 sequence 1: the first token of the sequence has label 5; it must
    be -100 ... [structure: labels-boundary] (3 places)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    """One broken rule, located as precisely as the rule allows.

    `count` is the number of places (rows, sequences or tokens) that break it; the message
    describes the first one.
    """

    check: str  # structure, conservation, attention, contamination, cp
    rule: str
    message: str
    shard: str | None = None
    row: int | None = None
    sequence: int | None = None
    count: int = 1

    def __str__(self) -> str:
        where = [part for part in (
            self.shard,
            None if self.row is None else f"row {self.row}",
            None if self.sequence is None else f"sequence {self.sequence}",
        ) if part is not None]
        more = f" ({self.count} places)" if self.count > 1 else ""
        prefix = " ".join(where) + ": " if where else ""
        return f"{prefix}{self.message} [{self.check}: {self.rule}]{more}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

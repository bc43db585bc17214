"""The verify report: one status per check, the broken rules, and its JSON (the terminal table is
packctl/cli/render.py `verify_table`).

    check          status   result
    structure      ok       4 shards, 286 packs, 2,007 sequences, 1,170,955 tokens; sha256 match
    conservation   ok       2,000 samples: 2,000 packed, 0 dropped, 0 truncated, 7 split
    attention      ok       sdpa fp32: max error 3.0e-07 (unpacked 2.4e-07; bound 1.0e-05), 8 packs
    ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from packctl.errors import EXIT_OK, EXIT_VERIFY_FAILED
from packctl.verify.violation import Violation

CHECKS = ("structure", "conservation", "attention", "contamination", "cp", "bench")


@dataclass
class CheckResult:
    status: str  # ok, failed, skipped
    lines: list[str] = field(default_factory=list)  # one line per result, for the table
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None  # the check's wall time; None when it did not run

    def to_dict(self) -> dict[str, Any]:
        timed = {} if self.seconds is None else {"seconds": round(self.seconds, 3)}
        return {"status": self.status, **self.details, **timed}


@dataclass
class VerifyReport:
    output: str
    checks: dict[str, CheckResult]
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations and all(c.status != "failed" for c in self.checks.values())

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_VERIFY_FAILED

    @property
    def seconds(self) -> float:
        """The seconds of every check that ran."""
        return sum(c.seconds or 0.0 for c in self.checks.values())

    def slowest(self) -> str | None:
        """The check that took longest (None when none ran)."""
        ran = [(c.seconds, name) for name, c in self.checks.items() if c.seconds is not None]
        return max(ran)[1] if ran else None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values; a non-finite error (a kernel that returned NaN) becomes null."""
        return _finite({"output": self.output, "ok": self.ok, "exit_code": self.exit_code,
                        "checks": {name: self.checks[name].to_dict() for name in CHECKS if name in self.checks},
                        "violations": [v.to_dict() for v in self.violations]})


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

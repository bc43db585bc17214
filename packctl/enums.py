"""`StrEnum` on every Python packctl supports (3.10 has no `enum.StrEnum`): members are their
strings, `str(LossOn.ALL) == "all"`."""
from __future__ import annotations

import enum

if hasattr(enum, "StrEnum"):
    StrEnum = enum.StrEnum
else:  # Python 3.10
    class StrEnum(str, enum.Enum):
        """A str and an Enum whose str() is its value, as Python 3.11's enum.StrEnum."""

        def __str__(self) -> str:
            return str(self.value)

"""Planning: which sequences go into which pack. Pure functions over numpy arrays."""
from __future__ import annotations

from packctl.plan.algorithms import ALGORITHMS, Bins, pack_lengths

__all__ = ["ALGORITHMS", "Bins", "pack_lengths"]

"""Planning: which sequences go into which pack. Pure functions over numpy arrays."""
from __future__ import annotations

from packctl.plan.names import ALGORITHMS

__all__ = ["ALGORITHMS", "Bins", "pack_lengths"]


def __getattr__(name: str):
    # the kernels (numba) load on first use: the option checks only need the names
    if name in ("Bins", "pack_lengths"):
        from packctl.plan import algorithms

        return getattr(algorithms, name)
    raise AttributeError(f"module 'packctl.plan' has no attribute {name!r}")

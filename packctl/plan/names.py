"""The planning algorithms by name: what plan/algorithms.py implements, importable without its kernels
(the options module checks `--algorithm` against it)."""
from __future__ import annotations

ALGORITHMS: tuple[str, ...] = ("concat", "ffd", "bfd", "mffd", "ffs", "split", "pool")

"""The planning algorithms by name: the rows of `KERNELS` in plan/algorithms.py, importable without
its kernels (the options module checks `--algorithm` against it without loading numba). A new
algorithm adds its name here and its row there; tests/unit/plan/test_algorithms.py keeps the two
equal, in the same order."""
from __future__ import annotations

ALGORITHMS: tuple[str, ...] = ("concat", "ffd", "bfd", "mffd", "ffs", "split", "pool")

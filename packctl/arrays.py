"""Small vectorized helpers over CSR-style segments (numpy only)."""
from __future__ import annotations

import numpy as np


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated aranges: starts [10, 50], lens [2, 3] -> [10, 11, 50, 51, 52]."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    seg_start = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts - seg_start, lens)


def positions_in_segments(lens: np.ndarray) -> np.ndarray:
    """Index of each element inside its segment: lens [2, 3] -> [0, 1, 0, 1, 2]."""
    lens = np.asarray(lens, dtype=np.int64)
    return ranges(np.zeros(len(lens), np.int64), lens)


def offsets_of(lens: np.ndarray) -> np.ndarray:
    """CSR offsets of segment lengths: [2, 3] -> [0, 2, 5]."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out

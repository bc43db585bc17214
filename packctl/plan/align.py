"""Alignment: every sequence is padded to a multiple of `align` before packing.

    align = lcm(seq_multiple, 2*cp if cp > 1, cp*tp if sequence parallel and tp > 1)
    lengths [5, 8, 3], align 4  ->  padded [8, 8, 4]
"""
from __future__ import annotations

import numpy as np


def round_up(values, multiple: int):
    """Round up to a multiple: round_up([5, 8, 3], 4) -> [8, 8, 4]."""
    return (values + multiple - 1) // multiple * multiple


def pack_lengths_padded(loads_padded: np.ndarray, capacity: int, pad_to: str, pack_multiple: int) -> np.ndarray:
    """Final length of each pack: the capacity, or the padded load rounded up to `pack_multiple`.

    loads [10, 16], capacity 32: pad_to capacity -> [32, 32]; multiple 8 -> [16, 16]
    """
    if pad_to == "capacity":
        return np.full(len(loads_padded), capacity, dtype=np.int64)
    return round_up(np.asarray(loads_padded, dtype=np.int64), pack_multiple)

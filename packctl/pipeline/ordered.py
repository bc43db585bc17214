"""What the order stage hands to plan: this rank's whole windows of the global order, made by
`pipeline/order.py` (a sample sort of one input) or `pipeline/mixture.py` (a blend's uses,
interleaved); a module of its own so that the two need not import each other.

    Ordered(gids=[4, 0, 7], lengths=[900, 120, 64], first_window=2)
    -> this rank plans windows 2.. of the order, starting with sequences 4, 0, 7
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Ordered"]


@dataclass
class Ordered:
    """This rank's whole windows of the global order."""

    gids: np.ndarray
    lengths: np.ndarray  # true lengths
    first_window: int  # index of its first window in the global order (of its epoch, with --epochs)
    # --group-column: True on the first member of each group, and SequenceIndex.group_starts
    new_group: np.ndarray | None = None
    group_starts: np.ndarray | None = None
    # --limit: each sequence's value of each limited column (int64, n x k), moved with its gid
    extra: np.ndarray | None = None
    # --share-prefix: the tokens each sequence's group stores once (plan/prefix.py), moved with its gid
    shared: np.ndarray | None = None

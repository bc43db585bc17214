"""packctl's planner behind the interfaces RL frameworks pack with: swap one import, keep the call.

NeMo-RL packs each rollout batch with a packer from `get_packer(algorithm, bin_capacity, ...)`,
whose `pack(sequence_lengths)` returns bins as lists of sequence indices:

    from packctl.online.adapters import get_packer
    packer = get_packer("first_fit_decreasing", bin_capacity=10, min_bin_count=2)
    packer.pack([6, 5, 4, 3, 2])          # [[0, 2], [1, 3, 4]]

verl splits a batch over k micro-batches or ranks with `get_seqlen_balanced_partitions(seqlen_list,
k_partitions, equal_size)`, k lists of indices, each sorted, with close sums of lengths:

    from packctl.online.adapters import get_seqlen_balanced_partitions
    get_seqlen_balanced_partitions([8, 7, 6, 5, 4], 2, equal_size=False)   # [[1, 3, 4], [0, 2]]

Both run the kernels of `packctl pack` (packctl.online). Where the frameworks raise ValueError
(a sequence over the capacity, too few sequences for the bins asked), these raise `PackctlError`,
one line with the fix. docs/online.md has the recipes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from packctl.errors import PackctlError
from packctl.online import Packs, _lengths, plan_packs
from packctl.plan.algorithms import cuts_items
from packctl.plan.kk import kk_parts

__all__ = ["NEMO_RL_ALGORITHMS", "SequencePacker", "get_packer", "get_seqlen_balanced_partitions"]

# NeMo-RL's algorithm names -> packctl's (packctl's own names are taken as they are)
NEMO_RL_ALGORITHMS = {
    "concatenative": "concat",
    "first_fit_decreasing": "ffd",
    "first_fit_shuffle": "ffs",
    "modified_first_fit_decreasing": "mffd",
}


class SequencePacker:
    """A packer with NeMo-RL's `SequencePacker` interface: `pack(sequence_lengths)` -> bins.

    Args:
        algorithm: a packctl algorithm (concat, ffd, bfd, mffd, ffs, split is refused: a bin
            holds whole sequences) or NeMo-RL's name of one (`NEMO_RL_ALGORITHMS`).
        bin_capacity: tokens per bin.
        collect_metrics: keep the metrics of every `pack` call (`metrics`: packctl's figures,
            utilization, waste_ratio, ..., one dict per call).
        min_bin_count, bin_count_multiple: at least that many bins, a multiple of that many
            (`plan_packs` min_packs and packs_multiple).
        seed: the seed of first_fit_shuffle (`ffs`); every call with the same lengths returns the
            same bins.

        >>> SequencePacker("concatenative", 8).pack([4, 1, 3, 2, 1, 3, 4, 5])
        [[0, 1, 2], [3, 4, 5], [6], [7]]
    """

    def __init__(self, algorithm: Any, bin_capacity: int, collect_metrics: bool = False,
                 min_bin_count: int | None = None, bin_count_multiple: int | None = None, *, seed: int = 0):
        name = getattr(algorithm, "value", algorithm)  # NeMo-RL passes its PackingAlgorithm enum too
        self.algorithm = NEMO_RL_ALGORITHMS.get(name, name)
        if cuts_items(self.algorithm):
            raise PackctlError(f"algorithm {self.algorithm!r} cuts sequences; a SequencePacker's bins hold whole "
                               "sequences: choose another algorithm")
        self.bin_capacity = bin_capacity
        self.collect_metrics = collect_metrics
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.seed = seed
        self.metrics: list[dict[str, Any]] = []
        self.last: Packs | None = None

    def pack(self, sequence_lengths) -> list[list[int]]:
        """Bins of indices into `sequence_lengths`, in packctl's pack order; each index once."""
        packs = plan_packs(sequence_lengths, self.bin_capacity, algorithm=self.algorithm, seed=self.seed,
                           min_packs=self.min_bin_count, packs_multiple=self.bin_count_multiple)
        self.last = packs
        if self.collect_metrics:
            self.metrics.append(packs.metrics())
        return packs.bins()

    def reset_metrics(self) -> None:
        self.metrics.clear()


def get_packer(algorithm: Any, bin_capacity: int, collect_metrics: bool = False, min_bin_count: int | None = None,
               bin_count_multiple: int | None = None, **options) -> SequencePacker:
    """NeMo-RL's `get_packer`, with packctl's kernels: `get_packer("first_fit_decreasing", 4096)`."""
    return SequencePacker(algorithm, bin_capacity, collect_metrics, min_bin_count, bin_count_multiple, **options)


def get_seqlen_balanced_partitions(seqlen_list, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's `get_seqlen_balanced_partitions`: the indices of `seqlen_list` in `k_partitions`
    parts of close sums (Karmarkar-Karp largest differencing, `plan/kk.py` `kk_parts`: the parts
    of `pack --dp-size`'s balancer, compiled), each part sorted and non-empty; with `equal_size`
    every part holds len(seqlen_list) / k_partitions items.

        >>> get_seqlen_balanced_partitions([8, 7, 6, 5, 4], 2, equal_size=False)
        [[1, 3, 4], [0, 2]]

    The parts have no bound on their tokens: to keep every micro-batch within a token budget,
    pack with `plan_steps` (docs/online.md).
    """
    lengths = _lengths(seqlen_list)
    if isinstance(k_partitions, bool) or not isinstance(k_partitions, (int, np.integer)) or k_partitions < 1:
        raise PackctlError(f"k_partitions must be an integer >= 1, got {k_partitions!r}")
    n = len(lengths)
    if n < k_partitions:
        raise PackctlError(f"{n} sequences cannot fill {k_partitions} partitions: each needs one at least; pass "
                           f"fewer partitions")
    if equal_size and n % k_partitions:
        raise PackctlError(f"equal_size: {n} sequences do not split into {k_partitions} equal partitions; pass a "
                           f"multiple of {k_partitions} sequences or equal_size=False")
    part = kk_parts(lengths, int(k_partitions), equal_counts=equal_size)
    order = np.argsort(part, kind="stable")
    return [chunk.tolist() for chunk in np.split(order, np.cumsum(np.bincount(part, minlength=k_partitions))[:-1])]

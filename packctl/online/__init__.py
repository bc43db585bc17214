"""Packing inside the training loop: a rollout batch's lengths -> its packs, and its packs -> ranks.

An RL trainer packs every batch it generates, between two optimizer steps, from the lengths of its
rollouts. `plan_packs` and `plan_steps` run the kernels of `packctl pack` (plan/windows.py and
plan/balance.py, the same functions) on those lengths and return plain numpy arrays:

    >>> import packctl
    >>> packs = packctl.plan_packs([6, 5, 4, 3, 2], capacity=10, algorithm="ffd")
    >>> packs.bins()                      # sequence indices of each pack, in pack order
    [[0, 2], [1, 3, 4]]
    >>> packs.pack.tolist(), packs.position.tolist()   # per sequence: its pack, its place there
    ([0, 1, 0, 1, 1], [0, 0, 1, 1, 2])
    >>> steps = packctl.plan_steps([6, 5, 4, 3, 2], dp_size=2, capacity=10, algorithm="ffd")
    >>> steps.rank.tolist(), steps.micro_batch.tolist()  # per pack of steps.packs
    ([0, 1], [0, 0])

Packing these lengths with `packctl pack --order input --window N` (N at least the number of
sequences) plans the same packs, in the same order; with `--dp-size D --micro-batches M` the same
steps (tests/integration/test_online_pack.py compares both with real `pack` runs). No call
communicates: every rank that calls with the same lengths and options gets the same arrays, so
each rank can plan the whole batch and take its share.

What a call costs: the kernels are numba functions cached on disk after their first compilation
(packctl/jit.py); a process that finds them there loads them in milliseconds, so the first call of
a training job costs the import of numba and numpy (about 0.2 s) and no compilation. Run
`python -m packctl.online` once where the job's image is built (or after an install) to compile
them all into the cache; without it, the first call of each algorithm in the first job compiles
it (about 0.5 s) and caches it for every later process. docs/online.md has the figures.

Importing this module loads numpy and numba only: no pyarrow, polars, typer or rich.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packctl.errors import PackctlError
from packctl.plan.algorithms import cuts_items
from packctl.plan.align import round_up
from packctl.plan.balance import balance_plan
from packctl.plan.balance import piece_costs
from packctl.plan.groups import GroupTooLong
from packctl.plan.kk import kk_parts
from packctl.plan.metrics import attention_cost, dp_balance, pack_metrics
from packctl.plan.names import ALGORITHMS
from packctl.plan.windows import PackPlan, SequenceTooLong, plan_windows
from packctl.specs import BalanceSpec, WindowOptions

__all__ = ["Packs", "Steps", "plan_packs", "plan_steps", "warm_up"]

# packctl/online/adapters.py holds the drop-in packers of other frameworks (NeMo-RL, verl)

TOO_LONG = ("error", "drop", "truncate", "split")
BALANCE = ("tokens", "attention")
BALANCE_SCOPES = ("auto", "sequences", "packs", "ranks")
# balance_scope "auto": sequences move between packs while a step holds at most this many. The
# search for the best move or swap compares every sequence of the busiest rank with every one of
# another, O(S^2 / D^2) a move: 2,000 sequences over 8 ranks balance in about 10 ms, 10,000 in
# about 200 ms. Beyond, a batch planned as one step ("ranks") has its sequences split over the
# ranks by Karmarkar-Karp first, then packed rank by rank: 11 ms at 10,000, ranks within 0.001%,
# a few more packs; with micro_batches whole packs are dealt ("packs"), which keeps M packs a rank
# and leaves the ranks within 0.3% of each other (docs/online.md).
AUTO_SEQUENCES = 2048


@dataclass(frozen=True, eq=False)
class Packs:
    """A batch's packs, as arrays. A *piece* is a whole sequence, or a part of one that was split
    (`algorithm="split"` or `too_long="split"`); pack p holds pieces offsets[p]:offsets[p+1].

        lengths [6, 5, 4, 3, 2], capacity 10, ffd
        offsets  [0, 2, 5]           pack 0: pieces 0..1, pack 1: pieces 2..4
        sequence [0, 2, 1, 3, 4]     index into lengths, pack by pack
        start    [0, 0, 0, 0, 0]     first token of the piece in its sequence
        length   [6, 4, 5, 3, 2]     true tokens of the piece
        padded   [6, 4, 5, 3, 2]     its length rounded up to `align`
        pack     [0, 1, 0, 1, 1]     per sequence: the pack of its first token (-1: dropped)
        position [0, 0, 1, 1, 2]     per sequence: that piece's place in its pack (-1: dropped)

    All arrays are int64. `dropped` lists the sequences left out (too_long="drop"), `truncated`
    those cut to the capacity (too_long="truncate").
    """

    capacity: int
    align: int
    offsets: np.ndarray
    sequence: np.ndarray
    start: np.ndarray
    length: np.ndarray
    padded: np.ndarray
    pack: np.ndarray
    position: np.ndarray
    dropped: np.ndarray
    truncated: np.ndarray
    group_id: np.ndarray | None = None  # per piece, with groups: the group of its sequence
    max_seqs_per_bin: int | None = None  # the bound planned with, which plan_steps' moves keep
    _metrics: dict = field(default_factory=dict, repr=False)

    @property
    def num_packs(self) -> int:
        return len(self.offsets) - 1

    def loads(self, padded: bool = True) -> np.ndarray:
        """Tokens of each pack (padded to `align`, or true): [10, 10] for the example above."""
        values = self.padded if padded else self.length
        sums = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
        return sums[self.offsets[1:]] - sums[self.offsets[:-1]]

    def bins(self) -> list[list[int]]:
        """Sequence indices of each pack, pieces in pack order: [[0, 2], [1, 3, 4]]. A split
        sequence appears in every pack that holds a piece of it."""
        return [part.tolist() for part in np.split(self.sequence, self.offsets[1:-1])] if self.num_packs else []

    def metrics(self) -> dict[str, Any]:
        """The figures `packctl pack` writes to `_metrics.json` of these packs, each pack padded to
        the capacity (`--pad-to capacity`): utilization, waste_ratio, bin_balance,
        packing_efficiency, lower_bound_packs_l2, padding, ... (docs/stats.md). Computed on the
        first call (it costs more than the plan), then kept."""
        if not self._metrics:
            pack_lens = np.full(self.num_packs, self.capacity, dtype=np.int64)
            order = np.argsort(self.sequence, kind="stable")
            self._metrics.update(pack_metrics(self.length, self.offsets, pack_lens, capacity=self.capacity,
                                              align=self.align, input_order=order))
        return self._metrics


@dataclass(frozen=True, eq=False)
class Steps:
    """Packs dealt to data-parallel ranks: pack p of `packs` runs on rank `rank[p]` as its
    micro-batch `micro_batch[p]` of optimizer step `step[p]`. Inside a step, the packs come
    micro-batch by micro-batch and rank by rank (row j of a step: rank j % D, micro-batch j // D).

        lengths [9, 1, 8, 2], capacity 10, bfd -> packs [9 1] [8 2]; dp_size 2
        rank [0, 1], micro_batch [0, 0], step [0, 0]

    `packs` may differ from the packs planned: with `balance_scope="sequences"` single sequences
    move between packs (never over the capacity), with `"ranks"` each rank's sequences are packed
    anew, and for equal counts packs of several sequences are split until every rank gets as many.
    """

    packs: Packs
    dp_size: int
    step: np.ndarray
    rank: np.ndarray
    micro_batch: np.ndarray
    packs_added: int
    unequal_steps: int
    attn_coeff: float
    _before: dict = field(default_factory=dict, repr=False)

    @property
    def num_steps(self) -> int:
        return int(self.step.max()) + 1 if len(self.step) else 0

    def of_rank(self, rank: int, step: int = 0) -> np.ndarray:
        """Pack ids rank `rank` runs at `step`, micro-batch 0 first."""
        mine = np.flatnonzero((self.rank == rank) & (self.step == step))
        return mine[np.argsort(self.micro_batch[mine], kind="stable")]

    def metrics(self) -> dict[str, Any]:
        """`dp_balance` of `_metrics.json` for these steps (max / mean over ranks of the tokens and
        of the attention cost, step by step), with `before`: the same figures for the planned packs
        dealt round robin, as a strided sampler would."""
        loads = self.packs.loads(padded=False)
        sums = np.concatenate(([0.0], np.cumsum(attention_cost(self.packs.length, self.attn_coeff))))
        attention = sums[self.packs.offsets[1:]] - sums[self.packs.offsets[:-1]]
        figures = dp_balance(self.step, self.rank, loads, attention, attn_coeff=self.attn_coeff,
                             micro_batch=self.micro_batch)
        return {**figures, "before": self._before, "packs_added": self.packs_added,
                "unequal_steps": self.unequal_steps}


def plan_packs(lengths, capacity: int, *, algorithm: str = "bfd", max_seqs_per_bin: int | None = None,
               align: int = 1, too_long: str = "error", seed: int = 0, pool_size: int = 128,
               pool_strategy: str = "closest", groups=None, min_packs: int | None = None,
               packs_multiple: int | None = None) -> Packs:
    """Plan the packs of one batch of sequences.

    Args:
        lengths: each sequence's length in tokens: a list, a 1-D numpy array or a torch tensor (on
            any device) of integers >= 1.
        capacity: tokens per pack; a multiple of `align`.
        algorithm: concat, ffd, bfd (default), mffd, ffs, split or pool, as `pack --algorithm`
            (docs/algorithms.md).
        max_seqs_per_bin: at most this many sequences in a pack (`--max-seqs-per-bin`).
        align: every sequence is padded to a multiple of it (2*cp for context parallelism,
            `--cp-size` and docs/algorithms.md "Alignment"); the capacity holds padded lengths.
        too_long: a sequence over the capacity: "error" (default), "drop", "truncate" or "split",
            as `--too-long`.
        seed: the seed of `ffs`.
        pool_size, pool_strategy: the pool of `algorithm="pool"`.
        groups: one id per sequence (any integers): sequences of one id go into one pack, next to
            each other, in the order they come (GRPO rollouts of a prompt, a DPO pair), as
            `--group-column`. Groups are packed in the order of their first sequence.
        min_packs, packs_multiple: at least `min_packs` packs, and a multiple of `packs_multiple`
            (NeMo-RL's min_bin_count and bin_count_multiple): while there are too few, the pack
            with the most sequences gives its last one to a new pack (never a piece of a split
            sequence, nor a member of a group).

    Returns:
        `Packs` (its docstring draws the arrays).

    Raises:
        PackctlError: one line naming the argument, the sequence and the fix.

        >>> plan_packs([6, 5, 4, 3, 2], 10, algorithm="concat").bins()
        [[0], [1, 2], [3, 4]]
        >>> plan_packs([6, 5, 4, 3, 2], 10, algorithm="ffd", min_packs=3).bins()
        [[0, 2], [1, 3], [4]]
    """
    lengths = _lengths(lengths)
    capacity, align = _positive(capacity, "capacity"), _positive(align, "align")
    _choice(algorithm, ALGORITHMS, "algorithm")
    _choice(too_long, TOO_LONG, "too_long")
    if max_seqs_per_bin is not None:
        max_seqs_per_bin = _positive(max_seqs_per_bin, "max_seqs_per_bin")
    if capacity % align:
        raise PackctlError(f"capacity {capacity} is not a multiple of align {align}: use capacity "
                           f"{round_up(capacity, align)}")
    n = len(lengths)
    group_of = None if groups is None else _groups(groups, n)
    gids, new_group = _grouped_order(group_of, n)
    options = WindowOptions(capacity=capacity, align=align, algorithm=algorithm, too_long=too_long,
                            window=max(n, 1), max_seqs_per_bin=max_seqs_per_bin, seed=seed, pool_size=pool_size,
                            pool_strategy=pool_strategy)
    plan = _plan_one_window(gids, lengths[gids], options, new_group)
    if min_packs is not None or packs_multiple is not None:
        plan = _with_more_packs(plan, group_of, min_packs, packs_multiple)
    return _packs_of(plan, n, capacity, align, group_of, max_seqs_per_bin)


def _grouped_order(group_of: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The order the n sequences are planned in, and where a new group starts in it (None without
    groups: every sequence in its own place). Members next to each other, groups in the order of
    their first member: groups [7, 3, 7, 5] -> sequences [0, 2, 1, 3], new_group [T, F, T, T]."""
    order = np.arange(n, dtype=np.int64)
    if group_of is None or not n:
        return order, None
    _, first_index, inverse = np.unique(group_of, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.lexsort((order, first_index[inverse])).astype(np.int64)
    run = inverse[order]
    return order, np.concatenate(([True], run[1:] != run[:-1]))


def _plan_one_window(gids: np.ndarray, lengths: np.ndarray, options: WindowOptions,
                     new_group: np.ndarray | None) -> PackPlan:
    """`plan_windows` over the whole batch as one window, its refusals said as `plan_packs`'
    arguments: the sequence (its index in `lengths`) or the group, and the fix."""
    capacity = options.capacity
    try:
        return plan_windows(gids, lengths, options, new_group=new_group)
    except SequenceTooLong as exc:
        raise PackctlError(f"lengths[{exc.gid}] = {exc.length} (padded {exc.padded}) exceeds capacity {capacity}: "
                           f"raise capacity, or pass too_long='drop', 'truncate' or 'split'") from None
    except GroupTooLong as exc:
        raise PackctlError(f"groups: the group of sequence {exc.gid} ({exc.members} sequences, {exc.padded} tokens "
                           f"padded) does not fit one pack of {capacity} tokens: raise capacity or make the group "
                           f"smaller") from None
    except ValueError as exc:
        raise PackctlError(f"plan_packs: {exc}") from None


def _with_more_packs(plan: PackPlan, group_of: np.ndarray | None, min_packs: int | None,
                     packs_multiple: int | None) -> PackPlan:
    """`plan` with packs added until there are at least `min_packs`, a multiple of `packs_multiple`
    (`_more_packs`): the pieces of split sequences and the members of groups of two or more stay
    where they are."""
    pinned = np.isin(plan.piece_gid, plan.split_gids())
    if group_of is not None:
        pinned |= _in_larger_group(group_of)[plan.piece_gid]
    target = _target_packs(plan.num_bins, min_packs, packs_multiple)
    offsets, take = _more_packs(plan.bin_offsets, pinned, target)
    return PackPlan(window_bins=np.array([0, len(offsets) - 1], np.int64), bin_offsets=offsets,
                    piece_gid=plan.piece_gid[take], piece_start=plan.piece_start[take],
                    piece_len=plan.piece_len[take], piece_padded=plan.piece_padded[take], dropped=plan.dropped,
                    truncated=plan.truncated, tokens_dropped=plan.tokens_dropped,
                    tokens_truncated=plan.tokens_truncated)


def plan_steps(lengths=None, dp_size: int = 1, micro_batches: int | None = None, *, packs: Packs | None = None,
               capacity: int | None = None, balance: str = "attention", attn_coeff: float = 0.0,
               balance_scope: str = "auto", equal_counts: bool = True, seed: int = 0,
               **packing) -> Steps:
    """Deal a batch's packs to `dp_size` ranks so that every rank's step costs the same.

    Give either `lengths` with `capacity` (and any option of `plan_packs` as a keyword: algorithm,
    align, groups, ...), which are packed first, or the `Packs` of `plan_packs` (first, or as
    `packs=`). This is `pack
    --dp-size D --micro-batches M` on the batch (plan/balance.py): packs sorted by cost and cut into
    steps of D x M packs; each step's packs dealt by Karmarkar-Karp over the ranks, then single
    sequences moved or swapped between ranks while that lowers the slowest rank (never over the
    capacity or `max_seqs_per_bin`; a split sequence's pieces and group members never move).

    Args:
        dp_size: data-parallel ranks D.
        micro_batches: packs per rank per step M; None: one step holding every pack, each rank
            ceil(P / D) micro-batches.
        balance: the cost balanced: "tokens", or "attention" (default, `a*L + L^2` a sequence).
        attn_coeff: `a` of the attention cost (12 x hidden size weighs the projections alike).
        balance_scope: "sequences" (sequences may move between packs, as `pack` does), "packs"
            (whole packs dealt), "ranks" (each step's sequences split over the ranks by
            Karmarkar-Karp, then packed rank by rank with `algorithm`, bfd for `split` or for
            `packs=`: the ranks' costs are Karmarkar-Karp's over sequences, a few more packs than
            `plan_packs` makes, and a rank may get more than M micro-batches; `_steps_by_ranks`) or
            "auto" (default): sequences while a step holds at most `AUTO_SEQUENCES` (2,048) of
            them, beyond that ranks when micro_batches is None, else packs.
        equal_counts: every rank gets as many packs in a step (packs of several sequences are
            split until the count is a multiple of D).
        seed: the seed of the order of the steps (and of `ffs`).

        >>> s = plan_steps([9, 1, 8, 2, 7, 3, 6, 4], dp_size=2, capacity=10, balance="tokens")
        >>> s.packs.bins(), s.rank.tolist(), s.micro_batch.tolist()
        ([[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 0, 1], [0, 0, 1, 1])

    Raises:
        PackctlError: one line naming the argument and the fix.
    """
    dp_size = _positive(dp_size, "dp_size")
    if micro_batches is not None:
        micro_batches = _positive(micro_batches, "micro_batches")
    _choice(balance, BALANCE, "balance")
    _choice(balance_scope, BALANCE_SCOPES, "balance_scope")
    packs, rank_packing = _packs_to_deal(lengths, packs, capacity, seed, packing)
    plan = _plan_of(packs)
    per_rank = micro_batches if micro_batches is not None else max(1, -(-packs.num_packs // dp_size))
    if balance_scope == "auto":
        per_step = len(packs.sequence) * min(1.0, dp_size * per_rank / max(packs.num_packs, 1))
        balance_scope = "sequences" if per_step <= AUTO_SEQUENCES else "packs" if micro_batches else "ranks"
    spec = BalanceSpec(dp_size=dp_size, micro_batches=per_rank, cost=balance, attn_coeff=float(attn_coeff),
                       scope=balance_scope, equal_counts=equal_counts, capacity=packs.capacity,
                       max_seqs_per_bin=packs.max_seqs_per_bin, seed=seed)
    pinned = None
    if packs.group_id is not None:
        pinned = _in_larger_group(_group_of_sequences(packs))[packs.sequence]
    if balance_scope == "ranks":
        return _steps_by_ranks(packs, plan, spec, micro_batches, pinned, rank_packing)
    balanced = balance_plan(plan, spec, pinned=pinned)
    out = balanced.plan
    group_of = None if packs.group_id is None else _group_of_sequences(packs)
    before = {"tokens": _imbalance(balanced.before_tokens), "attention": _imbalance(balanced.before_attention)}
    return Steps(packs=_packs_of(out, len(packs.pack), packs.capacity, packs.align, group_of, packs.max_seqs_per_bin),
                 dp_size=dp_size,
                 step=balanced.step, rank=balanced.dp_rank, micro_batch=balanced.micro_batch,
                 packs_added=balanced.packs_added, unequal_steps=balanced.unequal_steps,
                 attn_coeff=float(attn_coeff), _before=before)


def _packs_to_deal(lengths, packs: Packs | None, capacity: int | None, seed: int,
                   packing: dict[str, Any]) -> tuple[Packs, dict[str, Any]]:
    """The packs `plan_steps` deals: `packs` as given (also as its first argument), or `lengths`
    planned by `plan_packs` with `capacity` and `packing`; and the options of `packing` that
    `balance_scope="ranks"` packs each rank's sequences with again (algorithm and pool)."""
    if isinstance(lengths, Packs) and packs is None:  # plan_steps(plan_packs(...), dp_size)
        lengths, packs = None, lengths
    if (lengths is None) == (packs is None):
        raise PackctlError("plan_steps: give the batch's lengths (with capacity=) or packs= from plan_packs, one of "
                           "the two")
    if packs is not None:
        if packing or capacity is not None:
            raise PackctlError(f"plan_steps: packs= are planned already; leave out "
                               f"{', '.join([*packing] or ['capacity'])}")
        return packs, {}
    if capacity is None:
        raise PackctlError("plan_steps: lengths need capacity= (tokens per pack), or pass packs= from plan_packs")
    rank_packing = {name: packing[name] for name in ("algorithm", "pool_size", "pool_strategy") if name in packing}
    return plan_packs(lengths, capacity, seed=seed, **packing), rank_packing


def _plan_of(packs: Packs) -> PackPlan:
    """`packs` as the one-window `PackPlan` that plan/balance.py deals to ranks."""
    return PackPlan(window_bins=np.array([0, packs.num_packs], np.int64), bin_offsets=packs.offsets,
                    piece_gid=packs.sequence, piece_start=packs.start, piece_len=packs.length,
                    piece_padded=packs.padded, dropped=packs.dropped, truncated=packs.truncated, tokens_dropped=0,
                    tokens_truncated=0)


def _steps_by_ranks(packs: Packs, plan: PackPlan, spec: BalanceSpec, micro_batches: int | None,
                    pinned: np.ndarray | None, rank_packing: dict[str, Any]) -> Steps:
    """`balance_scope="ranks"`: each step's sequences are split over the ranks first, then packed
    rank by rank, so the ranks' costs are as even as Karmarkar-Karp makes them over sequences and
    no pack exceeds the capacity (each is planned on one rank's sequences, by the kernels).

        lengths [9, 8, 7, 6, 5, 4, 3, 2], capacity 16, 2 ranks, balance tokens
        Karmarkar-Karp over the sequences:  rank 0 {9, 6, 5, 2} = 22   rank 1 {8, 7, 4, 3} = 22
        bfd on each rank:                   rank 0 [9 6] [5 2]         rank 1 [8 7] [4 3]

    Steps: with `micro_batches` M, the planned packs are cut into steps of D x M as
    `balance_scope="packs"` cuts them (plan/balance.py), and each step's sequences are split
    anew; without, one step holds them all. A group's members stay one unit (one rank, one pack).
    """
    d = spec.dp_size
    if micro_batches is None:
        source, step_of_pack, source_pinned = plan, np.zeros(plan.num_bins, np.int64), pinned
        rank_of_piece = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets)) % d  # round robin
        attention = piece_costs(plan.piece_len, "attention", spec.attn_coeff)
        before_tokens = np.bincount(rank_of_piece, weights=plan.piece_len, minlength=d)[None, :]
        before_attention = np.bincount(rank_of_piece, weights=attention, minlength=d)[None, :]
    else:
        cut = balance_plan(plan, dataclasses.replace(spec, scope="packs"), pinned=pinned)
        source, step_of_pack = cut.plan, cut.step
        before_tokens, before_attention = cut.before_tokens, cut.before_attention
        source_pinned = None
        if pinned is not None:  # the pieces as balance_plan reordered them: pinned by sequence
            pinned_gid = np.zeros(len(packs.pack), bool)
            pinned_gid[plan.piece_gid[pinned]] = True
            source_pinned = pinned_gid[source.piece_gid]
    group_of = None if packs.group_id is None else _group_of_sequences(packs)
    pack_of_piece = np.repeat(np.arange(source.num_bins), np.diff(source.bin_offsets))
    first = _unit_starts(source, pack_of_piece, source_pinned, group_of)
    algorithm = rank_packing.get("algorithm", "bfd")
    options = WindowOptions(capacity=packs.capacity, align=packs.align,
                            algorithm="bfd" if cuts_items(algorithm) else algorithm, too_long="error", window=1,
                            max_seqs_per_bin=packs.max_seqs_per_bin, seed=spec.seed,
                            pool_size=rank_packing.get("pool_size", 128),
                            pool_strategy=rank_packing.get("pool_strategy", "closest"))
    packing = _RankPacking(plan=source, options=options, first=first, pinned=source_pinned, dp_size=d,
                           piece_cost=piece_costs(source.piece_len, spec.cost, spec.attn_coeff),
                           equal_counts=spec.equal_counts)
    step_of_piece = step_of_pack[pack_of_piece]
    by_step = np.argsort(step_of_piece, kind="stable")
    step_starts = np.searchsorted(step_of_piece[by_step], np.arange(int(step_of_pack.max(initial=-1)) + 2))
    dealt, unequal = [], 0
    for s in range(len(step_starts) - 1):
        shares, equal = packing.step(by_step[step_starts[s]:step_starts[s + 1]], s)  # pieces in piece order
        dealt.append(shares)
        unequal += not equal
    out, step, rank, micro_batch = _plan_in_step_order(source, dealt)
    before = {"tokens": _imbalance(before_tokens), "attention": _imbalance(before_attention)}
    return Steps(packs=_packs_of(out, len(packs.pack), packs.capacity, packs.align, group_of, packs.max_seqs_per_bin),
                 dp_size=d, step=step, rank=rank, micro_batch=micro_batch, packs_added=out.num_bins - plan.num_bins,
                 unequal_steps=unequal, attn_coeff=spec.attn_coeff, _before=before)


def _unit_starts(plan: PackPlan, pack_of_piece: np.ndarray, pinned: np.ndarray | None,
                 group_of: np.ndarray | None) -> np.ndarray:
    """True on the first piece of each unit `balance_scope="ranks"` moves whole: a piece, or the
    members of one group in one pack (they follow each other there). Groups [5, 5, 7] in one pack,
    the 5s pinned: [T, F, T]."""
    first = np.ones(len(plan.piece_gid), bool)
    if pinned is not None and len(first) > 1:
        same_group = group_of[plan.piece_gid[1:]] == group_of[plan.piece_gid[:-1]]
        first[1:] = ~(pinned[1:] & pinned[:-1] & same_group & (pack_of_piece[1:] == pack_of_piece[:-1]))
    return first


@dataclass(frozen=True, eq=False)
class _RankPacking:
    """How `balance_scope="ranks"` packs each step, rank by rank: the pieces of `plan` (the packs
    the steps were cut from), packed with `options`, each piece costing `piece_cost`; `first` is
    True where a unit moved whole starts (`_unit_starts`), `pinned` on the pieces that never leave
    their unit's pack (a group's members; None without groups); with `equal_counts` every rank of
    a step gets as many packs."""

    plan: PackPlan
    options: WindowOptions
    piece_cost: np.ndarray
    first: np.ndarray
    pinned: np.ndarray | None
    dp_size: int
    equal_counts: bool

    def step(self, pieces: np.ndarray, step: int) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], bool]:
        """Step `step`'s pieces dealt over the ranks by Karmarkar-Karp, unit by unit, then each
        rank's packed on their own: for rank r, (its pieces pack by pack, the size of each pack,
        each pack's micro-batch: 0 the heaviest, ties the first planned); and whether every rank
        got as many packs.

        Equal counts: a rank with fewer packs than the most of the step moves the last sequence of
        its pack with the most sequences into a new pack until it has as many (`_more_packs`, a
        group's members never); where it runs out of such sequences, the step stays unequal.
        """
        unit_of_piece = np.cumsum(self.first[pieces]) - 1
        unit_rank = kk_parts(np.bincount(unit_of_piece, weights=self.piece_cost[pieces]), self.dp_size)
        rank_of = unit_rank[unit_of_piece]
        planned = [self._packed(pieces[rank_of == r], step * self.dp_size + r) for r in range(self.dp_size)]
        most = max(len(offsets) - 1 for offsets, _ in planned)
        shares, equal = [], True
        for offsets, rank_pieces in planned:
            offsets, rank_pieces, evened = self._evened(offsets, rank_pieces, most)
            equal &= evened
            shares.append((rank_pieces, np.diff(offsets), self._micro_batches(offsets, rank_pieces)))
        return shares, equal

    def _packed(self, mine: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
        """A rank's pieces of a step packed on their own, as window `window` of the kernels: (the
        packs' offsets, the pieces pack by pack); no pieces, no packs."""
        if not len(mine):
            return np.zeros(1, np.int64), mine
        new_group = None if self.pinned is None else self.first[mine]
        rank_plan = plan_windows(mine, self.plan.piece_len[mine], dataclasses.replace(self.options, window=len(mine)),
                                 first_window=window, new_group=new_group)
        return rank_plan.bin_offsets, rank_plan.piece_gid

    def _evened(self, offsets: np.ndarray, pieces: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """A rank's packs split up to `most` packs where `equal_counts` asks for it (`_more_packs`),
        and whether the rank is left with as many as the others (False where it could not be)."""
        if not self.equal_counts or len(offsets) - 1 >= most:
            return offsets, pieces, True
        fixed = np.zeros(len(pieces), bool) if self.pinned is None else self.pinned[pieces]
        try:
            offsets, order = _more_packs(offsets, fixed, most)
        except PackctlError:
            return offsets, pieces, False
        return offsets, pieces[order], True

    def _micro_batches(self, offsets: np.ndarray, pieces: np.ndarray) -> np.ndarray:
        """Each of a rank's packs' micro-batch: 0 the heaviest, ties the first planned. Packs
        costing [3, 7, 3] -> [1, 0, 2]."""
        sums = np.concatenate(([0.0], np.cumsum(self.piece_cost[pieces])))
        heaviest = np.argsort(sums[offsets[:-1]] - sums[offsets[1:]], kind="stable")
        micro = np.empty(len(heaviest), np.int64)
        micro[heaviest] = np.arange(len(heaviest))
        return micro


def _plan_in_step_order(source: PackPlan, dealt: list) -> tuple[PackPlan, np.ndarray, np.ndarray, np.ndarray]:
    """The packs of `_RankPacking.step`, `dealt[s][r]` being rank r's (pieces of `source`, pack
    sizes, micro-batches) at step s, as one plan: packs step by step, micro-batch by micro-batch,
    rank by rank, pieces in their order in a pack; and each pack's step, rank and micro-batch."""
    taken, pack_sizes, pack_step, pack_rank, pack_micro = [], [], [], [], []
    for s, shares in enumerate(dealt):
        for r, (rank_pieces, sizes, micro) in enumerate(shares):
            taken.append(rank_pieces)
            pack_sizes.append(sizes)
            pack_step.append(np.full(len(sizes), s, np.int64))
            pack_rank.append(np.full(len(sizes), r, np.int64))
            pack_micro.append(micro)
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))
    sizes, step, rank, micro_batch = cat(pack_sizes), cat(pack_step), cat(pack_rank), cat(pack_micro)
    pack_order = np.lexsort((rank, micro_batch, step))
    new_place = np.empty(len(pack_order), np.int64)
    new_place[pack_order] = np.arange(len(pack_order))
    take = cat(taken)[np.argsort(np.repeat(new_place, sizes), kind="stable")]
    new_offsets = np.concatenate(([0], np.cumsum(sizes[pack_order]))).astype(np.int64)
    out = PackPlan(window_bins=np.array([0, len(new_offsets) - 1], np.int64), bin_offsets=new_offsets,
                   piece_gid=source.piece_gid[take], piece_start=source.piece_start[take],
                   piece_len=source.piece_len[take], piece_padded=source.piece_padded[take],
                   dropped=source.dropped, truncated=source.truncated, tokens_dropped=0, tokens_truncated=0)
    return out, step[pack_order], rank[pack_order], micro_batch[pack_order]


def warm_up(algorithms=ALGORITHMS) -> None:
    """Run every planning kernel once on a few lengths, so numba compiles what is not cached yet
    and caches it on disk (packctl/jit.py) for every later process. `python -m packctl.online`
    calls it; run it where a training image is built."""
    lengths = np.array([7, 3, 5, 2, 8, 1, 4, 6], dtype=np.int64)
    for algorithm in algorithms:
        packs = plan_packs(lengths, 8, algorithm=algorithm)
        plan_packs(lengths, 8, algorithm=algorithm, max_seqs_per_bin=2)
        if not cuts_items(algorithm):
            plan_packs(lengths, 16, algorithm=algorithm, groups=np.arange(8) // 2)
        plan_steps(packs=packs, dp_size=2)
    plan_steps(lengths, 2, capacity=8, balance_scope="ranks")  # Karmarkar-Karp over sequences (plan/kk.py)
    plan_packs(np.array([20, 3, 5]), 8, too_long="split")


# --- helpers ---------------------------------------------------------------------------------------

def _lengths(lengths) -> np.ndarray:
    """The lengths as int64, checked: 1-D integers >= 1. A torch tensor is read where it lives
    (`.detach().cpu()`), without importing torch here."""
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):
        lengths = lengths.detach().cpu().numpy()
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise PackctlError(f"lengths must be 1-D (one length per sequence), got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, np.int64)
    if array.dtype.kind not in "iu":
        raise PackctlError(f"lengths must be integers, got dtype {array.dtype}: pass token counts")
    array = array.astype(np.int64, copy=False)
    if array.min() < 1:
        bad = np.flatnonzero(array < 1)
        raise PackctlError(f"lengths[{int(bad[0])}] = {int(array[bad[0]])}: every length must be >= 1; leave empty "
                           f"sequences out ({bad.size} such)")
    return np.ascontiguousarray(array)


def _groups(groups, n: int) -> np.ndarray:
    if hasattr(groups, "detach") and hasattr(groups, "cpu"):
        groups = groups.detach().cpu().numpy()
    array = np.asarray(groups)
    if array.shape != (n,) or (array.size and array.dtype.kind not in "iu"):
        raise PackctlError(f"groups must be one integer id per sequence, shape ({n},), got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PackctlError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _choice(value: str, choices, name: str) -> None:
    if value not in choices:
        raise PackctlError(f"{name} {value!r} is not one of {', '.join(choices)}")


def _target_packs(count: int, min_packs: int | None, packs_multiple: int | None) -> int:
    """At least `min_packs`, then up to a multiple of `packs_multiple`: (3, 4, 2) -> 4, (5, None, 4) -> 8."""
    target = max(count, 0 if min_packs is None else _nonnegative(min_packs, "min_packs"))
    if packs_multiple is not None:
        target = -(-target // _positive(packs_multiple, "packs_multiple")) * packs_multiple
    return target


def _nonnegative(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise PackctlError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def _more_packs(offsets: np.ndarray, pinned: np.ndarray, target: int) -> tuple[np.ndarray, np.ndarray]:
    """New packs until there are `target`: each takes the last movable piece of the pack with the
    most pieces (ties: the lowest pack), which keeps one piece at least. Returns the new offsets
    and the pieces in their new order (new packs after the old ones).

        offsets [0, 2, 5] (packs of 2 and 3 pieces), target 3 -> pack 1 gives its last piece:
        offsets [0, 2, 4, 5], order [0, 1, 2, 3, 4]
    """
    num = len(offsets) - 1
    if target <= num:
        return offsets, np.arange(int(offsets[-1]), dtype=np.int64)
    members = [list(range(int(a), int(b))) for a, b in zip(offsets[:-1], offsets[1:])]
    heap = [(-len(m), p) for p, m in enumerate(members)]
    heapq.heapify(heap)
    added: list[int] = []
    while num + len(added) < target:
        while heap:
            size, p = heapq.heappop(heap)
            movable = [i for i in members[p] if not pinned[i]]
            if len(members[p]) > 1 and movable:
                break
        else:
            raise PackctlError(f"min_packs/packs_multiple ask for {target} packs, but only {num + len(added)} can be "
                               f"made (a pack keeps one sequence at least; split pieces and group members stay): "
                               f"lower min_packs or packs_multiple, or pass more sequences")
        piece = movable[-1]
        members[p].remove(piece)
        added.append(piece)
        heapq.heappush(heap, (-len(members[p]), p))
    members.extend([piece] for piece in added)
    take = np.array([i for m in members for i in m], dtype=np.int64)
    new_offsets = np.concatenate(([0], np.cumsum([len(m) for m in members]))).astype(np.int64)
    return new_offsets, take


def _packs_of(plan: PackPlan, n: int, capacity: int, align: int, group_of: np.ndarray | None,
              max_seqs_per_bin: int | None) -> Packs:
    """`Packs` of a one-window plan over sequences 0..n-1 (their `piece_gid`)."""
    offsets = plan.bin_offsets.astype(np.int64, copy=False)
    sequence = plan.piece_gid.astype(np.int64, copy=False)
    counts = np.diff(offsets)
    piece_pack = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    piece_position = np.arange(len(sequence), dtype=np.int64) - np.repeat(offsets[:-1], counts)
    pack = np.full(n, -1, np.int64)
    position = np.full(n, -1, np.int64)
    if plan.piece_start.any():  # split sequences: their first token is in their piece starting at 0
        firsts = np.flatnonzero(plan.piece_start == 0)
        sequence_of_first, piece_pack, piece_position = sequence[firsts], piece_pack[firsts], piece_position[firsts]
    else:
        sequence_of_first = sequence
    pack[sequence_of_first] = piece_pack
    position[sequence_of_first] = piece_position
    return Packs(capacity=capacity, align=align, offsets=offsets, sequence=sequence,
                 start=plan.piece_start.astype(np.int64, copy=False),
                 length=plan.piece_len.astype(np.int64, copy=False),
                 padded=plan.piece_padded.astype(np.int64, copy=False), pack=pack, position=position,
                 dropped=np.asarray(plan.dropped, np.int64), truncated=np.asarray(plan.truncated, np.int64),
                 group_id=None if group_of is None else group_of[sequence], max_seqs_per_bin=max_seqs_per_bin)


def _in_larger_group(group_of: np.ndarray) -> np.ndarray:
    """True for each sequence whose group has two members or more: groups [4, 4, 9] -> [T, T, F]."""
    _, inverse, sizes = np.unique(group_of, return_inverse=True, return_counts=True)
    return sizes[inverse.reshape(-1)] > 1


def _group_of_sequences(packs: Packs) -> np.ndarray:
    group_of = np.zeros(len(packs.pack), np.int64)
    group_of[packs.sequence] = packs.group_id
    return group_of


def _imbalance(grid: np.ndarray) -> dict[str, float]:
    """max / mean over ranks of a steps x ranks grid: the mean over steps and the worst step."""
    if grid.size == 0:
        return {"mean": 1.0, "max": 1.0}
    mean = grid.mean(axis=1)
    per_step = np.where(mean > 0, grid.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
    return {"mean": float(per_step.mean()), "max": float(per_step.max())}

"""The plan stage: this rank's windows planned into packs, then batch shapes, balance over
data-parallel ranks and each pack's written length.

Used by `pack` and by the what-if of `packctl stats` (`plan_corpus`), through the same functions, so
the what-if shows exactly the packs `pack` writes:

    plan_stage             plan_windows -> batch shapes -> pack order (or balance, which orders
                           whole steps) -> final_pack_lengths
    final_pack_lengths     each pack's written length: --pad-to, --pack-multiple, --shape-buckets
                           (batch mode: rows x padded length)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from packctl.contract.schema import BATCH_SIZE, DP_RANK, LR_SCALE, MICRO_BATCH, PADDED_LEN, STEP, limit_sum_name
from packctl.errors import PackctlError
from packctl.mpi.comm import Comm, SingleComm
from packctl.pipeline.order import Ordered, check_groups_fit_everywhere, limit_error, order_corpus, too_long_message
from packctl.plan.align import pack_lengths_padded
from packctl.plan.balance import BalancedPlan, balance_plan, lr_scales
from packctl.plan.pack_order import reorder_packs
from packctl.plan.groups import group_sizes
from packctl.plan.prefix import piece_parents
from packctl.plan.shapes import (batch_shapes, buckets_from_histogram, length_histogram, planned_item_lengths,
                                 with_row_length)
from packctl.plan.windows import (PackPlan, SequenceOverLimit, SequenceTooLong, UncuttableSequence, merge_plans,
                                  plan_windows)
from packctl.specs import BatchUnit, LengthSpec, LrScaling, Mode, Specs
from packctl.source.index import SequenceIndex


@dataclass
class Balanced:
    result: BalancedPlan
    columns: dict[str, np.ndarray]  # per pack of this rank: step, dp_rank, micro_batch (lr_scale); encode types them
    figures: dict[str, Any]  # this rank's steps, for the report


@dataclass
class Planned:
    """What planning decided on this rank: its windows' packs, each pack's written length, the
    extra per-pack columns (balance, batch shapes) and the `--shape-buckets` lengths."""

    plan: PackPlan
    pack_lens: np.ndarray
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    balanced: Balanced | None = None
    buckets: np.ndarray | None = None


def join_epochs(epochs: list[Planned]) -> Planned:
    """This rank's plans of every epoch as one (its windows of every epoch are one run of the
    global order, `order_and_distribute`): what it hands to the writers. Steps, `--shape-buckets`
    and balance figures stay those of each epoch."""
    if len(epochs) == 1:
        return epochs[0]
    columns = {name: np.concatenate([e.columns[name] for e in epochs]) for name in epochs[0].columns}
    return Planned(plan=merge_plans([e.plan for e in epochs]), pack_lens=np.concatenate([e.pack_lens for e in epochs]),
                   columns=columns)


def plan_stage(comm: Comm, ordered: Ordered, specs: Specs,
               progress: Callable[[int], None] | None = None) -> Planned:
    """Plan this rank's windows (plan/windows.py, `specs.windows`), then batch shapes, balance
    (`specs.balance`, `specs.steps`) and final pack lengths (`specs.lengths`)."""
    lengths = specs.lengths
    batch = lengths.mode == Mode.BATCH
    item_buckets = batch_buckets(comm, ordered.lengths, lengths) if batch and lengths.shape_buckets else None
    windows = specs.windows if item_buckets is None else dataclasses.replace(specs.windows, buckets=item_buckets)
    plan = plan_windows(ordered.gids, ordered.lengths, windows, first_window=ordered.first_window,
                        progress=progress, new_group=ordered.new_group,
                        extra=ordered.extra if windows.limits else None, shared=ordered.shared)
    if batch:
        plan = with_row_length(plan, batch_shapes(plan, lengths.max_tokens, item_buckets)[0])
    if specs.balance is None:  # with --dp-size the balancer orders whole steps instead
        plan = reorder_packs(plan, windows.pack_order, windows.seed, ordered.first_window)
    balanced = balance(comm, plan, specs, ordered, item_buckets) if specs.balance is not None else None
    if balanced is not None:
        plan = balanced.result.plan
    pack_lens, columns, buckets = final_pack_lengths(comm, plan, lengths, item_buckets)
    if balanced is not None:
        columns = {**balanced.columns, **columns}
    if plan.piece_extra is not None:  # --limit: each pack's sum of each limited column (COL_sum)
        sums = plan.extra_loads()
        columns.update({limit_sum_name(name): sums[:, j].copy() for j, name in enumerate(specs.report.limits)})
    return Planned(plan=plan, pack_lens=pack_lens, columns=columns, balanced=balanced,
                   buckets=item_buckets if batch else buckets)


def final_pack_lengths(comm: Comm, plan: PackPlan, spec: LengthSpec, item_buckets: np.ndarray | None = None
                       ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
    """The length each pack is written with, the columns that go with it, and the
    `--shape-buckets` lengths (pack mode, computed over every rank's packs).

    Pack mode: the padded load rounded to --pad-to (capacity, or a multiple of --pack-multiple),
    then up to the nearest of the K bucket lengths. Batch mode: rows x padded length of each
    micro-batch (`padded_len`, `batch_size` columns)."""
    if spec.mode == Mode.BATCH:
        padded_len, rows = batch_shapes(plan, spec.max_tokens, item_buckets)
        return padded_len * rows, {PADDED_LEN: padded_len, BATCH_SIZE: rows}, None
    pack_lens = pack_lengths_padded(plan.loads(padded=True), spec.capacity, spec.pad_to, spec.pack_multiple)
    if not spec.shape_buckets:
        return pack_lens, {}, None
    histogram = comm.allreduce_sum(length_histogram(pack_lens, spec.pack_multiple, spec.capacity))
    buckets = buckets_from_histogram(histogram, spec.pack_multiple, spec.shape_buckets)
    if len(pack_lens):
        pack_lens = buckets[np.searchsorted(buckets, pack_lens, side="left")]
    return pack_lens, {}, buckets


def batch_buckets(comm: Comm, lengths: np.ndarray, spec: LengthSpec) -> np.ndarray:
    """Batch mode's `--shape-buckets` padded lengths, from every rank's sequence lengths."""
    items = planned_item_lengths(lengths, spec.plan_capacity, spec.align, spec.too_long)
    histogram = comm.allreduce_sum(length_histogram(items, spec.align, spec.plan_capacity))
    return buckets_from_histogram(histogram, spec.align, spec.shape_buckets)


def check_something_to_pack(comm: Comm, plan: PackPlan, index: SequenceIndex, lengths: LengthSpec,
                            inputs: list[str], skipped_empty: int) -> None:
    """An output without a single pack is no dataset: refuse it, saying why every sequence went."""
    if comm.allreduce_sum(plan.num_bins) > 0:
        return
    dropped = comm.allreduce_sum(len(plan.dropped))
    if plan.over_limit is None:
        raise PackctlError(
            f"{', '.join(str(i) for i in inputs)}: nothing to pack: of {index.num_sequences} sequences, "
            f"{dropped} are longer than the capacity {lengths.plan_capacity} (--too-long {lengths.too_long}) and "
            f"{skipped_empty} are empty (--skip-empty); raise --capacity or pass --too-long truncate|split",
            everywhere=True)
    over_limit = comm.allreduce_sum(len(plan.over_limit))
    raise PackctlError(
        f"{', '.join(str(i) for i in inputs)}: nothing to pack: of {index.num_sequences} sequences, "
        f"{over_limit} cost more than a --limit lets a pack hold, {dropped - over_limit} more are longer than the "
        f"capacity {lengths.plan_capacity} (--too-long {lengths.too_long}) and {skipped_empty} are empty "
        "(--skip-empty); raise the limits or --capacity", everywhere=True)


def plan_corpus(index, specs: Specs, ordered: Ordered | None = None,
                progress: Callable[[int], None] | None = None) -> Planned:
    """The packs of a whole corpus, in one process, exactly as `pack` plans and writes them with
    these specs (the what-if of `packctl stats`): `plan_stage` on one rank, so batch shapes,
    balancing over --dp-size ranks and --shape-buckets are those of `pack` too.

    `index` as for `order_corpus` (and `describe(gid)`, for the over-long error); `ordered` may
    pass a precomputed `order_corpus(index, specs.order, ...)` (the same for every capacity and
    algorithm). With groups, a group over this capacity is the error `pack` gives, whatever
    --too-long says.
    """
    if ordered is None:
        ordered = order_corpus(index, specs.order, specs.groups, specs.windows)
    elif ordered.new_group is not None:  # the order was made at one capacity: check this one
        check_groups_fit_everywhere(SingleComm(), ordered, index, specs.groups, specs.windows)
    try:
        return plan_stage(SingleComm(), ordered, specs, progress)
    except SequenceTooLong as exc:
        raise PackctlError(too_long_message(index.describe(exc.gid), exc.length, exc.padded, exc.capacity)) from None
    except (SequenceOverLimit, UncuttableSequence) as exc:
        raise limit_error(index, tuple(specs.report.limits), exc) from None


def balance(comm: Comm, plan: PackPlan, specs: Specs, ordered: Ordered,
            item_buckets: np.ndarray | None = None) -> Balanced:
    """Balance this rank's windows (plan/balance.py, `specs.balance`, `specs.steps`); steps are
    numbered after the ranks before, and `lr_scale` needs the mean batch size of all ranks when no
    reference is given. Members of a group (`ordered.group_starts`, --group-column with
    --group-scope pack) stay in their pack, and with --limit so does every sequence that has a
    cost: only sequences of no cost move between packs (`--balance-scope sequences`, equal counts),
    so every pack keeps every limit. With --share-prefix (`ordered.shared`) a branch's attention
    cost counts the prefix it attends to."""
    spec, steps, lengths = specs.balance, specs.steps, specs.lengths
    first_window, group_starts, shared = ordered.first_window, ordered.group_starts, ordered.shared is not None
    shape = None
    if steps.warmup_shapes:
        # a pack's shape: its padded length in batch mode (every piece already holds it), else the
        # length it will be written with (the buckets as planned: moves may still change them)
        if lengths.mode == Mode.BATCH:
            shape = plan.piece_padded[plan.bin_offsets[:-1]]
        else:
            shape = final_pack_lengths(comm, plan, lengths, item_buckets)[0]
    pinned = None  # with --group-scope step a group's members may move between the packs of its step
    if group_starts is not None and steps.pin_groups:
        pinned = group_sizes(plan.piece_gid, group_starts) > 1
    if plan.piece_extra is not None:  # --limit: a sequence with a cost stays in its pack, which keeps every limit
        costly = (plan.piece_extra > 0).any(axis=1)
        pinned = costly if pinned is None else pinned | costly
    context = None
    if shared:
        context = np.where(piece_parents(plan, group_starts) >= 0, plan.piece_start, 0).astype(np.float64)
    result = balance_plan(plan, spec, first_window=first_window,
                          pack_shape=shape if plan.num_bins else None, pinned=pinned, context=context)
    first_step = comm.exscan(result.num_steps)
    sizes = result.step_sequences if steps.batch_unit == BatchUnit.SEQUENCES else result.step_tokens
    ref = steps.ref_batch_size
    if ref is None:
        num_steps = comm.allreduce_sum(result.num_steps)
        ref = comm.allreduce_sum(int(sizes.sum())) / max(num_steps, 1)
    scales = lr_scales(sizes, ref, steps.lr_scaling)
    columns = {STEP: result.step + first_step, DP_RANK: result.dp_rank, MICRO_BATCH: result.micro_batch}
    if steps.lr_scaling != LrScaling.NONE:
        columns[LR_SCALE] = scales[result.step]
    figures = {
        "before_tokens": result.before_tokens, "before_attention": result.before_attention,
        "after_tokens": result.after_tokens, "after_attention": result.after_attention,
        "step_sequences": result.step_sequences, "step_tokens": result.step_tokens, "lr_scale": scales,
        "ref_batch_size": float(ref), "unequal_steps": result.unequal_steps, "packs_added": result.packs_added,
        "packs_per_step": np.bincount(result.step, minlength=result.num_steps),
    }
    if result.after_cost_column is not None:  # --balance-cost: the column's grids too
        figures["before_cost_column"] = result.before_cost_column
        figures["after_cost_column"] = result.after_cost_column
    return Balanced(result=result, columns=columns, figures=figures)

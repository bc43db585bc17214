"""Order and plan: from sequence lengths to packs with their final lengths, on one rank or many.

Used by `pack` (pipeline.py) and by the what-if of `packctl stats` (`plan_corpus`), through the
same functions, so the what-if shows exactly the packs `pack` writes:

    order_and_distribute   sample sort of (key, gid), then whole windows to ranks by position
    plan_stage             plan_windows -> batch shapes -> balance -> final_pack_lengths
    final_pack_lengths     each pack's written length: --pad-to, --pack-multiple, --shape-buckets
                           (batch mode: rows x padded length)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from packctl.config import PackConfig
from packctl.mpi.comm import Comm, SingleComm
from packctl.mpi.samplesort import redistribute, sample_sort
from packctl.errors import PackctlError
from packctl.source.parquet import SequenceIndex, describe_gid
from packctl.plan.align import pack_lengths_padded, round_up
from packctl.plan.groups import GroupTooLong, check_groups_fit, group_ids, group_sizes, run_starts, run_totals
from packctl.plan.balance import BalancedPlan, BalanceSpec, balance_plan, lr_scales
from packctl.plan.order import epoch_seed, order_keys
from packctl.plan.shapes import (batch_shapes, buckets_from_histogram, length_histogram, planned_item_lengths,
                                 with_row_length)
from packctl.plan.windows import (GroupTooBigForStep, PackPlan, SequenceTooLong, WindowOptions, check_groups_fit_step,
                                  merge_plans, plan_windows)


def too_long_message(where: str, length: int, padded: int, capacity: int) -> str:
    """The one error for a sequence over the capacity under --too-long error."""
    return (f"{where}: sequence of {length} tokens (padded to {padded}) is longer than the capacity {capacity}; "
            "pass --too-long drop|truncate|split or raise --capacity")


def check_too_long(comm: Comm, index: SequenceIndex, config: PackConfig) -> None:
    """With --too-long error, name the over-long sequence with the smallest gid, on every rank."""
    if config.too_long != "error":
        return
    over = round_up(index.lengths, config.align) > config.plan_capacity
    if index.group_starts is not None:  # a member of a larger group gets the group's error
        over &= group_sizes(index.gid_lo + np.arange(len(over)), index.group_starts) == 1
    over = np.flatnonzero(over)
    mine = (int(index.gid_lo + over[0]), int(index.lengths[over[0]])) if len(over) else None
    found = [f for f in comm.allgather(mine) if f is not None]
    if found:
        gid, length = min(found)
        raise PackctlError(too_long_message(index.describe(gid), length, int(round_up(length, config.align)),
                                            config.plan_capacity), everywhere=True)


@dataclass
class Ordered:
    """This rank's whole windows of the global order."""

    gids: np.ndarray
    lengths: np.ndarray  # true lengths
    first_window: int  # index of its first window in the global order (of its epoch, with --epochs)
    # --group-column: True on the first member of each group, and SequenceIndex.group_starts
    new_group: np.ndarray | None = None
    group_starts: np.ndarray | None = None


def order_and_distribute(comm: Comm, index: SequenceIndex, config: PackConfig, epoch: int = 0) -> Ordered:
    """This rank's whole windows of the global order (of epoch `epoch`, ordered with `config.seed`).

    The order is a sample sort of (key, gid) over all ranks (input order needs none: blocks are
    already split in gid order); windows are then moved so each lives whole on one rank, rank r
    holding windows [ceil(r*W/size), ceil((r+1)*W/size)) (planning is cheap: writing is dealt out
    later by tokens, mpi/assign.py). With `config.epochs` E the W windows of every epoch count as
    windows e*W ... (e+1)*W - 1 of E*W, so each rank's windows of all epochs are one run of the
    global order (epoch 0's packs, then epoch 1's, ...); `first_window` counts within the epoch.

    With --group-column every member of a group gets the group's key (hash of its id, or its
    summed padded length), so ties broken by gid keep each group a run of the order, and windows
    count groups: a group never straddles a window, nor a rank.
    """
    n_local = len(index.lengths)
    gids = index.gid_lo + np.arange(n_local, dtype=np.int64)
    lengths = index.lengths
    total = index.num_sequences
    if config.skip_empty:  # empty sequences take no place in the order (nor in window positions)
        kept = lengths > 0
        gids, lengths = gids[kept], lengths[kept]
        total = comm.allreduce_sum(len(gids))
    groups = index.group_starts
    if config.order != "input":
        padded = round_up(lengths, config.align)
        if groups is not None:
            ids = group_ids(gids, groups)
            keys = order_keys(ids, group_totals(comm, ids, padded), config.order, seed=config.seed,
                              curriculum_order=config.curriculum_order)
        else:
            keys = order_keys(gids, padded, config.order, seed=config.seed, curriculum_order=config.curriculum_order)
        _, gids, lengths = sample_sort(comm, keys, gids, payload=lengths)
    starts = None
    if groups is not None:
        ids = group_ids(gids, groups)
        last = comm.allgather(int(ids[-1]) if len(ids) else None)
        starts = run_starts(ids, next((x for x in reversed(last[:comm.rank]) if x is not None), None))
        total = comm.allreduce_sum(int(starts.sum()))
    num_windows = -(-total // config.window)
    before, all_windows = epoch * num_windows, config.epochs * num_windows  # windows of earlier epochs, of all
    if comm.size > 1:
        # the window of each sequence: by its position, or with groups by its group's
        counted = np.ones(len(gids), dtype=bool) if starts is None else starts
        unit = comm.exscan(int(counted.sum())) + np.cumsum(counted) - 1
        owners = (before + unit // config.window) * comm.size // all_windows
        columns = [gids, lengths] + ([starts.astype(np.int64)] if starts is not None else [])
        moved = redistribute(comm, columns, 0, lambda positions: owners[positions])
        gids, lengths = moved[0], moved[1]
        starts = moved[2].astype(bool) if starts is not None else None
    first = -(-comm.rank * all_windows // comm.size) - before
    ordered = Ordered(gids=gids, lengths=lengths, first_window=min(max(first, 0), num_windows),
                      new_group=starts, group_starts=groups)
    if groups is not None:
        check_groups_fit_everywhere(comm, ordered, index, config)
    return ordered


def group_too_long_message(where: str, members: int, padded: int, capacity: int) -> str:
    """The one error for a group over the capacity, whatever --too-long says."""
    return (f"{where}: the group starting here holds {members} sequences of {padded} tokens (padded), more than "
            f"the capacity {capacity}; a group is packed whole into one pack (--too-long applies to single sequences "
            "only): raise --capacity, or keep each group within one optimizer step instead (--group-scope step "
            "with --dp-size)")


def group_too_big_message(where: str, members: int, padded: int, packs: int, config: PackConfig) -> str:
    """The one error for a group that does not fit one step (--group-scope step)."""
    return (f"{where}: the group starting here holds {members} sequences of {padded} tokens (padded), which take "
            f"{packs} packs, more than the {config.dp_size} x {config.micro_batches} of a step; a group is kept "
            "within one step: raise --micro-batches or --capacity")


def check_groups_fit_everywhere(comm: Comm, ordered: Ordered, index: SequenceIndex, config: PackConfig) -> None:
    """Name the group that cannot be placed with the smallest first gid, on every rank (groups are
    whole on one rank once ordered): over the capacity (--group-scope pack), or with a member
    over the capacity or more packs than a step (--group-scope step)."""
    padded = round_up(ordered.lengths, config.align)
    mine = None
    try:
        if config.group_scope == "step":
            check_groups_fit_step(ordered.gids, ordered.lengths, ordered.new_group, window_options(config))
        else:
            check_groups_fit(ordered.gids, padded, ordered.new_group, config.plan_capacity)
    except GroupTooLong as exc:
        mine = (exc.gid, exc.members, exc.padded, 0)
    except GroupTooBigForStep as exc:
        mine = (exc.gid, exc.members, exc.padded, exc.packs)
    found = [f for f in comm.allgather(mine) if f is not None]
    if found:
        gid, members, total, packs = min(found)
        first_row = int(group_ids(np.array([gid]), index.group_starts)[0])  # --skip-empty may have left it out
        where = describe_gid([f.path for f in index.files], index.file_offsets, first_row, config.group_column)
        if packs:
            message = group_too_big_message(where, members, total, packs, config)
        elif config.group_scope == "step":
            message = (f"{where}: the group starting here holds a sequence longer than the capacity "
                       f"{config.plan_capacity} (its {members} sequences hold {total} tokens, padded); a group's "
                       "members are packed whole: raise --capacity (--too-long applies to single sequences only)")
        else:
            message = group_too_long_message(where, members, total, config.plan_capacity)
        raise PackctlError(message, everywhere=True)


def group_totals(comm: Comm, ids: np.ndarray, padded: np.ndarray) -> np.ndarray:
    """Each sequence's group padded length, summed over every rank (`ids` in gid order, as scan
    leaves them: only this rank's first and last group can have members elsewhere)."""
    totals = run_totals(padded, run_starts(ids))
    if comm.size > 1:
        edges = {int(ids[0]): int(totals[0]), int(ids[-1]): int(totals[-1])} if len(ids) else {}
        elsewhere: dict[int, int] = {}
        for r, found in enumerate(comm.allgather(edges)):
            for g, t in found.items():
                if r != comm.rank:
                    elsewhere[g] = elsewhere.get(g, 0) + t
        for g in edges:
            if g in elsewhere:
                totals[ids == g] += elsewhere[g]
    return totals


def order_corpus(index, config: PackConfig) -> Ordered:
    """The sequence order of `config` for the whole corpus, in one process: `order_and_distribute`
    on a single rank, so the what-if orders exactly as `pack` does (with `index.group_starts`,
    whole groups keyed by their id or summed padded length, `new_group` marking each group's first
    member, and a group over the capacity refused). The order depends on the order options, the
    alignment and the groups only, not on the capacity or the algorithm.

    `index` needs what a single rank's SequenceIndex gives it: `lengths` (true length of every
    gid), `gid_lo` 0, `num_sequences`, `files` and `file_offsets` (where a row comes from) and
    `group_starts` (None without --group-column).
    """
    return order_and_distribute(SingleComm(), index, config)


@dataclass
class Balanced:
    result: BalancedPlan
    columns: dict[str, np.ndarray]  # per pack of this rank: step, dp_rank, micro_batch (lr_scale)
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


def config_of_epoch(config: PackConfig, epoch: int) -> PackConfig:
    """The options epoch `epoch` of `--epochs` is ordered and planned with: its own seed
    (plan/order.py `epoch_seed`), so its shuffle, ffs packing and step grouping are its own."""
    return dataclasses.replace(config, seed=epoch_seed(config.seed, epoch)) if epoch else config


def join_epochs(epochs: list[Planned]) -> Planned:
    """This rank's plans of every epoch as one (its windows of every epoch are one run of the
    global order, `order_and_distribute`): what it hands to the writers. Steps, `--shape-buckets`
    and balance figures stay those of each epoch."""
    if len(epochs) == 1:
        return epochs[0]
    columns = {name: np.concatenate([e.columns[name] for e in epochs]) for name in epochs[0].columns}
    return Planned(plan=merge_plans([e.plan for e in epochs]), pack_lens=np.concatenate([e.pack_lens for e in epochs]),
                   columns=columns)


def window_options(config: PackConfig, item_buckets: np.ndarray | None = None) -> WindowOptions:
    """The planning options of `config` (batch mode plans padded micro-batches)."""
    batch = config.mode == "batch"
    return WindowOptions(capacity=config.plan_capacity, align=config.align,
                         algorithm="batch" if batch else config.algorithm, too_long=config.too_long,
                         window=config.window, max_seqs_per_bin=config.max_seqs_per_bin, seed=config.seed,
                         pool_size=config.pool_size, pool_strategy=config.pool_strategy,
                         max_tokens=config.resolved_max_tokens if batch else None, buckets=item_buckets,
                         **step_scope_options(config))


def step_scope_options(config: PackConfig) -> dict[str, int | None]:
    """--group-scope step: the planner cuts steps itself (`WindowOptions.step_packs/step_tokens`)."""
    if config.group_scope != "step":
        return {}
    packs = config.dp_size * config.micro_batches if config.micro_batches is not None else None
    return {"step_packs": packs, "step_tokens": config.step_tokens}


def plan_stage(comm: Comm, ordered: Ordered, config: PackConfig,
               progress: Callable[[int], None] | None = None) -> Planned:
    """Plan this rank's windows (plan/windows.py), then shapes, balance and final pack lengths."""
    batch = config.mode == "batch"
    item_buckets = batch_buckets(comm, ordered.lengths, config) if batch and config.shape_buckets else None
    plan = plan_windows(ordered.gids, ordered.lengths, window_options(config, item_buckets),
                        first_window=ordered.first_window, progress=progress, new_group=ordered.new_group)
    if batch:
        plan = with_row_length(plan, batch_shapes(plan, config.resolved_max_tokens, item_buckets)[0])
    balanced = (balance(comm, plan, config, ordered.first_window, item_buckets, ordered.group_starts)
                if config.balanced else None)
    if balanced is not None:
        plan = balanced.result.plan
    pack_lens, columns, buckets = final_pack_lengths(comm, plan, config, item_buckets)
    if balanced is not None:
        columns = {**balanced.columns, **columns}
    return Planned(plan=plan, pack_lens=pack_lens, columns=columns, balanced=balanced,
                   buckets=item_buckets if batch else buckets)


def final_pack_lengths(comm: Comm, plan: PackPlan, config: PackConfig, item_buckets: np.ndarray | None = None
                       ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
    """The length each pack is written with, the columns that go with it, and the
    `--shape-buckets` lengths (pack mode, computed over every rank's packs).

    Pack mode: the padded load rounded to --pad-to (capacity, or a multiple of --pack-multiple),
    then up to the nearest of the K bucket lengths. Batch mode: rows x padded length of each
    micro-batch (`padded_len`, `batch_size` columns)."""
    if config.mode == "batch":
        padded_len, rows = batch_shapes(plan, config.resolved_max_tokens, item_buckets)
        return padded_len * rows, {"padded_len": padded_len.astype(np.int32), "batch_size": rows.astype(np.int32)}, None
    pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                    config.resolved_pack_multiple)
    if not config.shape_buckets:
        return pack_lens, {}, None
    histogram = comm.allreduce_sum(length_histogram(pack_lens, config.resolved_pack_multiple, config.capacity))
    buckets = buckets_from_histogram(histogram, config.resolved_pack_multiple, config.shape_buckets)
    if len(pack_lens):
        pack_lens = buckets[np.searchsorted(buckets, pack_lens, side="left")]
    return pack_lens, {}, buckets


def batch_buckets(comm: Comm, lengths: np.ndarray, config: PackConfig) -> np.ndarray:
    """Batch mode's `--shape-buckets` padded lengths, from every rank's sequence lengths."""
    items = planned_item_lengths(lengths, config.plan_capacity, config.align, config.too_long)
    histogram = comm.allreduce_sum(length_histogram(items, config.align, config.plan_capacity))
    return buckets_from_histogram(histogram, config.align, config.shape_buckets)


def check_something_to_pack(comm: Comm, plan: PackPlan, index: SequenceIndex, config: PackConfig,
                            skipped_empty: int) -> None:
    """An output without a single pack is no dataset: refuse it, saying why every sequence went."""
    if comm.allreduce_sum(plan.num_bins) > 0:
        return
    dropped = comm.allreduce_sum(len(plan.dropped))
    raise PackctlError(
        f"{', '.join(str(i) for i in config.inputs)}: nothing to pack: of {index.num_sequences} sequences, "
        f"{dropped} are longer than the capacity {config.plan_capacity} (--too-long {config.too_long}) and "
        f"{skipped_empty} are empty (--skip-empty); raise --capacity or pass --too-long truncate|split",
        everywhere=True)


def plan_corpus(index, config: PackConfig, ordered: Ordered | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[PackPlan, np.ndarray, np.ndarray | None]:
    """The packs of a whole corpus, their final lengths and the `--shape-buckets` lengths, in one
    process, exactly as `pack(config)` writes them (the what-if of `packctl stats`).

    `index` as for `order_corpus` (and `describe(gid)`, for the over-long error); `ordered` may
    pass a precomputed `order_corpus(index, config)` (the same for every capacity and algorithm).
    With groups, a group over this capacity is the error `pack` gives, whatever --too-long says.
    """
    if ordered is None:
        ordered = order_corpus(index, config)
    if ordered.new_group is not None:  # the order was made at one capacity: check this one
        check_groups_fit_everywhere(SingleComm(), ordered, index, config)
    try:
        plan = plan_windows(ordered.gids, ordered.lengths, window_options(config), first_window=ordered.first_window,
                            progress=progress, new_group=ordered.new_group)
    except SequenceTooLong as exc:
        raise PackctlError(too_long_message(index.describe(exc.gid), exc.length, exc.padded, exc.capacity)) from None
    pack_lens, _, buckets = final_pack_lengths(SingleComm(), plan, config)
    return plan, pack_lens, buckets


def balance_spec(config: PackConfig) -> BalanceSpec:
    return BalanceSpec(dp_size=config.dp_size, micro_batches=config.micro_batches, step_tokens=config.step_tokens,
                       cost=config.balance, attn_coeff=float(config.attn_coeff),
                       # a micro-batch's shape is its own: in batch mode sequences never move between them
                       scope="packs" if config.mode == "batch" else config.balance_scope,
                       padded_cost=config.mode == "batch",
                       equal_counts=config.equal_counts, capacity=config.plan_capacity,
                       max_seqs_per_bin=config.max_seqs_per_bin, grouping=config.step_grouping, seed=config.seed)


def balance(comm: Comm, plan: PackPlan, config: PackConfig, first_window: int = 0,
            item_buckets: np.ndarray | None = None, group_starts: np.ndarray | None = None) -> Balanced:
    """Balance this rank's windows (plan/balance.py); steps are numbered after the ranks before,
    and `lr_scale` needs the mean batch size of all ranks when no reference is given. Members of
    a group (`group_starts`, --group-column) stay in their pack."""
    shape = None
    if config.warmup_shapes:
        # a pack's shape: its padded length in batch mode (every piece already holds it), else the
        # length it will be written with (the buckets as planned: moves may still change them)
        if config.mode == "batch":
            shape = plan.piece_padded[plan.bin_offsets[:-1]]
        else:
            shape = final_pack_lengths(comm, plan, config, item_buckets)[0]
    pinned = None  # with --group-scope step a group's members may move between the packs of its step
    if group_starts is not None and config.group_scope == "pack":
        pinned = group_sizes(plan.piece_gid, group_starts) > 1
    result = balance_plan(plan, balance_spec(config), first_window=first_window,
                          pack_shape=shape if plan.num_bins else None, pinned=pinned)
    first_step = comm.exscan(result.num_steps)
    sizes = result.step_sequences if config.batch_unit == "sequences" else result.step_tokens
    ref = config.ref_batch_size
    if ref is None:
        steps = comm.allreduce_sum(result.num_steps)
        ref = comm.allreduce_sum(int(sizes.sum())) / max(steps, 1)
    scales = lr_scales(sizes, ref, config.lr_scaling)
    columns = {"step": (result.step + first_step).astype(np.int32), "dp_rank": result.dp_rank.astype(np.int32),
               "micro_batch": result.micro_batch.astype(np.int32)}
    if config.lr_scaling != "none":
        columns["lr_scale"] = scales[result.step].astype(np.float32)
    figures = {
        "before_tokens": result.before_tokens, "before_attention": result.before_attention,
        "after_tokens": result.after_tokens, "after_attention": result.after_attention,
        "step_sequences": result.step_sequences, "step_tokens": result.step_tokens, "lr_scale": scales,
        "ref_batch_size": float(ref), "unequal_steps": result.unequal_steps, "packs_added": result.packs_added,
        "packs_per_step": np.bincount(result.step, minlength=result.num_steps),
    }
    return Balanced(result=result, columns=columns, figures=figures)

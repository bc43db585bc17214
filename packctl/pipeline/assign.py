"""Who writes what: after planning, every rank writes a contiguous run of packs of equal weight.

Planning is cheap (lengths only) and is done where the windows are; writing (building rows,
Parquet encoding) is most of a run, so it is dealt out on its own, by tokens:

    global pack order      | window 0 ............ | window 1 ............ | window 2 ... |
    shards (never straddle a window, at most shard_rows packs)
                           | train-00000 | train-00001 | train-00002 | train-00003 | ...
    units (row groups of ROW_GROUP_PACKS packs inside a shard; the unit of writing)
                           |u0|u1|u2|u3 |u4|u5|u6|u7 |u8|...
    writers (contiguous runs of units, cut where the written tokens reach k/N of the total)
                           | rank 0          | rank 1          | rank 2 ...

Shards and units depend on the plan only, never on the rank count, so the output bytes are the
same for any N. A shard cut by a writer boundary is written as two runs of row groups and joined
(output/stitch.py) by the rank that wrote its first unit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packctl.mpi.comm import Comm
from packctl.contract.manifest import shard_name
from packctl.plan.windows import PackPlan

# Packs per Parquet row group, the unit in which writing is dealt out to ranks (a shard of 1,024
# packs has 8): small enough to balance hundreds of ranks within a few percent, large enough that
# each column chunk compresses as well as a whole shard.
ROW_GROUP_PACKS = 128


def shard_bounds(window_bins: np.ndarray, shard_rows: int) -> np.ndarray:
    """First pack of every shard (plus the end): shards hold at most `shard_rows` packs and never
    straddle windows. window_bins [0, 5, 7], shard_rows 2 -> [0, 2, 4, 5, 7]."""
    bounds = [np.arange(lo, hi, shard_rows) for lo, hi in zip(window_bins[:-1], window_bins[1:])]
    starts = np.concatenate(bounds) if bounds else np.zeros(0, np.int64)
    return np.append(starts, window_bins[-1]).astype(np.int64)


@dataclass
class Units:
    """Units (row groups) of a run of packs: `bounds` first pack of each (+ end), `first_of_shard`
    whether a unit opens a new shard, `tokens` written tokens (padded pack lengths) of each."""

    bounds: np.ndarray
    first_of_shard: np.ndarray
    tokens: np.ndarray
    epoch: np.ndarray | None = None  # epoch of each unit (--epochs > 1)
    opens_window: np.ndarray | None = None  # whether a unit's first pack is the first of a window


def units_of(window_bins: np.ndarray, pack_lens: np.ndarray, shard_rows: int,
             row_group_packs: int = ROW_GROUP_PACKS, pack_epoch: np.ndarray | None = None) -> Units:
    """The units of packs planned in windows `window_bins` (pack lengths `pack_lens`; `pack_epoch`
    the epoch of each, whose windows never share a shard). Shard [0, 300) with 128-pack units ->
    units [0, 128), [128, 256), [256, 300)."""
    shards = shard_bounds(window_bins, shard_rows)
    starts, first = [], []
    for lo, hi in zip(shards[:-1].tolist(), shards[1:].tolist()):
        run = np.arange(lo, hi, row_group_packs, dtype=np.int64)
        starts.append(run)
        first.append(run == lo)
    bounds = np.append(np.concatenate(starts) if starts else np.zeros(0, np.int64), shards[-1]).astype(np.int64)
    sums = np.concatenate([[0], np.cumsum(pack_lens, dtype=np.int64)])
    return Units(bounds=bounds, first_of_shard=np.concatenate(first) if first else np.zeros(0, bool),
                 tokens=sums[bounds[1:]] - sums[bounds[:-1]],
                 epoch=np.asarray(pack_epoch, np.int64)[bounds[:-1]] if pack_epoch is not None else None,
                 opens_window=np.isin(bounds[:-1], window_bins[:-1]))


def writer_cuts(unit_tokens: np.ndarray, writers: int) -> np.ndarray:
    """First unit of each writer (+ end): contiguous runs, each cut at the unit boundary nearest
    to k/N of the written tokens. Tokens [4, 4, 4, 4], 2 writers -> [0, 2, 4]."""
    at = np.concatenate([[0], np.cumsum(unit_tokens, dtype=np.int64)])  # tokens before each boundary
    targets = np.arange(1, writers, dtype=np.float64) * float(at[-1]) / writers
    above = np.clip(np.searchsorted(at, targets, side="left"), 1, max(len(at) - 1, 1))  # first boundary >= target
    below = above - 1
    if len(at) > 1:
        nearer_above = (at[above] - targets) < (targets - at[below])
        cuts = np.where(nearer_above, above, below)
    else:
        cuts = np.zeros(len(targets), np.int64)
    return np.concatenate([[0], np.maximum.accumulate(cuts) if len(cuts) else cuts,
                           [len(unit_tokens)]]).astype(np.int64)


@dataclass
class Assignment:
    """The global unit table (the same on every rank) and the writers' runs over it."""

    unit_packs: np.ndarray  # packs of each unit, global order
    unit_tokens: np.ndarray
    unit_shard: np.ndarray  # global shard number of each unit
    unit_part: np.ndarray  # index of the unit inside its shard
    shard_units: np.ndarray  # units of each shard
    cuts: np.ndarray  # first unit of each writer (+ end)
    shard_epoch: np.ndarray | None = None  # epoch of each shard (--epochs > 1)
    # whether each shard opens a planning window (shards never straddle windows): the manifest's
    # `window_starts`, from which `packctl stats` measures order quality window by window
    shard_opens_window: np.ndarray | None = None

    @property
    def pack_cuts(self) -> np.ndarray:
        """First global pack of each writer (+ end)."""
        return np.concatenate([[0], np.cumsum(self.unit_packs, dtype=np.int64)])[self.cuts]

    def writer_tokens(self) -> np.ndarray:
        sums = np.concatenate([[0], np.cumsum(self.unit_tokens, dtype=np.int64)])
        return np.diff(sums[self.cuts])


def assign(per_rank_units: list[Units], writers: int) -> Assignment:
    """Join the planning ranks' units (in rank order) and cut them into `writers` runs."""
    packs = np.concatenate([np.diff(u.bounds) for u in per_rank_units]) if per_rank_units else np.zeros(0, np.int64)
    tokens = np.concatenate([u.tokens for u in per_rank_units]).astype(np.int64)
    first = np.concatenate([u.first_of_shard for u in per_rank_units])
    shard = np.cumsum(first) - 1
    shard_units = np.bincount(shard, minlength=int(shard[-1]) + 1 if len(shard) else 0)
    first_unit = np.concatenate([[0], np.cumsum(shard_units)])[:-1]
    shard_epoch = None
    if per_rank_units and per_rank_units[0].epoch is not None:
        shard_epoch = np.concatenate([u.epoch for u in per_rank_units])[first_unit].astype(np.int64)
    opens_window = None
    if per_rank_units and all(u.opens_window is not None for u in per_rank_units):
        opens_window = np.concatenate([u.opens_window for u in per_rank_units])[first_unit].astype(bool)
    return Assignment(unit_packs=packs.astype(np.int64), unit_tokens=tokens, unit_shard=shard.astype(np.int64),
                      unit_part=np.arange(len(shard)) - first_unit[shard], shard_units=shard_units,
                      cuts=writer_cuts(tokens, writers), shard_epoch=shard_epoch, shard_opens_window=opens_window)


def shard_path(shard: int, shard_epoch: np.ndarray | None) -> str:
    """The path of global shard `shard` in OUT: `data/train-00007.parquet`, or with epochs the
    shard's number within its epoch under the epoch's folder: `epoch-00001/data/train-00002.parquet`."""
    if shard_epoch is None:
        return shard_name(shard)
    epoch = int(shard_epoch[shard])
    return shard_name(shard - int(np.searchsorted(shard_epoch, epoch)), epoch)


def _send_slices(comm: Comm, arrays: list[np.ndarray], offsets: np.ndarray) -> list[np.ndarray]:
    """Send arrays[k][offsets[w]:offsets[w+1]] to rank w (offsets: per destination, + end); returns
    what arrived, concatenated in source-rank order."""
    counts = np.diff(offsets).astype(np.int64)
    return [comm.alltoallv(np.ascontiguousarray(a), counts)[0] for a in arrays]


@dataclass
class WriteJob:
    """What one rank writes: its packs in global order (a plan of one window), their lengths and
    extra columns, and the assignment that cuts them into units and shards."""

    plan: PackPlan
    pack_lens: np.ndarray
    columns: dict[str, np.ndarray]
    assignment: Assignment


def hand_over(comm: Comm, plan: PackPlan, pack_lens: np.ndarray, columns: dict[str, np.ndarray],
              assignment: Assignment) -> WriteJob:
    """Move the packs each rank planned to the ranks that write them, in global pack order. Only
    plan arrays travel (a few int64 per piece)."""
    if comm.size == 1:
        return WriteJob(plan, pack_lens, columns, assignment)
    first_pack = comm.exscan(plan.num_bins)
    cuts = np.clip(assignment.pack_cuts - first_pack, 0, plan.num_bins)  # per writer, in local packs
    piece_cuts = plan.bin_offsets[cuts]
    names = list(columns)  # the same names in the same order on every rank (the schema's order)
    per_pack = [pack_lens.astype(np.int64), np.diff(plan.bin_offsets)] + [columns[n] for n in names]
    got = _send_slices(comm, per_pack, cuts)
    costs = [] if plan.piece_extra is None else list(plan.piece_extra.T)  # --limit: each piece's values
    pieces = _send_slices(comm, [plan.piece_gid, plan.piece_start, plan.piece_len, plan.piece_padded, *costs],
                          piece_cuts)
    lens, counts, extra = got[0], got[1], dict(zip(names, got[2:]))
    empty = np.zeros(0, np.int64)
    piece_extra = None
    if plan.piece_extra is not None:
        piece_extra = np.stack(pieces[4:], axis=1) if costs else np.zeros((len(pieces[0]), 0), np.int64)
    mine = PackPlan(window_bins=np.array([0, len(lens)], np.int64),
                    bin_offsets=np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]),
                    piece_gid=pieces[0], piece_start=pieces[1], piece_len=pieces[2], piece_padded=pieces[3],
                    dropped=empty, truncated=empty, tokens_dropped=0, tokens_truncated=0, piece_extra=piece_extra)
    return WriteJob(mine, lens, extra, assignment)


@dataclass
class WriteRun:
    """One writer's run of units, in the writer's own pack numbering."""

    unit_bounds: np.ndarray  # first pack of each unit (index into the writer's packs), + end
    unit_shard: np.ndarray  # global shard number of each unit
    unit_part: np.ndarray  # index of each unit inside its shard
    shard_units: np.ndarray  # units of every shard (global table)
    shard_runs: dict[int, list[int]]  # shard cut by writer boundaries -> first part of each writer's run
    shard_epoch: np.ndarray | None = None  # epoch of every shard (global table; --epochs > 1)

    def shard_path(self, shard: int) -> str:
        return shard_path(shard, self.shard_epoch)

    @property
    def num_units(self) -> int:
        return len(self.unit_shard)

    def whole_here(self, shard: int) -> bool:
        return shard not in self.shard_runs

    def finishes(self, shard: int) -> bool:
        """This writer joins the runs of `shard` (it wrote its first unit)."""
        return shard in self.shard_runs and bool(np.any((self.unit_shard == shard) & (self.unit_part == 0)))


def write_run(assignment: Assignment, rank: int) -> WriteRun:
    lo, hi = int(assignment.cuts[rank]), int(assignment.cuts[rank + 1])
    unit_bounds = np.concatenate([[0], np.cumsum(assignment.unit_packs[lo:hi], dtype=np.int64)])
    shard_runs: dict[int, list[int]] = {}
    inner = assignment.cuts[1:-1]
    for cut in inner[(inner > 0) & (inner < len(assignment.unit_shard))].tolist():
        shard = int(assignment.unit_shard[cut])
        if int(assignment.unit_part[cut]) > 0:  # a writer boundary inside a shard
            shard_runs.setdefault(shard, [0]).append(int(assignment.unit_part[cut]))
    for shard, runs in shard_runs.items():
        shard_runs[shard] = sorted(set(runs))
    touched = set(assignment.unit_shard[lo:hi].tolist())
    return WriteRun(unit_bounds=unit_bounds, unit_shard=assignment.unit_shard[lo:hi],
                    unit_part=assignment.unit_part[lo:hi], shard_units=assignment.shard_units,
                    shard_runs={s: r for s, r in shard_runs.items() if s in touched},
                    shard_epoch=assignment.shard_epoch)

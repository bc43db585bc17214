"""Materialize: move every piece's tokens from its input block to its output shard, in bounded memory.

Each rank writes its run of units (row groups; pipeline/assign.py deals them out by tokens) and gets
the tokens of its pieces in one of two ways (`--token-transfer`):

  exchange  each rank reads its own input blocks once, in order, and sends every piece to the
            rank that writes it (Alltoallv, one round per block; a single process sends to itself):
      1. requests   every piece written here asks the rank that reads its block for
                    (gid, start, len): one Alltoallv of int64 records
      2. rounds     round k: every rank decodes its k-th block, gathers the requested pieces,
                    grouped by the rank that asked, and sends them (Alltoallv of int32 tokens
                    and labels); what arrives goes to the bucket of its unit
  read      each rank reads the blocks its pieces come from itself (a filesystem every rank
            sees; with input order that is about its own share of the blocks): no exchange

    3. write  a unit whose last piece has arrived is built and encoded at once (a Parquet row
              group), on a writer thread; a shard whose units are all encoded is joined
              (output/stitch.py) and made durable on a commit thread (fsync, rename, sha256, journal).
              A shard shared by two writers is joined, after both, by the one holding its start.

    blocks (input order)      units -> shards (output order)
    b0 b1 b2 b3 ...   --->    train-00000 <- u0 (pieces from b0, b3) u1 (b1)   complete after b3: joined
                              train-00001 <- u2 (pieces from b1, b2, b7)       complete after b7: joined

A plan (`--plan-only`) moves no token: each piece's loss tokens are known from scan
(`step_loss.piece_loss_tokens`), and every unit is laid out without token columns
(`ShardAssembler.write_plan`) and written as above, with no request, round or block read.

With input order and `concat`, units complete almost as fast as blocks are read and memory
stays at a few blocks; with shuffle or curriculum order a unit completes only when its last
source block is read, and the memory budget decides how much waits in memory and how much is
spilled to disk (and read back when its unit is complete).
"""
from __future__ import annotations

import errno
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import Scratch, copy_segments, offsets_of
from packctl.pipeline.assign import WriteJob, WriteRun, write_run
from packctl.source.parquet import read_kept_columns
from packctl.source.scan import TokenSource
from packctl.source.pieces import place_from_blocks
from packctl.pipeline.step_loss import piece_loss_tokens
from packctl.output.stitch import stitch, stitch_chunks
from packctl.output.encode import encode_table, rows_to_table
from packctl.contract.manifest import ShardEntry
from packctl.errors import PackctlError
from packctl.output.fs import error_number, write_failed
from packctl.output.outdir import OutputDir, StagedShard
from packctl.plan.windows import PackPlan
from packctl.plan.groups import group_ids
from packctl.plan.prefix import piece_parents, prefix_pieces
from packctl.contract.schema import GROUP_IDS, NUM_TOKENS, PARENT_SEGMENTS, SEQ_STARTS, SEQ_WEIGHTS, SOURCE_IDS
from packctl.contract.thd import counted_loss_columns, lay_out_packs, lay_out_sequences
from packctl.source.index import SequenceIndex
from packctl.runtime import RunContext
from packctl.specs import CarriedColumns

@dataclass
class _Bucket:
    """Pieces of one unit received so far (in memory and spilled)."""

    pieces: list[np.ndarray] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    nbytes: int = 0
    spill_files: list[Path] = field(default_factory=list)

    def add(self, pieces: np.ndarray, tokens: np.ndarray, labels: np.ndarray) -> int:
        self.pieces.append(pieces)
        self.tokens.append(tokens)
        self.labels.append(labels)
        added = pieces.nbytes + tokens.nbytes + labels.nbytes
        self.nbytes += added
        return added

    def spill(self, path: Path) -> int:
        """Write the in-memory part to `path`; returns the bytes freed. A write that fails (a full
        disk, a quota) removes the file and raises the one-line error of a failed write."""
        try:
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as fh:
                for part in (self.pieces, self.tokens, self.labels):
                    np.save(fh, np.concatenate(part), allow_pickle=False)
        except OSError as exc:
            path.unlink(missing_ok=True)  # a partial spill only takes the space the run needs
            raise write_failed(path, exc, _SPILL_ADVICE.get(error_number(exc))) from None
        self.spill_files.append(path)
        freed, self.nbytes = self.nbytes, 0
        self.pieces, self.tokens, self.labels = [], [], []
        return freed

    def collect(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pieces, tokens, labels = list(self.pieces), list(self.tokens), list(self.labels)
        for path in self.spill_files:
            try:
                with open(path, "rb") as fh:
                    pieces.append(np.load(fh))
                    tokens.append(np.load(fh))
                    labels.append(np.load(fh))
            except (OSError, ValueError) as exc:  # ValueError: np.load of a file cut short
                raise PackctlError(f"{path}: cannot read back tokens spilled by this run "
                                   f"({getattr(exc, 'strerror', None) or exc}); run the command again") from None
            path.unlink()
        return np.concatenate(pieces), np.concatenate(tokens), np.concatenate(labels)


# Where spilling fails, more memory means less to spill: the advice of write_failed, said for spills.
_SPILL_ADVICE = {
    errno.ENOSPC: "free space there, raise --memory-budget (less is spilled) or choose another -o",
    errno.EDQUOT: "free space within your quota, raise --memory-budget (less is spilled) or choose another -o",
}


class _Writers:
    """Builds and encodes complete units on worker threads, with a bounded queue (backpressure);
    one more thread commits the shards they staged (fsync, rename, sha256, journal), so the
    workers never wait on the disk.

        worker 1   build+encode u0 | build+encode u2 | ...
        worker 2   build+encode u1 | build+encode u3 | ...
        commit                   fsync s0 | fsync s1 ...
    """

    def __init__(self, workers: int, max_pending: int, commit: Callable[[StagedShard], ShardEntry]):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packctl-writer")
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packctl-commit")
        self._commit = commit
        self._pending: deque[Future] = deque()
        self._commits: list[Future] = []
        self._max_pending = max_pending
        self.results: dict[int, ShardEntry] = {}
        self._failure: BaseException | None = None  # of a commit: raised at the next submit
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], tuple[int, StagedShard] | None]) -> None:
        if self._failure is not None:
            raise self._failure
        while len(self._pending) >= self._max_pending:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._run, fn))

    def _run(self, fn: Callable[[], tuple[int, StagedShard] | None]) -> None:
        staged = fn()
        if staged is not None:
            with self._lock:
                self._commits.append(self._committer.submit(self._finish_one, *staged))

    def _finish_one(self, shard: int, staged: StagedShard) -> None:
        try:
            info = self._commit(staged)
        except BaseException as exc:
            self._failure = exc
            raise
        with self._lock:
            self.results[shard] = info

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft().result()
        self._pool.shutdown()
        for future in self._commits:
            future.result()
        self._committer.shutdown()

    def cancel(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)
        self._committer.shutdown(wait=True)


def run_part_name(shard_path: str, first_part: int) -> str:
    """The file one writer leaves for a shard it shares: its run of row groups from `first_part`
    (`data/.train-00003.parquet.from-00128`, hidden beside the shard)."""
    folder, _, file = shard_path.rpartition("/")
    return f"{folder}/.{file}.from-{first_part:05d}"


class ShardAssembler:
    """Collects the tokens of this rank's pieces, unit by unit, and writes each complete unit.

    `add` takes pieces (indices into this rank's plan) with their tokens and labels, in any
    order and any grouping; memory held in buckets stays within `budget` (minus what
    `held_elsewhere()` reports), the largest buckets being spilled to disk beyond it.
    """

    def __init__(self, job: WriteJob, run: WriteRun, fmt: ShardFormat, *, output: OutputDir,
                 kept: dict[str, pa.ChunkedArray | np.ndarray] | None = None,
                 held_elsewhere: Callable[[], int] = lambda: 0, progress: Callable[[int], None] = lambda n: None):
        plan = job.plan
        self.plan, self.pack_lens, self.run = plan, job.pack_lens, run
        self.columns = job.columns or {}  # extra per-pack columns (step, dp_rank, ...), in this rank's pack order
        self.kept = kept or {}  # per-piece columns (per_piece_columns), one value per piece of this rank's plan
        self.output, self.metadata = output, fmt.metadata
        self.pad_token_id = fmt.pad_token_id
        self.plan_only = fmt.plan_only  # --plan-only: the shards leave the token columns out
        self.limits = fmt.carried.limits  # --limit columns: COL among `kept`, COL_sum among `columns`
        self.budget, self.held_elsewhere, self.progress = fmt.budget, held_elsewhere, progress
        self.bounds = run.unit_bounds
        self.unit_piece_offsets = plan.bin_offsets[self.bounds]
        self.num_units = run.num_units
        pieces_per_unit = np.diff(self.unit_piece_offsets)
        self.piece_unit = np.repeat(np.arange(self.num_units), pieces_per_unit)
        self.remaining = pieces_per_unit.copy()
        self.buckets: dict[int, _Bucket] = {}
        self.buffered = 0
        self.spill_dir = output.tmp / f".spill-{output.rank:05d}"
        self.spill_files = self.spilled_bytes = 0
        # encoded units of shards not yet complete here: shard -> {part: (Parquet buffer, rows, tokens)}
        self._encoded: dict[int, dict[int, tuple[pa.Buffer, int, int]]] = {}
        self.encoded_bytes = 0
        self._local_units = {int(s): int(c) for s, c in zip(*np.unique(run.unit_shard, return_counts=True))}
        self._lock = threading.Lock()
        workers = max(1, min(2, os.cpu_count() or 1))
        self._writers = _Writers(workers, max_pending=2 * workers, commit=output.commit_shard)
        self._scratch = threading.local()  # each writer thread builds its units in the same buffers
        # Shards an interrupted run already finished (--resume): their pieces are neither fetched nor written.
        self.unit_done = np.array([run.shard_path(int(s)) in output.done for s in run.unit_shard], dtype=bool)
        self.piece_wanted = ~self.unit_done[self.piece_unit]
        for u in np.flatnonzero(self.unit_done).tolist():
            self.remaining[u] = 0
            self.progress(int(self.bounds[u + 1] - self.bounds[u]))
        for s in set(run.unit_shard[self.unit_done].tolist()):
            if run.whole_here(s) or run.finishes(s):
                self._writers.results[s] = output.done[run.shard_path(s)]

    def add(self, pieces: np.ndarray, tokens: np.ndarray, labels: np.ndarray) -> None:
        """Pieces with their tokens and labels concatenated in the same order."""
        src_starts = offsets_of(self.plan.piece_len[pieces])[:-1]

        def part(sel: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            dst_starts = offsets_of(lens)
            part_tokens = np.empty(int(dst_starts[-1]), dtype=np.int32)
            part_labels = np.empty_like(part_tokens)
            copy_segments(tokens, src_starts[sel], part_tokens, dst_starts[:-1], lens)
            copy_segments(labels, src_starts[sel], part_labels, dst_starts[:-1], lens)
            return part_tokens, part_labels

        self._add_by_unit(pieces, part)

    def add_from_block(self, pieces: np.ndarray, decoded, rows: np.ndarray, starts: np.ndarray) -> None:
        """Pieces read straight from a decoded block (row in the block, start in the sequence)."""
        self._add_by_unit(pieces, lambda sel, lens: decoded.gather(rows[sel], starts[sel], lens))

    def _add_by_unit(self, pieces: np.ndarray, part: Callable[[np.ndarray, np.ndarray], tuple]) -> None:
        # Each unit's part gets arrays of its own (`part` gathers them), so spilling or writing it
        # frees memory even while other units still wait for their part of this batch; the budget
        # is kept after each unit, not after the batch: with --epochs K a block's pieces are K
        # copies of its tokens, more than the budget holds.
        if len(pieces) == 0:
            return
        unit = self.piece_unit[pieces]
        order = np.argsort(unit, kind="stable")
        units_here, first = np.unique(unit[order], return_index=True)
        cuts = np.append(first, len(pieces))
        for k, u in enumerate(units_here.tolist()):
            sel = order[cuts[k]:cuts[k + 1]]
            part_tokens, part_labels = part(sel, self.plan.piece_len[pieces[sel]])
            bucket = self.buckets.setdefault(u, _Bucket())
            self.buffered += bucket.add(pieces[sel], part_tokens, part_labels)
            self.remaining[u] -= len(sel)
            if self.remaining[u] == 0:
                done = self.buckets.pop(u)
                self.buffered -= done.nbytes
                self._writers.submit(lambda u=u, done=done: self._build(u, done))
            self._keep_within_budget()

    def write_from_blocks(self, index: SequenceIndex, source: TokenSource) -> None:
        """Every unit gathered straight from the decoded blocks `source` holds (all of them):
        no buckets, no exchange; the writer threads gather, build and write in parallel."""
        for u in np.flatnonzero(~self.unit_done).tolist():
            self._writers.submit(lambda u=u: self._build_from_blocks(u, index, source))
        self.remaining[:] = 0

    def _build_from_blocks(self, u: int, index: SequenceIndex, source: TokenSource):
        """Unit u with each piece gathered from its decoded block straight into its place in the pack."""
        plan = self.plan
        p_lo, p_hi = int(self.unit_piece_offsets[u]), int(self.unit_piece_offsets[u + 1])
        return self._write(u, place_from_blocks(index, plan.piece_gid[p_lo:p_hi], plan.piece_start[p_lo:p_hi],
                                                plan.piece_len[p_lo:p_hi], source.peek))

    def _keep_within_budget(self) -> None:
        """Over budget: spill the largest buckets until half the budget is free for what comes."""
        while self.buffered + self.encoded_bytes + self.held_elsewhere() > self.budget and self.buckets:
            u = max(self.buckets, key=lambda key: self.buckets[key].nbytes)
            if self.buckets[u].nbytes == 0:
                break
            freed = self.buckets[u].spill(self.spill_dir / f"{u:05d}-{self.spill_files}.npy")
            self.buffered -= freed
            self.spilled_bytes += freed
            self.spill_files += 1
            if self.buffered + self.encoded_bytes + self.held_elsewhere() <= self.budget // 2:
                break

    def _build(self, u: int, bucket: _Bucket):
        """Unit u from its bucket: pieces arrive in any order, each is copied to its place."""
        pieces, tokens, labels = bucket.collect()
        src_starts = offsets_of(self.plan.piece_len[pieces])[:-1]
        slot = pieces - int(self.unit_piece_offsets[u])  # index of each arrived piece in the unit

        def place(input_ids: np.ndarray, out_labels: np.ndarray, piece_flat_start: np.ndarray) -> None:
            lens, dst_starts = self.plan.piece_len[pieces], piece_flat_start[slot]
            copy_segments(tokens, src_starts, input_ids, dst_starts, lens)
            copy_segments(labels, src_starts, out_labels, dst_starts, lens)

        return self._write(u, place)

    def write_plan(self, piece_loss: np.ndarray) -> None:
        """Every unit as a plan's row groups (`--plan-only`): the layout without token columns and
        the loss columns from `piece_loss` (each piece's loss tokens, `piece_loss_tokens`); no token
        is read, moved or copied."""
        for u in np.flatnonzero(~self.unit_done).tolist():
            self._writers.submit(lambda u=u: self._write(u, None, piece_loss))
        self.remaining[:] = 0

    def _write(self, u: int, place: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None,
               piece_loss: np.ndarray | None = None):
        """Build unit u, its tokens put in place by `place` (`lay_out_packs`), encode it as a row
        group; when it is the last of its shard here, join the shard (and stage it, if whole).
        `place` None: a plan's unit, its loss columns from `piece_loss` (`write_plan`)."""
        plan = self.plan
        lo, hi = int(self.bounds[u]), int(self.bounds[u + 1])
        p_lo, p_hi = int(self.unit_piece_offsets[u]), int(self.unit_piece_offsets[u + 1])
        layout = (plan.bin_offsets[lo:hi + 1] - p_lo, plan.piece_len[p_lo:p_hi], plan.piece_padded[p_lo:p_hi],
                  plan.piece_gid[p_lo:p_hi], self.pack_lens[lo:hi])
        if place is None:
            rows = lay_out_sequences(*layout)
            loss = counted_loss_columns(rows, piece_loss[p_lo:p_hi])
        else:
            scratch = getattr(self._scratch, "buffers", None)
            if scratch is None:
                scratch = self._scratch.buffers = Scratch()
            parents = self.kept[PARENT_SEGMENTS][p_lo:p_hi] if PARENT_SEGMENTS in self.kept else None
            starts = None if parents is None else np.where(parents >= 0, plan.piece_start[p_lo:p_hi], 0)
            rows, loss = lay_out_packs(lay_out_sequences(*layout), place, pad_token_id=self.pad_token_id,
                                       scratch=scratch, position_starts=starts), None
            if parents is not None:  # a prefix segment is no input row; the loss columns count rows
                rows.sample_ids[prefix_pieces(layout[0], parents)] = -1
                rows.parent_segments = parents
        extra = {name: values[lo:hi] for name, values in self.columns.items()}
        per_piece = {name: values[p_lo:p_hi] for name, values in self.kept.items()}
        data = encode_table(rows_to_table(rows, self.metadata, extra, per_piece, plan=self.plan_only,
                                          limits=self.limits, loss=loss))
        tokens = int(plan.piece_len[p_lo:p_hi].sum())
        self.progress(hi - lo)
        shard, part = int(self.run.unit_shard[u]), int(self.run.unit_part[u])
        with self._lock:
            parts = self._encoded.setdefault(shard, {})
            parts[part] = (data, hi - lo, tokens)
            self.encoded_bytes += len(data)
            if len(parts) < self._local_units[shard]:
                return None
            del self._encoded[shard]
            self.encoded_bytes -= sum(len(p[0]) for p in parts.values())
        ordered = [parts[k] for k in sorted(parts)]
        joined = stitch_chunks([p[0] for p in ordered])
        if not self.run.whole_here(shard):  # shared with another writer: leave this run for the join
            self.output.stage_run_part(run_part_name(self.run.shard_path(shard), min(parts)), joined)
            return None
        staged = self.output.stage_bytes(self.run.shard_path(shard), joined, rows=sum(p[1] for p in ordered),
                                         tokens=sum(p[2] for p in ordered))
        return shard, staged

    def finish(self) -> dict[int, ShardEntry]:
        if self.buckets or self.remaining.any():
            raise AssertionError(f"materialize left {int(self.remaining.sum())} pieces without tokens")
        self._writers.finish()
        if self.spill_dir.exists():
            self.spill_dir.rmdir()
        return dict(self._writers.results)

    def cancel(self) -> None:
        self._writers.cancel()


def join_shared_shards(run: WriteRun, output: OutputDir) -> dict[int, ShardEntry]:
    """The shards this writer finishes that other writers helped write: their runs, left as files
    by every writer, joined in order (no value decoded again), then committed."""
    results = {}
    for shard, runs in sorted(run.shard_runs.items()):
        if not run.finishes(shard) or run.shard_path(shard) in output.done:
            continue
        paths = [output.tmp / run_part_name(run.shard_path(shard), first) for first in runs]
        joined = stitch([p.read_bytes() for p in paths])
        meta = pq.ParquetFile(pa.BufferReader(joined)).metadata
        tokens = int(pq.read_table(pa.BufferReader(joined), columns=[NUM_TOKENS]).column(0).to_numpy().sum())
        staged = output.stage_bytes(run.shard_path(shard), joined, rows=meta.num_rows, tokens=tokens)
        results[shard] = output.commit_joined(staged, paths)
    return results


@dataclass
class MaterializeResult:
    shards: dict[int, ShardEntry]  # the shards this rank committed, by number
    spill_files: int  # bucket spills written (and read back)
    spilled_bytes: int
    blocks_reread: int  # input blocks decoded a second time (they did not fit the budget during scan)
    rounds: int  # exchange rounds (one per block of the rank with most blocks)
    blocks_read: int  # blocks this rank decoded to get its own pieces (--token-transfer read)


def needed_blocks(plan: PackPlan, index: SequenceIndex) -> np.ndarray:
    """The input blocks the pieces of `plan` come from."""
    return np.unique(np.searchsorted(index.block_offsets, plan.piece_gid, side="right") - 1)


# --token-transfer auto reads (instead of exchanging) when the ranks together would decode at most
# this many times the input blocks the output needs; with input order up to the second figure
# (docs/distributed.md has the measurements behind both).
READ_AMPLIFICATION_LIMIT = 1.5
READ_AMPLIFICATION_LIMIT_INPUT_ORDER = 3.0


def read_amplification(comm, plan: PackPlan, index: SequenceIndex) -> float:
    """Bytes of the blocks all ranks would decode to read their own pieces, over the bytes of the
    blocks the output needs (1.0: every block feeds one rank only)."""
    blocks = needed_blocks(plan, index)
    sizes = np.array([b.nbytes for b in index.blocks], dtype=np.int64)
    read = comm.allreduce_sum(int(sizes[blocks].sum()))
    needed = np.zeros(len(sizes), np.int64)
    needed[blocks] = 1
    union = comm.allreduce_sum(needed) > 0
    return read / max(int(sizes[union].sum()), 1)


def choose_read_own(transfer: str, amplification: float, order: str, ranks: int) -> bool:
    """Whether ranks read their pieces' blocks themselves (`--token-transfer`). "auto" reads when
    the read amplification is at most READ_AMPLIFICATION_LIMIT, or with input order at most
    READ_AMPLIFICATION_LIMIT_INPUT_ORDER: there the exchange is slow for another reason, a rank's
    first packs wait for the blocks its neighbour decodes last (rounds go in block order), while
    with reads every rank writes as it decodes. Shuffle and curriculum draw every pack from every
    block (amplification about N): they exchange."""
    if ranks == 1 or transfer == "exchange":
        return False
    if transfer == "read":
        return True
    limit = READ_AMPLIFICATION_LIMIT_INPUT_ORDER if order == "input" else READ_AMPLIFICATION_LIMIT
    return amplification <= limit


@dataclass
class Scanned:
    """The input as scan left it on this rank: the index, the decoded blocks it kept, and which
    blocks every rank scanned (`block_bounds[r]:block_bounds[r+1]`)."""

    index: SequenceIndex
    source: TokenSource
    block_bounds: np.ndarray
    tokens_read: bool = True  # False: scan read lengths only (a plan of Megatron pairs reads the .idx)


@dataclass(frozen=True)
class ShardFormat:
    """How shards are written: the `packctl` metadata key, the pad id, the memory budget, the input
    columns carried into the packs (`carried`: --keep-columns as they are, --weight-column as
    `seq_weights`, each --limit COL per piece from `PackPlan.piece_extra` and COL_sum per pack)."""

    metadata: bytes
    pad_token_id: int
    budget: int
    carried: CarriedColumns = CarriedColumns()
    plan_only: bool = False  # --plan-only: no token columns; each piece's start in its sample (seq_starts)
    source_starts: tuple[int, ...] | None = None  # --source: the first gid of every source, then the end
    share_prefix: bool = False  # --share-prefix: parent_segments per piece; prefixes and branches laid out as trees


def per_piece_columns(index: SequenceIndex, piece_gid: np.ndarray, fmt: ShardFormat,
                      piece_extra: np.ndarray | None = None) -> dict[str, pa.ChunkedArray | np.ndarray]:
    """The values carried per piece, in piece order: the --keep-columns as they are, the
    --weight-column's values as `seq_weights` (scan checked them: finite, no null), with
    --group-column each piece's `group_ids` (the gid of its group's first row), and with --limit
    each limited column's value (`piece_extra`, pieces x k, 0 on the pieces of a cut sequence).
    The writer gives `seq_weights`, `group_ids` and the limited columns their declared types
    (output/encode.py)."""
    carried = fmt.carried
    wanted = list(carried.per_sequence)
    table = read_kept_columns(index, piece_gid, wanted) if wanted else None
    columns = {name: table.column(name) for name in carried.keep}
    if carried.weight is not None:
        columns[SEQ_WEIGHTS] = table.column(carried.weight)
    if index.group_starts is not None:
        columns[GROUP_IDS] = group_ids(piece_gid, index.group_starts)
    for j, name in enumerate(carried.limits):
        columns[name] = np.ascontiguousarray(piece_extra[:, j])
    if fmt.source_starts is not None:  # gids of source k: source_starts[k]:source_starts[k+1]
        columns[SOURCE_IDS] = (np.searchsorted(np.asarray(fmt.source_starts, dtype=np.int64), piece_gid,
                                               side="right") - 1).astype(np.int32)
    return columns


def materialize(ctx: RunContext, job: WriteJob, scanned: Scanned, output: OutputDir, fmt: ShardFormat, *,
                read_own: bool = False, kept: dict[str, pa.ChunkedArray | np.ndarray] | None = None
                ) -> MaterializeResult:
    """Write this rank's run of units (module docstring); `job` holds this rank's packs
    (`dist.assign.hand_over`). With `read_own`, tokens are read from the input blocks, not exchanged.
    `kept`: the per-piece values to write (`per_piece_columns`), when they are known already (a
    plan's). Its progress advances by packs, of every rank's (`ctx.counter`)."""
    comm, progress = ctx.comm, ctx.counter("materialize", job.plan.num_bins)
    plan, index, source, block_bounds = job.plan, scanned.index, scanned.source, scanned.block_bounds
    run = write_run(job.assignment, comm.rank)
    kept = per_piece_columns(index, plan.piece_gid, fmt, plan.piece_extra) if kept is None else kept
    if fmt.plan_only:
        kept[SEQ_STARTS] = plan.piece_start
    if fmt.share_prefix:
        kept[PARENT_SEGMENTS] = piece_parents(plan, index.group_starts)
    assembler = ShardAssembler(job, run, fmt, output=output, kept=kept, held_elsewhere=lambda: source.held,
                               progress=progress)
    lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
    rounds = blocks_read = 0
    try:
        if fmt.plan_only:  # a plan needs of the tokens only each piece's loss tokens: known from scan
            assembler.write_plan(piece_loss_tokens(comm, plan, index, source, block_bounds))
        elif comm.size == 1 and all(source.cached(b) for b in range(lo, hi)):
            # The whole input is decoded in memory: each unit gathers its pieces from the blocks.
            assembler.write_from_blocks(index, source)
        elif read_own:
            blocks_read = read_tokens(plan, index, source, assembler)
        else:
            rounds = route_tokens(comm, plan, index, source, block_bounds, assembler)
        shards = assembler.finish()
    except BaseException:
        assembler.cancel()
        raise
    comm.barrier()  # every writer has left its runs of the shards it shares
    shards.update(join_shared_shards(run, output))
    return MaterializeResult(shards=shards, spill_files=assembler.spill_files,
                             spilled_bytes=assembler.spilled_bytes, blocks_reread=source.blocks_reread,
                             rounds=rounds, blocks_read=blocks_read)


def read_tokens(plan: PackPlan, index: SequenceIndex, source: TokenSource, assembler: ShardAssembler) -> int:
    """Read the blocks this rank's pieces come from, in order, and hand each its pieces (no
    exchange). Blocks this rank scanned come from its cache when they are still there.
    Returns the number of blocks read."""
    wanted = np.flatnonzero(assembler.piece_wanted)
    block_of = np.searchsorted(index.block_offsets, plan.piece_gid[wanted], side="right") - 1
    order = np.argsort(block_of, kind="stable")
    blocks, first = np.unique(block_of[order], return_index=True)
    cuts = np.append(first, len(order))
    for k, b in enumerate(blocks.tolist()):
        sel = wanted[order[cuts[k]:cuts[k + 1]]]
        decoded = source.take(b, index.blocks[b]) if source.cached(b) else source.decode(index.blocks[b])
        assembler.add_from_block(sel, decoded, plan.piece_gid[sel] - index.block_offsets[b], plan.piece_start[sel])
        del decoded
    return len(blocks)


def route_tokens(comm, plan: PackPlan, index: SequenceIndex, source: TokenSource, block_bounds: np.ndarray,
                 assembler: ShardAssembler) -> int:
    """Requests, then one Alltoallv round per block (module docstring). Returns the round count."""
    rank_of_gid_bound = index.block_offsets[block_bounds]  # gid where each rank's blocks start
    # 1. requests: (piece index here, gid, start, len) to the rank that reads the gid's block,
    #    for the pieces of shards not already finished by an interrupted run
    wanted = np.flatnonzero(assembler.piece_wanted)
    owner = np.searchsorted(rank_of_gid_bound, plan.piece_gid[wanted], side="right") - 1
    order = wanted[np.argsort(owner, kind="stable")]
    requests = np.stack([order, plan.piece_gid[order], plan.piece_start[order], plan.piece_len[order]], axis=1)
    counts = np.bincount(owner, minlength=comm.size).astype(np.int64) * 4
    received, recv_counts = comm.alltoallv(requests.ravel(), counts)
    received = received.reshape(-1, 4)
    asker = np.repeat(np.arange(comm.size), recv_counts // 4)
    # Serve them block by block, in input order: sort by gid (stable keeps each asker's order).
    by_gid = np.argsort(received[:, 1], kind="stable")
    received, asker = received[by_gid], asker[by_gid]

    my_lo, my_hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
    cuts = np.searchsorted(received[:, 1], index.block_offsets[my_lo:my_hi + 1])
    rounds = int(comm.allreduce_max(my_hi - my_lo))
    for k in range(rounds):
        b = my_lo + k
        if b < my_hi and cuts[k] < cuts[k + 1]:
            decoded = source.take(b, index.blocks[b])
            rows = received[cuts[k]:cuts[k + 1]]
            if comm.size == 1:  # everything is for this rank: gather straight into the shard buckets
                assembler.add_from_block(rows[:, 0], decoded, rows[:, 1] - index.block_offsets[b], rows[:, 2])
                continue
            to = asker[cuts[k]:cuts[k + 1]]
            send_order = np.argsort(to, kind="stable")
            rows, to = rows[send_order], to[send_order]
            tokens, labels = decoded.gather(rows[:, 1] - index.block_offsets[b], rows[:, 2], rows[:, 3])
            del decoded
            piece_counts = np.bincount(to, minlength=comm.size).astype(np.int64)
            token_counts = np.bincount(to, weights=rows[:, 3], minlength=comm.size).astype(np.int64)
            meta = rows[:, 0]
            payload = _interleave(tokens, labels, offsets_of(token_counts))
        else:
            if b < my_hi and source.cached(b):
                source.take(b, index.blocks[b])  # every sequence of the block was dropped
            piece_counts = token_counts = np.zeros(comm.size, np.int64)
            meta = np.zeros(0, np.int64)
            payload = np.zeros(0, np.int32)
        got_meta, got_piece_counts = comm.alltoallv(meta, piece_counts)
        got_payload, got_counts = comm.alltoallv(payload, token_counts * 2)
        got_tokens, got_labels = _deinterleave(got_payload, offsets_of(got_counts // 2))
        assembler.add(got_meta, got_tokens, got_labels)
    return rounds


def _interleave(tokens: np.ndarray, labels: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Per destination j: its tokens then its labels, so one Alltoallv carries both.
    cuts = token offsets of each destination."""
    out = np.empty(2 * len(tokens), dtype=np.int32)
    for j in range(len(cuts) - 1):
        a, z = int(cuts[j]), int(cuts[j + 1])
        out[2 * a:a + z] = tokens[a:z]
        out[a + z:2 * z] = labels[a:z]
    return out


def _deinterleave(payload: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `_interleave`: cuts are token offsets per source rank."""
    if len(cuts) == 2:  # one source: no copy
        n = int(cuts[1])
        return payload[:n], payload[n:]
    tokens = np.empty(int(cuts[-1]), dtype=np.int32)
    labels = np.empty_like(tokens)
    for j in range(len(cuts) - 1):
        a, z = int(cuts[j]), int(cuts[j + 1])
        tokens[a:z] = payload[2 * a:a + z]
        labels[a:z] = payload[a + z:2 * z]
    return tokens, labels

"""Materialize: move every piece's tokens from its input block to its output shard, in bounded memory.

Each rank reads its own input blocks once, in order; each rank writes the shards of its own
windows. In between, tokens travel (Alltoallv, one round per block; a single process sends to
itself, with the same code):

    1. requests   every piece planned here asks the rank that reads its block for
                  (gid, start, len): one Alltoallv of int64 records
    2. rounds     round k: every rank decodes its k-th block, gathers the requested pieces,
                  grouped by the rank that asked, and sends them (Alltoallv of int32 tokens
                  and labels); what arrives goes to the bucket of its shard
    3. write      a shard whose last piece has arrived is built and written at once, on a writer
                  thread, while the rounds go on; a commit thread makes it durable (fsync,
                  rename, sha256, journal)

    blocks (input order)      shards (output order)
    b0 b1 b2 b3 ...   --->    part-00000 <- pieces from b0, b3     complete after b3: written
                              part-00001 <- pieces from b1, b2, b7 complete after b7: written

With input order and `concat`, shards complete almost as fast as blocks are read and memory
stays at a few blocks; with shuffle or curriculum order a shard completes only when its last
source block is read, and the memory budget decides how much waits in memory and how much is
spilled to disk (and read back when its shard is complete).
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from packctl.arrays import Scratch, copy_segments, offsets_of
from packctl.io.reader import SequenceIndex, TokenSource
from packctl.io.writer import OutputDir, ShardInfo, StagedShard, rows_to_table
from packctl.plan.windows import PackPlan
from packctl.thd import lay_out_packs


def shard_bounds(window_bins: np.ndarray, shard_rows: int) -> np.ndarray:
    """First pack of every shard (plus the end): shards hold at most `shard_rows` packs and never
    straddle windows. window_bins [0, 5, 7], shard_rows 2 -> [0, 2, 4, 5, 7]."""
    bounds = [np.arange(lo, hi, shard_rows) for lo, hi in zip(window_bins[:-1], window_bins[1:])]
    starts = np.concatenate(bounds) if bounds else np.zeros(0, np.int64)
    return np.append(starts, window_bins[-1]).astype(np.int64)


@dataclass
class _Bucket:
    """Pieces of one shard received so far (in memory and spilled)."""

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
        """Write the in-memory part to `path`; returns the bytes freed."""
        with open(path, "wb") as fh:
            for part in (self.pieces, self.tokens, self.labels):
                np.save(fh, np.concatenate(part), allow_pickle=False)
        self.spill_files.append(path)
        freed, self.nbytes = self.nbytes, 0
        self.pieces, self.tokens, self.labels = [], [], []
        return freed

    def collect(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pieces, tokens, labels = list(self.pieces), list(self.tokens), list(self.labels)
        for path in self.spill_files:
            with open(path, "rb") as fh:
                pieces.append(np.load(fh))
                tokens.append(np.load(fh))
                labels.append(np.load(fh))
            path.unlink()
        return np.concatenate(pieces), np.concatenate(tokens), np.concatenate(labels)


class _Writers:
    """Builds and writes complete shards on worker threads, with a bounded queue (backpressure);
    one more thread commits what they staged (fsync, rename, sha256, journal), so the workers
    never wait on the disk.

        worker 1   build+encode s0 | build+encode s2 | ...
        worker 2   build+encode s1 | build+encode s3 | ...
        commit                   fsync s0 | fsync s1 | fsync s2 ...
    """

    def __init__(self, workers: int, max_pending: int, commit: Callable[[StagedShard], ShardInfo]):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packctl-writer")
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packctl-commit")
        self._commit = commit
        self._pending: deque[Future] = deque()
        self._commits: list[Future] = []
        self._max_pending = max_pending
        self.results: dict[int, ShardInfo] = {}
        self._failure: BaseException | None = None  # of a commit: raised at the next submit
        self._lock = threading.Lock()

    def submit(self, shard: int, fn: Callable[[], StagedShard]) -> None:
        if self._failure is not None:
            raise self._failure
        while len(self._pending) >= self._max_pending:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._run, shard, fn))

    def _run(self, shard: int, fn: Callable[[], StagedShard]) -> None:
        staged = fn()
        with self._lock:
            self._commits.append(self._committer.submit(self._finish_one, shard, staged))

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


class ShardAssembler:
    """Collects the tokens of this rank's pieces, shard by shard, and writes each complete shard.

    `add` takes pieces (indices into this rank's plan) with their tokens and labels, in any
    order and any grouping; memory held in buckets stays within `budget` (minus what
    `held_elsewhere()` reports), the largest buckets being spilled to disk beyond it.
    """

    def __init__(self, plan: PackPlan, pack_lens: np.ndarray, *, output: OutputDir, metadata: bytes,
                 shard_rows: int, first_shard: int, pad_token_id: int, budget: int,
                 held_elsewhere: Callable[[], int] = lambda: 0, progress: Callable[[int], None] = lambda n: None,
                 writers: int | None = None, columns: dict[str, np.ndarray] | None = None):
        self.plan, self.pack_lens = plan, pack_lens
        self.columns = columns or {}  # extra per-pack columns (step, dp_rank, ...), in this rank's pack order
        self.output, self.metadata = output, metadata
        self.first_shard, self.pad_token_id = first_shard, pad_token_id
        self.budget, self.held_elsewhere, self.progress = budget, held_elsewhere, progress
        self.bounds = shard_bounds(plan.window_bins, shard_rows)
        self.shard_piece_offsets = plan.bin_offsets[self.bounds]
        self.num_shards = len(self.bounds) - 1
        pieces_per_shard = np.diff(self.shard_piece_offsets)
        self.piece_shard = np.repeat(np.arange(self.num_shards), pieces_per_shard)
        self.remaining = pieces_per_shard.copy()
        self.buckets: dict[int, _Bucket] = {}
        self.buffered = 0
        self.spill_dir = output.tmp / f".spill-{first_shard:05d}"
        self.spill_files = self.spilled_bytes = 0
        workers = writers if writers is not None else max(1, min(2, os.cpu_count() or 1))
        self._writers = _Writers(workers, max_pending=2 * workers, commit=output.commit_shard)
        self._scratch = threading.local()  # each writer thread builds its shards in the same buffers
        # Shards an interrupted run already finished (--resume): their pieces are neither fetched nor written.
        done = [self.shard_name(s) in output.done for s in range(self.num_shards)]
        self.shard_done = np.array(done, dtype=bool)
        self.piece_wanted = ~self.shard_done[self.piece_shard]
        for s in np.flatnonzero(self.shard_done).tolist():
            self.remaining[s] = 0
            self._writers.results[s] = output.done[self.shard_name(s)]
            self.progress(int(self.bounds[s + 1] - self.bounds[s]))

    def shard_name(self, s: int) -> str:
        return f"part-{self.first_shard + s:05d}.parquet"

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

        self._add_by_shard(pieces, part)

    def add_from_block(self, pieces: np.ndarray, decoded, rows: np.ndarray, starts: np.ndarray) -> None:
        """Pieces read straight from a decoded block (row in the block, start in the sequence)."""
        self._add_by_shard(pieces, lambda sel, lens: decoded.gather(rows[sel], starts[sel], lens))

    def _add_by_shard(self, pieces: np.ndarray, part: Callable[[np.ndarray, np.ndarray], tuple]) -> None:
        # Each shard's part gets arrays of its own (`part` gathers them), so spilling or writing it
        # frees memory even while other shards still wait for their part of this batch.
        if len(pieces) == 0:
            return
        shard = self.piece_shard[pieces]
        order = np.argsort(shard, kind="stable")
        shards_here, first = np.unique(shard[order], return_index=True)
        cuts = np.append(first, len(pieces))
        for k, s in enumerate(shards_here.tolist()):
            sel = order[cuts[k]:cuts[k + 1]]
            part_tokens, part_labels = part(sel, self.plan.piece_len[pieces[sel]])
            bucket = self.buckets.setdefault(s, _Bucket())
            self.buffered += bucket.add(pieces[sel], part_tokens, part_labels)
            self.remaining[s] -= len(sel)
            if self.remaining[s] == 0:
                done = self.buckets.pop(s)
                self.buffered -= done.nbytes
                self._writers.submit(s, lambda s=s, done=done: self._build(s, done))
        self._keep_within_budget()

    def write_from_blocks(self, index: SequenceIndex, source: TokenSource) -> None:
        """Every shard gathered straight from the decoded blocks `source` holds (all of them):
        no buckets, no exchange; the writer threads gather, build and write in parallel."""
        for s in np.flatnonzero(~self.shard_done).tolist():
            self._writers.submit(s, lambda s=s: self._build_from_blocks(s, index, source))
        self.remaining[:] = 0

    def _build_from_blocks(self, s: int, index: SequenceIndex, source: TokenSource) -> StagedShard:
        """Shard s with each piece gathered from its decoded block straight into its place in the pack."""
        plan = self.plan
        p_lo, p_hi = int(self.shard_piece_offsets[s]), int(self.shard_piece_offsets[s + 1])
        gids, starts, lens = plan.piece_gid[p_lo:p_hi], plan.piece_start[p_lo:p_hi], plan.piece_len[p_lo:p_hi]
        block_of = np.searchsorted(index.block_offsets, gids, side="right") - 1
        order = np.argsort(block_of, kind="stable")
        blocks, first = np.unique(block_of[order], return_index=True)
        cuts = np.append(first, len(order))

        def place(input_ids: np.ndarray, labels: np.ndarray, piece_flat_start: np.ndarray) -> None:
            for k, b in enumerate(blocks.tolist()):
                sel = order[cuts[k]:cuts[k + 1]]
                decoded = source.peek(b)
                src_starts = decoded.offsets[gids[sel] - index.block_offsets[b]] + starts[sel]
                decoded.gather_into(src_starts, lens[sel], input_ids, labels, piece_flat_start[sel])

        return self._write(s, place)

    def _keep_within_budget(self) -> None:
        """Over budget: spill the largest buckets until half the budget is free for what comes."""
        while self.buffered + self.held_elsewhere() > self.budget and self.buckets:
            s = max(self.buckets, key=lambda key: self.buckets[key].nbytes)
            if self.buckets[s].nbytes == 0:
                break
            self.spill_dir.mkdir(exist_ok=True)
            freed = self.buckets[s].spill(self.spill_dir / f"{s:05d}-{self.spill_files}.npy")
            self.buffered -= freed
            self.spilled_bytes += freed
            self.spill_files += 1
            if self.buffered + self.held_elsewhere() <= self.budget // 2:
                break

    def _build(self, s: int, bucket: _Bucket) -> StagedShard:
        """Shard s from its bucket: pieces arrive in any order, each is copied to its place."""
        pieces, tokens, labels = bucket.collect()
        src_starts = offsets_of(self.plan.piece_len[pieces])[:-1]
        slot = pieces - int(self.shard_piece_offsets[s])  # index of each arrived piece in the shard

        def place(input_ids: np.ndarray, out_labels: np.ndarray, piece_flat_start: np.ndarray) -> None:
            lens, dst_starts = self.plan.piece_len[pieces], piece_flat_start[slot]
            copy_segments(tokens, src_starts, input_ids, dst_starts, lens)
            copy_segments(labels, src_starts, out_labels, dst_starts, lens)

        return self._write(s, place)

    def _write(self, s: int, place: Callable[[np.ndarray, np.ndarray, np.ndarray], None]) -> StagedShard:
        """Build shard s, its tokens put in place by `place` (`lay_out_packs`), and stage it."""
        plan = self.plan
        lo, hi = int(self.bounds[s]), int(self.bounds[s + 1])
        p_lo, p_hi = int(self.shard_piece_offsets[s]), int(self.shard_piece_offsets[s + 1])
        scratch = getattr(self._scratch, "buffers", None)
        if scratch is None:
            scratch = self._scratch.buffers = Scratch()
        rows = lay_out_packs(plan.bin_offsets[lo:hi + 1] - p_lo, plan.piece_len[p_lo:p_hi],
                             plan.piece_padded[p_lo:p_hi], plan.piece_gid[p_lo:p_hi], self.pack_lens[lo:hi],
                             place, pad_token_id=self.pad_token_id, scratch=scratch)
        extra = {name: values[lo:hi] for name, values in self.columns.items()}
        staged = self.output.stage_shard(self.shard_name(s), rows_to_table(rows, self.metadata, extra))
        self.progress(hi - lo)
        return staged

    def finish(self) -> list[ShardInfo]:
        if self.buckets or self.remaining.any():
            raise AssertionError(f"materialize left {int(self.remaining.sum())} pieces without tokens")
        self._writers.finish()
        if self.spill_dir.exists():
            self.spill_dir.rmdir()
        return [self._writers.results[s] for s in range(self.num_shards)]

    def cancel(self) -> None:
        self._writers.cancel()


@dataclass
class MaterializeResult:
    shards: list[ShardInfo]
    spill_files: int  # bucket spills written (and read back)
    spilled_bytes: int
    blocks_reread: int  # input blocks decoded a second time (they did not fit the budget during scan)
    rounds: int  # exchange rounds (one per block of the rank with most blocks)


def materialize(comm, plan: PackPlan, pack_lens: np.ndarray, index: SequenceIndex, source: TokenSource,
                block_bounds: np.ndarray, *, output: OutputDir, metadata: bytes, shard_rows: int,
                first_shard: int, pad_token_id: int, budget: int, columns: dict[str, np.ndarray] | None = None,
                progress: Callable[[int], None] = lambda n: None) -> MaterializeResult:
    """Write this rank's packs into shards part-{first_shard + k}.parquet (module docstring).

    `block_bounds[r]:block_bounds[r+1]` are the blocks rank r reads; `source` holds this rank's.
    """
    assembler = ShardAssembler(plan, pack_lens, output=output, metadata=metadata, shard_rows=shard_rows,
                               first_shard=first_shard, pad_token_id=pad_token_id, budget=budget,
                               held_elsewhere=lambda: source.held, progress=progress, columns=columns)
    lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
    try:
        if comm.size == 1 and all(source.cached(b) for b in range(lo, hi)):
            # The whole input is decoded in memory: each shard gathers its pieces from the blocks.
            assembler.write_from_blocks(index, source)
            rounds = 0
        else:
            rounds = route_tokens(comm, plan, index, source, block_bounds, assembler)
        shards = assembler.finish()
    except BaseException:
        assembler.cancel()
        raise
    return MaterializeResult(shards=shards, spill_files=assembler.spill_files,
                             spilled_bytes=assembler.spilled_bytes, blocks_reread=source.blocks_reread,
                             rounds=rounds)


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

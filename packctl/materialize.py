"""Materialize: move every piece's tokens from its input block to its output shard, in bounded memory.

Input blocks are visited once, in file order. Each block's pieces are gathered and appended to the
bucket of the shard that will hold them; a shard whose last piece has arrived is built and written
at once, on a writer thread, while the main thread goes on reading. When buffered tokens would
exceed the memory budget, the largest buckets are spilled to disk and read back when their shard
is complete.

    blocks (input order)      shards (output order)
    b0 b1 b2 b3 ...   --->    part-00000 <- pieces from b0, b3     complete after b3: written
                              part-00001 <- pieces from b1, b2, b7 complete after b7: written

With input order and `concat`, shards complete almost as fast as blocks are read and memory
stays at a few blocks; with shuffle or curriculum order, a shard completes only when its last
source block is read, and the budget decides how much waits in memory and how much is spilled.
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

from packctl.arrays import copy_segments, offsets_of
from packctl.io.reader import SequenceIndex, TokenSource
from packctl.io.writer import OutputDir, ShardInfo, rows_to_table
from packctl.plan.windows import PackPlan
from packctl.thd import build_pack_rows


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
    """Builds and writes complete shards on worker threads, with a bounded queue (backpressure)."""

    def __init__(self, workers: int, max_pending: int):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packctl-writer")
        self._pending: deque[Future] = deque()
        self._max_pending = max_pending
        self.results: dict[int, ShardInfo] = {}
        self._lock = threading.Lock()

    def submit(self, shard: int, fn: Callable[[], ShardInfo]) -> None:
        while len(self._pending) >= self._max_pending:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._run, shard, fn))

    def _run(self, shard: int, fn: Callable[[], ShardInfo]) -> None:
        info = fn()
        with self._lock:
            self.results[shard] = info

    def finish(self) -> None:
        while self._pending:
            self._pending.popleft().result()
        self._pool.shutdown()

    def cancel(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)


@dataclass
class MaterializeResult:
    shards: list[ShardInfo]
    spill_files: int  # bucket spills written (and read back)
    spilled_bytes: int
    blocks_reread: int  # input blocks decoded a second time (they did not fit the budget during scan)


def materialize(plan: PackPlan, pack_lens: np.ndarray, index: SequenceIndex, source: TokenSource, *,
                output: OutputDir, metadata: bytes, shard_rows: int, pad_token_id: int, budget: int,
                progress: Callable[[int], None] = lambda n: None,
                writers: int | None = None) -> MaterializeResult:
    """Write every pack of `plan` into shards part-00000.parquet ... (see the module docstring)."""
    bounds = shard_bounds(plan.window_bins, shard_rows)
    num_shards = len(bounds) - 1
    shard_piece_offsets = plan.bin_offsets[bounds]
    pieces_per_shard = np.diff(shard_piece_offsets)
    piece_shard = np.repeat(np.arange(num_shards), pieces_per_shard)
    remaining = pieces_per_shard.copy()
    buckets: dict[int, _Bucket] = {}
    buffered = 0
    spill_dir = output.tmp / ".spill"
    spills = spilled_bytes = 0

    def build(s: int, bucket: _Bucket) -> ShardInfo:
        # Pieces arrived block by block; put them (and their tokens) back in pack order.
        pieces, tokens, labels = bucket.collect()
        lens = plan.piece_len[pieces]
        order = np.argsort(pieces, kind="stable")
        if not (order[1:] > order[:-1]).all():  # arrived out of pack order: reorder the token segments
            src_starts, lens = offsets_of(lens)[:-1][order], lens[order]
            dst_starts = offsets_of(lens)[:-1]
            in_order = np.empty_like(tokens), np.empty_like(labels)
            copy_segments(tokens, src_starts, in_order[0], dst_starts, lens)
            copy_segments(labels, src_starts, in_order[1], dst_starts, lens)
            tokens, labels = in_order
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        p_lo, p_hi = int(shard_piece_offsets[s]), int(shard_piece_offsets[s + 1])
        rows = build_pack_rows(plan.bin_offsets[lo:hi + 1] - p_lo, plan.piece_len[p_lo:p_hi],
                               plan.piece_padded[p_lo:p_hi], plan.piece_gid[p_lo:p_hi], tokens, labels,
                               pack_lens[lo:hi], pad_token_id=pad_token_id)
        info = output.write_shard(f"part-{s:05d}.parquet", rows_to_table(rows, metadata))
        progress(hi - lo)
        return info

    workers = writers if writers is not None else max(1, min(2, (os.cpu_count() or 1)))
    pool = _Writers(workers, max_pending=2 * workers)
    try:
        src_order = np.argsort(plan.piece_gid, kind="stable")
        sorted_gid = plan.piece_gid[src_order]
        cuts = np.searchsorted(sorted_gid, index.block_offsets)
        for b, block in enumerate(index.blocks):
            lo, hi = int(cuts[b]), int(cuts[b + 1])
            if lo == hi:  # every sequence of the block was dropped
                if source.cached(b):
                    source.take(b, block)
                continue
            decoded = source.take(b, block)
            sel = src_order[lo:hi]
            sel = sel[np.argsort(piece_shard[sel], kind="stable")]  # group by destination shard
            rows = plan.piece_gid[sel] - index.block_offsets[b]
            shards_here, first = np.unique(piece_shard[sel], return_index=True)
            cuts_here = np.append(first, len(sel))
            for k, s in enumerate(shards_here.tolist()):
                a, z = cuts_here[k], cuts_here[k + 1]
                # Each shard's part gets arrays of its own, so spilling or writing it frees memory
                # even while other shards still wait for their part of this block.
                tokens, labels = decoded.gather(rows[a:z], plan.piece_start[sel[a:z]], plan.piece_len[sel[a:z]])
                bucket = buckets.setdefault(s, _Bucket())
                buffered += bucket.add(sel[a:z], tokens, labels)
                remaining[s] -= z - a
                if remaining[s] == 0:
                    done = buckets.pop(s)
                    buffered -= done.nbytes
                    pool.submit(s, lambda s=s, done=done: build(s, done))
            del decoded
            # Over budget: spill the largest buckets until half the budget is free for what comes next.
            while buffered + source.held > budget and buckets:
                s = max(buckets, key=lambda key: buckets[key].nbytes)
                if buckets[s].nbytes == 0:
                    break
                spill_dir.mkdir(exist_ok=True)
                freed = buckets[s].spill(spill_dir / f"{s:05d}-{spills}.npy")
                buffered -= freed
                spilled_bytes += freed
                spills += 1
                if buffered + source.held <= budget // 2:
                    break
        if buckets or remaining.any():
            raise AssertionError(f"materialize left {int(remaining.sum())} pieces unrouted")
        pool.finish()
    except BaseException:
        pool.cancel()
        raise
    if spill_dir.exists():
        spill_dir.rmdir()
    return MaterializeResult(shards=[pool.results[s] for s in range(num_shards)], spill_files=spills,
                             spilled_bytes=spilled_bytes, blocks_reread=source.blocks_reread)

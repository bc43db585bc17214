"""`packctl.pack(config)`: scan -> order -> plan -> materialize -> report, on one rank or many.

Every stage receives the communicator (`packctl.dist.comm`); a run without MPI is the same code
with one rank. Only lengths travel through scan, order and plan; tokens are read in materialize.

    rank r:  scan its blocks -> sample-sort (key, gid) -> receive its whole windows -> plan them
             -> request tokens from the ranks that read them -> write its windows' shards
    rank 0:  gathers counts and plans -> metrics.json -> manifest.json (last) -> OUT

Shards are numbered by window order, never by rank, so the output bytes do not depend on the
number of ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from packctl.config import PackConfig
from packctl.dist.comm import get_comm
from packctl.dist.samplesort import redistribute, sample_sort
from packctl.errors import PackctlError
from packctl.io.manifest import build_manifest, shard_metadata
from packctl.io.reader import SequenceIndex, index_inputs, scan_blocks, split_blocks
from packctl.io.writer import OutputDir, OutputLock, ShardInfo, check_output_path, inspect_partial
from packctl.dist.assign import assign, hand_over, units_of
from packctl.materialize import materialize, needed_blocks

# --token-transfer auto reads (instead of exchanging) when ranks together decode at most this many
# times the input blocks the output needs.
READ_AMPLIFICATION_LIMIT = 1.5
from packctl.metrics import batch_metrics, pack_metrics
from packctl.plan.align import pack_lengths_padded, round_up
from packctl.plan.shapes import (batch_shapes, buckets_from_histogram, length_histogram, planned_item_lengths,
                                 with_row_length)
from packctl.plan.balance import (BalancedPlan, BalanceSpec, balance_plan, imbalance, imbalance_summary,
                                  lr_scales)
from packctl.plan.order import order_keys, order_sequences
from packctl.plan.windows import PackPlan, SequenceTooLong, merge_plans, plan_windows


class Progress:
    """Receives stage progress; the default shows nothing (the CLI passes a rich display)."""

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        return lambda n: None

    def close(self) -> None:
        pass


@dataclass
class PackResult:
    """What a pack run did: where it wrote, the counts of the manifest, metrics and timings.
    Under MPI, rank 0 holds the whole result; other ranks get their own timings only."""

    output: Path
    counts: dict[str, int]
    metrics: dict[str, Any]
    timings: dict[str, float]
    shards: list[ShardInfo] = field(default_factory=list)


def pack(config: PackConfig, *, progress: Progress | None = None, comm=None) -> PackResult:
    """Pack `config.inputs` into `config.output` and return the counts and metrics.

    >>> from packctl import PackConfig, pack
    >>> result = pack(PackConfig(inputs=["sample_data"], output="/tmp/out", capacity=4096,
    ...                          too_long="split", overwrite=True))          # doctest: +SKIP
    >>> result.metrics["utilization"]                                        # doctest: +SKIP
    0.99...

    Under `mpiexec -n N` every rank calls it with the same config. A bad option or input found
    before any rank starts reading raises the same PackctlError on every rank; an error in one
    rank's own data later raises there (the CLI then aborts all ranks).

    Shards are journaled as they are finished in `.OUT.packctl-partial`; a run that fails or is
    interrupted (SIGINT, SIGTERM: `RunInterrupted`, exit 130 / 143) after finishing some keeps
    them there, and `config.resume` continues it (io/writer.py).
    """
    comm = comm or get_comm()
    progress = progress if (progress is not None and comm.rank == 0) else Progress()
    out = Path(config.output)
    lock = OutputLock(out)
    guard = _SignalGuard()
    run = _Run()
    try:
        with guard.installed():
            return _pack(config, comm, progress, out, lock, guard, run)
    except BaseException as exc:
        failure = _after_failure(comm, run.output, exc)
        if failure is exc:
            raise
        raise failure from None
    finally:
        lock.release()
        progress.close()


@dataclass
class _Run:
    output: OutputDir | None = None


def _pack(config: PackConfig, comm, progress: Progress, out: Path, lock: OutputLock, guard: "_SignalGuard",
          run: _Run) -> PackResult:
    timings: dict[str, float] = {}
    started = time.perf_counter()

    index, fingerprint, done = _broadcast_outcome(comm, lambda: _preflight(config, out, lock))

    with _timed(timings, "scan"):
        block_bounds = split_blocks(index.blocks, comm.size)
        lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
        index, source = scan_blocks(index, lo, hi, config.resolved_memory_budget,
                                    progress=progress.stage("scan", hi - lo), skip_empty=config.skip_empty,
                                    pad_token_id=config.pad_token_id)
        _check_too_long(comm, index, config)
        skipped_empty = comm.allreduce_sum(int(np.count_nonzero(index.lengths == 0))) if config.skip_empty else 0

    with _timed(timings, "order"):
        gids, lengths, first_window = order_and_distribute(comm, index, config)

    with _timed(timings, "plan"):
        batch = config.mode == "batch"
        buckets = shape_buckets_of_items(comm, lengths, config) if batch and config.shape_buckets else None
        plan = plan_windows(gids, lengths, capacity=config.plan_capacity, align=config.align,
                            algorithm="batch" if batch else config.algorithm, too_long=config.too_long,
                            window=config.window, first_window=first_window, max_seqs_per_bin=config.max_seqs_per_bin,
                            seed=config.seed, progress=progress.stage("plan", len(gids)),
                            pool_size=config.pool_size, pool_strategy=config.pool_strategy,
                            max_tokens=config.resolved_max_tokens, buckets=buckets)
        _check_something_to_pack(comm, plan, index, config, skipped_empty)
        if batch:
            plan = with_row_length(plan, batch_shapes(plan, config.resolved_max_tokens, buckets)[0])
        balanced = balance(comm, plan, config, first_window) if config.balanced else None
        if balanced is not None:
            plan = balanced.result.plan
        columns = dict(balanced.columns) if balanced is not None else {}
        if batch:
            padded_len, rows = batch_shapes(plan, config.resolved_max_tokens, buckets)
            pack_lens = padded_len * rows
            columns.update(padded_len=padded_len.astype(np.int32), batch_size=rows.astype(np.int32))
        else:
            pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                            config.resolved_pack_multiple)
            if config.shape_buckets:
                buckets = _global_buckets(comm, pack_lens, config.resolved_pack_multiple, config.capacity,
                                          config.shape_buckets)
                pack_lens = buckets[np.searchsorted(buckets, pack_lens, side="left")] if len(pack_lens) else pack_lens

    with _timed(timings, "assign"):
        assignment = assign(comm.allgather(units_of(plan.window_bins, pack_lens, config.shard_rows)), comm.size)
        to_write, my_pack_lens, my_columns = hand_over(comm, plan, pack_lens, columns, assignment)
        read_own = choose_read_own(comm, config.token_transfer, to_write, index)

    output = run.output = _open_output(comm, out, config.overwrite, fingerprint, done)
    # --resume is how a run executes, not what it writes: the shards do not record it.
    content = dataclasses.replace(config, resume=False)
    tokens_in = comm.allreduce_sum(int(index.lengths.sum()))
    # In one process the plan is the whole plan: its metrics are computed beside materialize.
    early_metrics = _in_background(plan_metrics, plan, pack_lens, config, index.num_sequences, tokens_in,
                                   skipped_empty=skipped_empty) if comm.size == 1 else None
    with _timed(timings, "materialize"):
        written = materialize(comm, to_write, my_pack_lens, index, source, block_bounds, assignment, output=output,
                              metadata=shard_metadata(content, index.labels_column, index.files),
                              pad_token_id=config.pad_token_id, budget=config.resolved_memory_budget,
                              columns=my_columns, read_own=read_own,
                              progress=progress.stage("materialize", comm.allreduce_sum(plan.num_bins)))
    with _timed(timings, "report"):
        pad_like = comm.allreduce_sum(source.tokens_equal_to_pad_id)
        mine = (plan, pack_lens, written.shards, balanced.figures if balanced is not None else None,
                columns.get("batch_size"), buckets, columns.get("step"), columns.get("dp_rank"))
        parts = comm.allgather(mine) if comm.size > 1 else [mine]
    timings["total"] = time.perf_counter() - started
    ranks = comm.allgather(_rank_report(comm, index, to_write, written, timings, read_own))
    if comm.rank == 0:
        whole = merge_plans([p[0] for p in parts])
        all_pack_lens = np.concatenate([p[1] for p in parts])
        shards = [info for _, info in sorted((n, i) for p in parts for n, i in p[2].items())]
        metrics = early_metrics.result() if early_metrics is not None else plan_metrics(
            whole, all_pack_lens, config, index.num_sequences, tokens_in, skipped_empty=skipped_empty)
        counts = metrics["counts"]
        if balanced is not None:
            metrics["balance"] = balance_report(config, [p[3] for p in parts])
        if config.mode == "batch":
            metrics["batching"] = batch_metrics(whole.piece_len, whole.bin_offsets, np.concatenate([p[4] for p in parts]),
                                                all_pack_lens, max_tokens=config.resolved_max_tokens,
                                                input_order=np.argsort(whole.piece_gid, kind="stable"))
        if balanced is not None:
            shapes = all_pack_lens if config.mode != "batch" else np.concatenate(
                [p[1] // np.maximum(p[4], 1) for p in parts])
            metrics["balance"]["shapes"] = shape_coverage(np.concatenate([p[6] for p in parts]),
                                                          np.concatenate([p[7] for p in parts]), shapes,
                                                          config.dp_size)
        if config.shape_buckets:
            metrics["shape_buckets"] = [int(b) for b in parts[0][5]] if parts[0][5] is not None else []
        metrics["throughput"] = {
            "sequences_per_s": index.num_sequences / timings["total"],
            "tokens_per_s": tokens_in / timings["total"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "blocks": len(index.blocks),
            "blocks_read_twice": sum(r["blocks_read_twice"] for r in ranks),
            "spill_files": sum(r["spill_files"] for r in ranks),
            "spilled_bytes": sum(r["spilled_bytes"] for r in ranks),
            # facts of this run, not of the packing (`packctl stats` cannot recompute them)
            "resumed_shards": len(done or {}),
            "tokens_equal_to_pad_id": pad_like,
        }
        metrics["timings"] = timings
        if comm.size > 1:
            metrics["ranks"] = ranks
        output.write_json("metrics.json", metrics)
        with guard.deferred():  # a signal now waits: the output is moments from complete
            output.drop_journal()
            output.write_json("manifest.json", build_manifest(config, index.labels_column, index.files,
                                                               shards, counts, timings))
            output.commit()
    comm.barrier()
    if comm.rank != 0:
        return PackResult(output=out, counts={}, metrics={"ranks": ranks}, timings=timings)
    return PackResult(output=out, counts=counts, metrics=metrics, timings=timings, shards=shards)


class RunInterrupted(PackctlError):
    """SIGINT or SIGTERM stopped the run; exit code 128 + the signal number (130, 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class _Interrupted(BaseException):
    """Raised in the main thread by the signal handler (a BaseException, like KeyboardInterrupt,
    so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _SignalGuard:
    """SIGINT and SIGTERM stop the run by raising in the main thread; writer threads finish the
    shard they are writing (journaled), the others are not started. During the final commit a
    signal is deferred, and the run completes."""

    def __init__(self) -> None:
        self._defer = False
        self._stopping = False

    def _handle(self, signum, frame) -> None:
        if self._defer or self._stopping:
            return
        self._stopping = True
        raise _Interrupted(signum)

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._handle)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer = True
        try:
            yield
        finally:
            self._defer = False


def _after_failure(comm, output: OutputDir | None, exc: BaseException) -> BaseException:
    """Clean up after a failed or interrupted run and say what happened to the work done.

    A single process removes its partial directory unless it holds finished shards; those are kept
    for `--resume` (under MPI other ranks may still be writing: the directory is always kept)."""
    kept = 0
    if output is not None and comm.rank == 0:
        kept = output.finished_shards()
        if comm.size == 1 and kept == 0:
            output.abort()
    where = output.tmp if output is not None else None
    resume_hint = (f"{kept} finished shard(s) are kept in {where}: rerun the same command with --resume to "
                   "continue") if kept else ""
    if isinstance(exc, (_Interrupted, KeyboardInterrupt)):
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        message = f"interrupted by {name}; " + (resume_hint or "no shard was finished: run the command again")
        return RunInterrupted(message, signum)
    if isinstance(exc, PackctlError) and resume_hint:
        exc.args = (f"{exc}; {resume_hint}",)
    return exc


def _preflight(config: PackConfig, out: Path, lock: OutputLock) -> tuple[SequenceIndex, dict, dict | None]:
    """Everything decided from options and Parquet footers, before any token is read; takes the
    output lock and checks what an interrupted run left (the shards `--resume` keeps)."""
    config.validate()
    check_output_path(out, overwrite=config.overwrite)
    index = index_inputs(config.inputs, config.tokens_column, config.labels_column)
    check_output_path(out, overwrite=config.overwrite, inputs=[f.path for f in index.files],
                      input_dirs=[str(i) for i in config.inputs])
    lock.acquire()
    fingerprint = run_fingerprint(config, index)
    done = inspect_partial(out, fingerprint, resume=config.resume)
    return index, fingerprint, done


def run_fingerprint(config: PackConfig, index: SequenceIndex) -> dict[str, Any]:
    """What must not change between an interrupted run and its `--resume`: everything the shards
    record (format, packctl version, config without execution-only options, layout, inputs) plus
    each input's modification time."""
    fingerprint = json.loads(shard_metadata(dataclasses.replace(config, resume=False), index.labels_column,
                                            index.files))
    for entry in fingerprint["inputs"]:
        try:
            entry["mtime_ns"] = os.stat(entry["path"]).st_mtime_ns
        except OSError:
            entry["mtime_ns"] = None
    return fingerprint


def _check_something_to_pack(comm, plan: PackPlan, index: SequenceIndex, config: PackConfig,
                             skipped_empty: int) -> None:
    """An output without a single pack is no dataset: refuse it, saying why every sequence went."""
    if comm.allreduce_sum(plan.num_bins) > 0:
        return
    dropped = comm.allreduce_sum(len(plan.dropped))
    exc = PackctlError(
        f"{', '.join(str(i) for i in config.inputs)}: nothing to pack: of {index.num_sequences} sequences, "
        f"{dropped} are longer than the capacity {config.plan_capacity} (--too-long {config.too_long}) and "
        f"{skipped_empty} are empty (--skip-empty); raise --capacity or pass --too-long truncate|split")
    exc.everywhere = True
    raise exc


def _broadcast_outcome(comm, fn):
    """Run `fn` on rank 0 and give every rank its result, or raise its PackctlError on every rank
    (so all ranks stop together, and only rank 0 needs to print)."""
    outcome = None
    if comm.rank == 0:
        try:
            outcome = ("ok", fn())
        except PackctlError as exc:
            outcome = ("error", exc)
    if comm.size > 1:
        outcome = comm.bcast(outcome)
    if outcome[0] == "error":
        outcome[1].everywhere = True
        raise outcome[1]
    return outcome[1]


def _check_too_long(comm, index: SequenceIndex, config: PackConfig) -> None:
    """With --too-long error, name the over-long sequence with the smallest gid, on every rank."""
    if config.too_long != "error":
        return
    over = np.flatnonzero(round_up(index.lengths, config.align) > config.plan_capacity)
    mine = (int(index.gid_lo + over[0]), int(index.lengths[over[0]])) if len(over) else None
    found = [f for f in comm.allgather(mine) if f is not None]
    if found:
        gid, length = min(found)
        exc = PackctlError(
            f"{index.describe(gid)}: sequence of {length} tokens (padded to {int(round_up(length, config.align))}) "
            f"is longer than the capacity {config.plan_capacity}; pass --too-long drop|truncate|split or raise "
            f"--capacity")
        exc.everywhere = True
        raise exc


def order_and_distribute(comm, index: SequenceIndex, config: PackConfig) -> tuple[np.ndarray, np.ndarray, int]:
    """This rank's whole windows of the global order: (gids, true lengths, first window index).

    The order is a sample sort of (key, gid) over all ranks (input order needs none: blocks are
    already split in gid order); windows are then moved so each lives whole on one rank, rank r
    holding windows [ceil(r*W/size), ceil((r+1)*W/size)).
    """
    n_local = len(index.lengths)
    gids = index.gid_lo + np.arange(n_local, dtype=np.int64)
    lengths = index.lengths
    total = index.num_sequences
    if config.skip_empty:  # empty sequences take no place in the order (nor in window positions)
        kept = lengths > 0
        gids, lengths = gids[kept], lengths[kept]
        total = comm.allreduce_sum(len(gids))
    if config.order != "input":
        keys = order_keys(gids, round_up(lengths, config.align), config.order, seed=config.seed,
                          curriculum_order=config.curriculum_order)
        _, gids, lengths = sample_sort(comm, keys, gids, payload=lengths)
    num_windows = -(-total // config.window)
    if comm.size > 1:
        def owner(positions: np.ndarray) -> np.ndarray:
            return (positions // config.window) * comm.size // num_windows

        gids, lengths = redistribute(comm, [gids, lengths], comm.exscan(len(gids)), owner)
    first_window = -(-comm.rank * num_windows // comm.size)
    return gids, lengths, first_window


def _open_output(comm, out: Path, overwrite: bool, fingerprint: dict, done: dict | None) -> OutputDir:
    """Rank 0 creates (or, resuming, cleans) the partial output directory; every rank writes its
    shards into it, skipping those in `done`."""
    created: dict[str, OutputDir] = {}

    def create() -> str:
        created["dir"] = OutputDir(out, overwrite=overwrite, fingerprint=fingerprint, done=done)
        return str(created["dir"].tmp)

    tmp = _broadcast_outcome(comm, create)
    return created["dir"] if "dir" in created else OutputDir.attach(out, Path(tmp), comm.rank, done)


def choose_read_own(comm, transfer: str, plan: PackPlan, index: SequenceIndex) -> bool:
    """Whether ranks read their pieces' blocks themselves (`--token-transfer`): "auto" reads when
    all ranks together would decode at most READ_AMPLIFICATION_LIMIT x the blocks the output
    needs (input order: each rank's packs come from about its own share of the blocks; shuffle:
    every rank would read nearly every block)."""
    if comm.size == 1 or transfer == "exchange":
        return False
    if transfer == "read":
        return True
    blocks = needed_blocks(plan, index)
    read = comm.allreduce_sum(int(sum(index.blocks[b].nbytes for b in blocks.tolist())))
    needed = np.zeros(len(index.blocks), np.int64)
    needed[blocks] = 1
    union = comm.allreduce_sum(needed) if comm.size > 1 else needed
    total = int(sum(block.nbytes for block, used in zip(index.blocks, union.tolist()) if used))
    return read <= READ_AMPLIFICATION_LIMIT * max(total, 1)


def _rank_report(comm, index: SequenceIndex, plan: PackPlan, written, timings: dict[str, float],
                 read_own: bool) -> dict[str, Any]:
    """One rank's share of the work, for metrics.json's `ranks`: `plan` holds the packs it wrote."""
    return {
        "rank": comm.rank,
        "sequences_scanned": len(index.lengths),
        "tokens_scanned": int(index.lengths.sum()),
        "packs_written": plan.num_bins,
        "tokens_written": int(plan.piece_len.sum()),
        "token_transfer": "read" if read_own else "exchange",
        "blocks_read": written.blocks_read,
        "shards_written": len(written.shards),
        "bytes_sent": int(comm.bytes_sent),
        "bytes_received": int(comm.bytes_received),
        "exchange_rounds": written.rounds,
        "blocks_read_twice": written.blocks_reread,
        "spill_files": written.spill_files,
        "spilled_bytes": written.spilled_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "timings": dict(timings),
    }


@dataclass
class _Balanced:
    result: BalancedPlan
    columns: dict[str, np.ndarray]  # per pack of this rank: step, dp_rank, micro_batch (lr_scale)
    figures: dict[str, Any]  # this rank's steps, for the report


def balance_spec(config: PackConfig) -> BalanceSpec:
    return BalanceSpec(dp_size=config.dp_size, micro_batches=config.micro_batches, step_tokens=config.step_tokens,
                       cost=config.balance, attn_coeff=float(config.attn_coeff),
                       # a micro-batch's shape is its own: in batch mode sequences never move between them
                       scope="packs" if config.mode == "batch" else config.balance_scope,
                       padded_cost=config.mode == "batch",
                       equal_counts=config.equal_counts, capacity=config.plan_capacity,
                       max_seqs_per_bin=config.max_seqs_per_bin, grouping=config.step_grouping, seed=config.seed)


def balance(comm, plan: PackPlan, config: PackConfig, first_window: int = 0) -> _Balanced:
    """Balance this rank's windows (plan/balance.py); steps are numbered after the ranks before,
    and `lr_scale` needs the mean batch size of all ranks when no reference is given."""
    shape = None
    if config.warmup_shapes:
        # a pack's shape: its padded length in batch mode (every piece already holds it), else the
        # length it will be written with
        if config.mode == "batch":
            shape = plan.piece_padded[plan.bin_offsets[:-1]]
        else:
            shape = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                        config.resolved_pack_multiple)
            if config.shape_buckets:  # the buckets the pack lengths will be rounded to (moves may still change them)
                buckets = _global_buckets(comm, shape, config.resolved_pack_multiple, config.capacity,
                                          config.shape_buckets)
                shape = buckets[np.searchsorted(buckets, shape, side="left")] if len(shape) else shape
    result = balance_plan(plan, balance_spec(config), first_window=first_window,
                          pack_shape=shape if plan.num_bins else None)
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
    return _Balanced(result=result, columns=columns, figures=figures)


def shape_coverage(step: np.ndarray, dp_rank: np.ndarray, shape: np.ndarray, dp_size: int) -> dict[str, Any]:
    """When every rank has met every shape (pack length, or padded_len in batch mode): the step
    by which rank r has seen shape s, maximized over ranks: `all_seen_by_step` is the step after
    which no rank meets a new shape (no more torch.compile recompiles)."""
    step, dp_rank, shape = (np.asarray(a, dtype=np.int64) for a in (step, dp_rank, shape))
    values = np.unique(shape)
    first_seen = []
    for value in values.tolist():
        sel = shape == value
        per_rank = np.full(dp_size, np.iinfo(np.int64).max)
        np.minimum.at(per_rank, dp_rank[sel], step[sel])
        first_seen.append(int(per_rank.max()) if (per_rank < np.iinfo(np.int64).max).all() else None)
    seen = [f for f in first_seen if f is not None]
    return {"distinct": len(values), "values": values.tolist(), "all_ranks_seen_by_step": first_seen,
            "all_seen_by_step": max(seen) if seen and len(seen) == len(first_seen) else None,
            "steps": int(step.max()) + 1 if len(step) else 0}


def balance_report(config: PackConfig, figures: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's `balance`: imbalance (max/mean over ranks, per step) before, i.e. round robin
    over the planner's packs, and after; batch sizes and lr_scale per step."""
    cat = (lambda key: np.concatenate([f[key] for f in figures]))
    before_tokens, before_attention = cat("before_tokens"), cat("before_attention")
    after_tokens, after_attention = cat("after_tokens"), cat("after_attention")
    packs_per_step = cat("packs_per_step")
    return {
        "dp_size": config.dp_size, "micro_batches": config.micro_batches, "step_tokens": config.step_tokens,
        "cost": config.balance, "attn_coeff": float(config.attn_coeff), "scope": config.balance_scope,
        "step_grouping": config.step_grouping, "equal_counts": config.equal_counts,
        "steps": int(len(packs_per_step)),
        "unequal_steps": int(sum(f["unequal_steps"] for f in figures)),
        "packs_added": int(sum(f["packs_added"] for f in figures)),
        "before": {"tokens": imbalance_summary(before_tokens), "attention": imbalance_summary(before_attention)},
        "after": {"tokens": imbalance_summary(after_tokens), "attention": imbalance_summary(after_attention)},
        "lr_scaling": config.lr_scaling, "batch_unit": config.batch_unit,
        "ref_batch_size": figures[0]["ref_batch_size"],
        "per_step": {
            "packs": packs_per_step.tolist(),
            "sequences": cat("step_sequences").tolist(),
            "tokens": cat("step_tokens").tolist(),
            "lr_scale": [round(float(x), 6) for x in cat("lr_scale")],
            "attention_imbalance": [round(float(x), 6) for x in imbalance(after_attention)],
            "tokens_imbalance": [round(float(x), 6) for x in imbalance(after_tokens)],
        },
    }


def order_corpus(index, config: PackConfig) -> np.ndarray:
    """The sequence order of `config` in one process (depends on the order options and the
    alignment only)."""
    return order_sequences(round_up(index.lengths, config.align), config.order, seed=config.seed,
                           curriculum_order=config.curriculum_order)


def plan_corpus(index, config: PackConfig, permutation: np.ndarray | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[PackPlan, np.ndarray]:
    """The packs of a whole corpus and their final lengths, in one process, exactly as
    `pack(config)` writes them (the what-if of `packctl stats`).

    `index` needs `lengths` (true length by gid) and `describe(gid)` (where a sequence comes
    from, for the over-long error).
    """
    if permutation is None:
        permutation = order_corpus(index, config)
    try:
        plan = plan_windows(permutation, index.lengths[permutation], capacity=config.plan_capacity,
                            align=config.align, algorithm=config.algorithm, too_long=config.too_long,
                            window=config.window, max_seqs_per_bin=config.max_seqs_per_bin, seed=config.seed,
                            pool_size=config.pool_size, pool_strategy=config.pool_strategy,
                            progress=progress)
    except SequenceTooLong as exc:
        raise PackctlError(
            f"{index.describe(exc.gid)}: sequence of {exc.length} tokens (padded to {exc.padded}) is longer "
            f"than the capacity {exc.capacity}; pass --too-long drop|truncate|split or raise --capacity"
        ) from None
    pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, config.pad_to,
                                    config.resolved_pack_multiple)
    return plan, pack_lens


def shape_buckets_of_items(comm, lengths: np.ndarray, config: PackConfig) -> np.ndarray:
    """Batch mode's `--shape-buckets` padded lengths, from every rank's sequence lengths."""
    items = planned_item_lengths(lengths, config.plan_capacity, config.align, config.too_long)
    histogram = comm.allreduce_sum(length_histogram(items, config.align, config.plan_capacity))
    return buckets_from_histogram(histogram, config.align, config.shape_buckets)


def _global_buckets(comm, pack_lens: np.ndarray, multiple: int, capacity: int, k: int) -> np.ndarray:
    """`--shape-buckets` pack lengths (--pad-to multiple), from every rank's pack lengths."""
    histogram = comm.allreduce_sum(length_histogram(pack_lens, multiple, capacity))
    return buckets_from_histogram(histogram, multiple, k)


def plan_metrics(plan: PackPlan, pack_lens: np.ndarray, config: PackConfig, num_sequences: int,
                 tokens_in: int, *, skipped_empty: int = 0) -> dict[str, Any]:
    """metrics.json without throughput and timings: what the plan of the whole corpus achieves.
    In batch mode the "capacity" of a row is the micro-batch budget, max_tokens."""
    capacity = config.resolved_max_tokens if config.mode == "batch" else config.capacity
    metrics = pack_metrics(plan.piece_len, plan.bin_offsets, pack_lens, capacity=capacity,
                           align=config.align, input_order=np.argsort(plan.piece_gid, kind="stable"))
    metrics["algorithm"] = config.algorithm
    metrics["order"] = config.order
    metrics["counts"] = plan_counts(plan, num_sequences, tokens_in, skipped_empty=skipped_empty)
    return metrics


def plan_counts(plan: PackPlan, num_sequences: int, tokens_in: int, *, skipped_empty: int = 0) -> dict[str, int]:
    """The manifest's `counts`. Empty sequences left out by --skip-empty are counted on their own
    (`sequences_skipped_empty`) and among `sequences_dropped` (every input sample absent from the
    output), so conservation checks see every sample accounted for."""
    dropped = len(plan.dropped) + skipped_empty
    return {
        "sequences_in": num_sequences,
        "sequences_packed": num_sequences - dropped,
        "sequences_dropped": dropped,
        "sequences_skipped_empty": skipped_empty,
        "sequences_truncated": len(plan.truncated),
        "sequences_split": len(plan.split_gids()),
        "tokens_in": tokens_in,
        "tokens_packed": int(plan.piece_len.sum()),
        "tokens_dropped": plan.tokens_dropped,
        "tokens_truncated": plan.tokens_truncated,
        "packs": plan.num_bins,
        "pieces": len(plan.piece_gid),
    }


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _in_background(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """fn(*args, **kwargs) on a thread of its own; `.result()` gives its value (or raises its error)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever asks for the result
            future.set_exception(exc)

    threading.Thread(target=run, name="packctl-metrics", daemon=True).start()
    return future


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - t0

"""`packctl materialize PLAN -o OUT`: the output `pack` writes, from the plan `pack --plan-only`
wrote of it, on one rank or many. Its shards are those of `pack` without --plan-only, byte for
byte: a plan's shards carry that output's `packctl` metadata, and its row groups are the units
that output is written in (pipeline/assign.py), so the same machinery writes them:

    rank r:  its share of the source's blocks decoded, kept within --memory-budget  (as pack's scan)
             units of its share of the plan's shards (footers, seq_lens_padded)
             assign: its run of units, equal tokens on every rank          pipeline/assign.py
             its packs read from the plan (checked against its manifest)
             materialize: tokens from the source into the packs           pipeline/materialize.py
    rank 0:  the plan's reports and manifests, with the shards written and
             this run's timings, then the commit                          output/commit.py -> OUT

The source must be the files the plan read (size and Parquet footer as its manifest records:
source/pieces.py `plan_source`). OUT takes the lock, the commit protocol and `--resume` of `pack`:
a materialize killed at any step resumes, and `pack ... --resume` of the same options on the OUT
it wrote finds it "already complete" (and the other way round).
"""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.config import default_memory_budget, parse_bytes
from packctl.urls import is_url, refuse_url
from packctl.contract.manifest import EPOCHS, MANIFEST, METRICS, epoch_dir, epoch_outputs, read_json_object
from packctl.contract.reader import PackedOutput, open_output
from packctl.contract.schema import (COLUMN, METADATA_KEY, PACK, PACK_COLUMNS, SAMPLE_IDS, SEQ_LENS,
                                     SEQ_LENS_PADDED, SEQ_STARTS, SEQUENCE, LOSS_COLUMNS, SEQ_LENGTHS,
                                     limit_columns)
from packctl.errors import PackctlError
from packctl.pipeline.assign import Units, WriteJob, assign
from packctl.mpi.comm import Comm, broadcast_outcome, get_comm
from packctl.output import commit as protocol
from packctl.output.lock import OutputLock
from packctl.output.outdir import Faults
from packctl.output.paths import check_output_location, is_store_output, on_store
from packctl.output.resume import inspect_output
from packctl.pipeline.manifest import PLAN_KIND
from packctl.pipeline.materialize import Scanned, ShardFormat, choose_read_own, materialize, read_amplification
from packctl.pipeline.outcome import PackResult, already_complete, open_partial_output
from packctl.pipeline.report import Corpus, Transfer, rank_report, scale_out, throughput
from packctl.runtime import Progress, RunContext, SignalGuard, run_guarded
from packctl.plan.windows import PackPlan
from packctl.source.parquet import split_blocks
from packctl.source.scan import scan_blocks
from packctl.source.kinds import input_files
from packctl.source.pieces import plan_source
from packctl.specs import CarriedColumns

if TYPE_CHECKING:
    from packctl.output.stored import StoreOutput

# What a plan's shards hold besides the per-pack and per-sequence values the writer computes again
# from the pieces (PACK_COLUMNS, seq_lengths and the loss columns): read back, they are written as
# they are (step, dp_rank, ..., seq_weights, group_ids, --keep-columns).
_REBUILT = set(PACK_COLUMNS) | {SEQ_LENGTHS, SEQ_STARTS, *LOSS_COLUMNS}


@dataclass
class Plan:
    """A plan as its readers see it: its outputs (one, or one per epoch), their manifests, the
    shards of all of them in write order (global shard k: `outputs[epoch_of[k]]`, local number)."""

    root: Path
    outputs: list[PackedOutput]
    shard_epoch: np.ndarray | None  # epoch of each global shard (None: one output)
    shard_output: list[tuple[int, int]]  # global shard -> (output, shard in it)
    metadata: bytes  # the `packctl` metadata every shard carries: that of the materialized output

    @property
    def manifest(self) -> dict[str, Any]:
        return self.outputs[0].manifest


def open_plan(path: str | Path) -> Plan:
    """The plan at `path` (the OUT of `pack --plan-only`), its manifests validated; one PackctlError
    line when it is not a plan."""
    root = path if is_url(path) else Path(path)  # a plan on a store is read through its mirror
    epochs = None if is_url(root) else epoch_outputs(root)
    remedy = "make the plan again (packctl pack --plan-only); materialize reads a plan only checked"
    outputs = [open_output(p, remedy=remedy) for p in (epochs if epochs is not None else [root])]
    for output in outputs:
        if output.manifest.get("kind") != PLAN_KIND:
            raise PackctlError(f"{output.manifest_file}: not a plan (packctl pack --plan-only writes one); this "
                               "output holds its tokens already: read it as it is")
    shard_output = [(o, k) for o, output in enumerate(outputs) for k in range(len(output.shards))]
    shard_epoch = np.array([o for o, _ in shard_output], np.int64) if epochs is not None else None
    first = outputs[0]
    try:
        metadata = (pq.read_schema(first.local_file(0)).metadata or {}).get(METADATA_KEY)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{first.shard_path(0)}: not a readable Parquet file ({exc}); make the plan again") from None
    if metadata is None:
        raise PackctlError(f"{first.shard_path(0)}: no 'packctl' Parquet metadata; make the plan again")
    return Plan(root, outputs, shard_epoch, shard_output, metadata)


def materialize_plan(plan_path: str | Path, output: str | Path, *, overwrite: bool = False, resume: bool = False,
                     memory_budget: int | str | None = None, token_transfer: str = "auto",
                     progress: Progress | None = None, comm: Comm | None = None,
                     faults: Faults | None = None) -> PackResult:
    """Write the output of the plan at `plan_path` into `output` (module docstring); every rank
    calls it with the same arguments under `mpiexec -n N`.

    >>> materialize_plan("plan", "out")          # doctest: +SKIP
    """
    comm = comm or get_comm()
    if is_url(plan_path):  # a plan on a store is read through its mirror (contract/mirror.py)
        from packctl.store import is_store_url

        if not is_store_url(plan_path):
            refuse_url(plan_path, "input")
    progress = progress if (progress is not None and comm.rank == 0) else Progress()
    if is_store_output(output):  # OUT on a store: no lock, its commit is one PUT (output/stored.py)
        from packctl.output.stored import StoreOutput, refuse_on_store

        refuse_on_store(str(output), epochs=1, ranks=comm.size)
        out = lock = StoreOutput(str(output))
    else:
        refuse_url(output, "output")
        out = Path(output)
        lock = OutputLock(out)
    held = _Held(lock, SignalGuard())
    execution = _Execution(overwrite=overwrite, resume=resume, token_transfer=token_transfer,
                           budget=parse_bytes(memory_budget) if memory_budget is not None else default_memory_budget())
    return run_guarded(comm, progress, out, lock, held.guard,
                       lambda: _materialize(plan_path if is_url(plan_path) else Path(plan_path), out, execution,
                                            RunContext(comm, progress, faults), held),
                       lambda: held.output, on_exit=lambda: held.output.close() if held.output is not None else None)


@dataclass(frozen=True)
class _Execution:
    """How `materialize_plan` runs, never what it writes: the options its manifest records beside
    the plan's (`recorded`)."""

    overwrite: bool
    resume: bool
    budget: int  # --memory-budget in bytes
    token_transfer: str

    def recorded(self, out) -> dict[str, Any]:
        return {"output": str(out), "overwrite": self.overwrite, "memory_budget": self.budget,
                "resume": self.resume, "token_transfer": self.token_transfer}


@dataclass
class _Held:
    """What a run holds while it runs, released however it ends (`runtime.run_guarded`): the
    output lock, the signal guard, and the output once opened."""

    lock: OutputLock
    guard: SignalGuard
    output: Any = None


def _materialize(plan_path: Path, out: Path, execution: _Execution, ctx: RunContext, held: _Held) -> PackResult:
    """The stages of `packctl materialize`: preflight, assign, scan, materialize, report and commit."""
    comm, timings = ctx.comm, ctx.timings
    overwrite, budget = execution.overwrite, execution.budget
    fingerprint, done, note = broadcast_outcome(comm, lambda: _preflight(
        plan_path, out, held.lock, held.guard, ctx.faults, overwrite=overwrite, resume=execution.resume))
    if note is not None:
        return already_complete(out, note) if comm.rank == 0 else PackResult(output=out, counts={}, metrics={},
                                                                        timings={}, note=note)
    plan = open_plan(plan_path)
    index, source = plan_source(plan.manifest, plan.outputs[0].manifest_file, budget=budget)
    with ctx.timed("assign"):
        job, kept = _job(comm, plan)
    # Each rank decodes its share of the blocks once, kept within the budget, as pack's scan does:
    # with one rank and a source that fits, every unit is then gathered straight from the blocks.
    block_bounds = split_blocks(index.blocks, comm.size)
    lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
    planned = source.digests  # what the plan's scan read of each block
    with ctx.timed("scan"):
        index, source = scan_blocks(index, range(lo, hi), budget, skip_empty=source.skip_empty,
                                    pad_token_id=int(plan.manifest["layout"]["pad_token_id"]))
    source.refuse_changed(index.blocks, planned, f"the plan {plan.outputs[0].manifest_file} read")
    scanned = Scanned(index, source, block_bounds)
    amplification = read_amplification(comm, job.plan, index) if comm.size > 1 else 1.0
    config = plan.manifest.get("config", {})
    read_own = choose_read_own(execution.token_transfer, amplification, config.get("order", "input"), comm.size)
    output = held.output = open_partial_output(comm, out, overwrite, fingerprint, done, ctx.faults)
    fmt = ShardFormat(metadata=plan.metadata, pad_token_id=int(plan.manifest["layout"]["pad_token_id"]),
                      budget=budget, carried=CarriedColumns(limits=plan_limits(plan.manifest)))
    with ctx.timed("materialize"):
        written = materialize(ctx, job, scanned, output, fmt, read_own=read_own, kept=kept)
    shards = comm.gather(written.shards)
    pad_like = comm.allreduce_sum(source.tokens_equal_to_pad_id)  # as pack counts them: every input token
    timings["total"] = time.perf_counter() - ctx.started
    # this run's own share of the work (a materialize plans nothing): `ranks`, `scale_out`, `throughput`
    ranks = comm.allgather(rank_report(comm, index, job.plan, written, timings,
                                       Transfer(read_own=read_own, amplification=amplification), sequences_planned=0))
    if comm.rank != 0:
        comm.barrier()
        return PackResult(output=out, counts={}, metrics={"ranks": ranks}, timings=timings)
    by_number = {n: info for part in shards for n, info in part.items()}
    run = _RunFigures(ranks, timings, resumed_shards=len(done or {}),
                      resumed_tokens=sum(e.tokens for e in (done or {}).values()), blocks=len(index.blocks),
                      tokens_equal_to_pad_id=pad_like)
    reports, manifests, entries = _reports(plan, by_number, run, execution.recorded(out))
    with held.guard.deferred():  # from here a signal waits: the output is moments from complete
        output.commit(reports=reports, manifests=manifests, shards=entries, overwrite=overwrite)
    comm.barrier()
    metrics = reports[0][1]
    return PackResult(output=out, counts=metrics.get("counts", {}), metrics=metrics, timings=timings, shards=entries)


def _preflight(plan_path: Path, out: Path, lock: OutputLock, guard: SignalGuard, faults: Faults | None, *,
               overwrite: bool, resume: bool) -> tuple[dict | None, dict | None, str | None]:
    """The plan read and its source checked, OUT's place checked, the lock taken, an interrupted
    commit finished or undone, and what earlier runs left decided (as `pack`'s preflight).
    Returns (fingerprint, the shards --resume keeps, None) or (None, None, note)."""
    reached = (faults or Faults()).reached
    if on_store(out):
        return _settle_on_store(plan_path, out, guard, overwrite=overwrite, resume=resume)
    out_real, plan_real = os.path.realpath(out), os.path.realpath(plan_path)
    if out_real == plan_real or plan_real.startswith(out_real + os.sep) or out_real.startswith(plan_real + os.sep):
        raise PackctlError(f"{out}: is the plan {plan_path} or holds it, or lies inside it; write the materialized "
                           "output to another -o")
    plan = open_plan(plan_path)
    index, _ = plan_source(plan.manifest, plan.outputs[0].manifest_file)
    # every file of the source: both halves of a Megatron pair (recorded by its .idx)
    check_output_location(out, inputs=[str(plan.root), *(p for e in plan.manifest["inputs"]
                                                         for p in input_files(e["absolute_path"]))])
    lock.acquire()
    reached("lock:taken")
    with guard.deferred(stop_after=True):
        protocol.recover(out, reached)
    fingerprint = materialized_fingerprint(plan)
    found = inspect_output(out, fingerprint, resume=resume, overwrite=overwrite)
    if found.publish:
        with guard.deferred():
            protocol.publish(out, overwrite=overwrite, reached=reached)
        return None, None, (f"{out}: already complete: the interrupted run had written all of it; it is now in "
                            "place")
    if found.complete:
        return None, None, f"{out}: already complete: it holds the output of this plan"
    return fingerprint, found.done, None


def _settle_on_store(plan_path: Path, out: StoreOutput, guard: SignalGuard, *, overwrite: bool, resume: bool
                     ) -> tuple[dict | None, dict | None, str | None]:
    """`_preflight` for an OUT on a store (output/stored.py `StoreOutput.settle`): one output, so
    the plan of one epoch only."""
    plan = open_plan(plan_path)
    if len(plan.outputs) > 1:
        from packctl.output.stored import refuse_on_store

        refuse_on_store(str(out), epochs=len(plan.outputs), ranks=1)
    plan_source(plan.manifest, plan.outputs[0].manifest_file)
    fingerprint = materialized_fingerprint(plan)
    with guard.deferred(stop_after=True):
        found = out.settle(fingerprint, resume=resume, overwrite=overwrite)
    if found.complete:
        return None, None, f"{out}: already complete: it holds the output of this plan"
    return fingerprint, found.done, None


def materialized_fingerprint(plan: Plan) -> dict[str, Any]:
    """The run fingerprint (pipeline/run.py `run_fingerprint`) of `pack` writing the plan's output
    itself: what the shards record, each input's modification time and footer as the plan read
    them, and kind "packs". So `--resume` of either command continues what the other left."""
    fingerprint = json.loads(plan.metadata)
    for entry, recorded in zip(fingerprint["inputs"], plan.manifest["inputs"]):
        entry["mtime_ns"] = recorded.get("mtime_ns")
        entry["footer"] = recorded.get("footer")
    fingerprint["kind"] = "packs"
    return fingerprint


def _units(plan: Plan, shards: range, window_starts: set[int]) -> Units:
    """The units (row groups) of global shards `shards` of the plan: the units the output is
    written in, with their written tokens (sum of seq_lens_padded)."""
    bounds, first, tokens, epoch, opens = [0], [], [], [], []
    for g in shards:
        o, k = plan.shard_output[g]
        output = plan.outputs[o]
        # the lengths and row groups only: the packs are read checked (sha256) when written (`_job`)
        table = output.read_unchecked(k, [SEQ_LENS_PADDED])
        metadata = pq.read_metadata(output.shard_path(k))
        at = 0
        offsets = table.column(SEQ_LENS_PADDED).combine_chunks()
        sums = np.concatenate([[0], np.cumsum(offsets.values.to_numpy(), dtype=np.int64)])
        row_offsets = offsets.offsets.to_numpy().astype(np.int64)
        for rg in range(metadata.num_row_groups):
            rows = metadata.row_group(rg).num_rows
            bounds.append(bounds[-1] + rows)
            first.append(rg == 0)
            tokens.append(int(sums[row_offsets[at + rows]] - sums[row_offsets[at]]))
            epoch.append(o)
            opens.append(rg == 0 and (o, k) in window_starts)
            at += rows
    return Units(bounds=np.array(bounds, np.int64), first_of_shard=np.array(first, bool),
                 tokens=np.array(tokens, np.int64),
                 epoch=np.array(epoch, np.int64) if plan.shard_epoch is not None else None,
                 opens_window=np.array(opens, bool))


def _job(comm: Comm, plan: Plan) -> tuple[WriteJob, dict[str, Any]]:
    """Every rank reads the units of an equal share of the shards; the writing is dealt out by
    tokens (as `pack` deals it); each rank then reads the packs it writes from the plan."""
    total = len(plan.shard_output)
    lo, hi = total * comm.rank // comm.size, total * (comm.rank + 1) // comm.size
    window_starts = {(o, k) for o, output in enumerate(plan.outputs)
                     for k in output.manifest.get("window_starts", [])}
    assignment = assign(comm.allgather(_units(plan, range(lo, hi), window_starts)), comm.size)
    limits = plan_limits(plan.manifest)
    first_pack, last_pack = (int(v) for v in assignment.pack_cuts[comm.rank:comm.rank + 2])
    rows = np.array([plan.outputs[o].shards[k].rows for o, k in plan.shard_output], np.int64)
    shard_first = np.concatenate([[0], np.cumsum(rows)])
    tables = []
    for g in range(total):
        a, z = max(first_pack, int(shard_first[g])), min(last_pack, int(shard_first[g + 1]))
        if a < z:
            o, k = plan.shard_output[g]
            table = plan.outputs[o].read_shard(k)
            tables.append(table.slice(a - int(shard_first[g]), z - a))
    return _plan_of(tables, assignment, limits)


def plan_limits(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The --limit columns of a plan's output, in --limit order (its layout's `limits`)."""
    return tuple((manifest.get("layout") or {}).get("limits") or {})


def _plan_of(tables: list[pa.Table], assignment, limits: tuple[str, ...] = ()) -> tuple[WriteJob, dict[str, Any]]:
    """The packs of `tables` (a plan's rows, in order) as a WriteJob, and their per-piece values
    (`limits`: the --limit columns, COL per piece and COL_sum per pack)."""
    names = [n for n in tables[0].column_names if n not in _REBUILT] if tables else []
    if tables:
        whole = pa.concat_tables(tables)
        lens = whole.column(SEQ_LENS).combine_chunks()
        bin_offsets = lens.offsets.to_numpy().astype(np.int64)
        bin_offsets -= bin_offsets[0]
        flat = {n: _values(whole.column(n)) for n in (SEQ_LENS, SEQ_LENS_PADDED, SAMPLE_IDS, SEQ_STARTS)}
    else:
        whole = None
        bin_offsets = np.zeros(1, np.int64)
        flat = {n: np.zeros(0, np.int64) for n in (SEQ_LENS, SEQ_LENS_PADDED, SAMPLE_IDS, SEQ_STARTS)}
    padded = flat[SEQ_LENS_PADDED].astype(np.int64)
    sums = np.concatenate([[0], np.cumsum(padded)])
    pack_lens = sums[bin_offsets[1:]] - sums[bin_offsets[:-1]]
    empty = np.zeros(0, np.int64)
    plan = PackPlan(window_bins=np.array([0, len(pack_lens)], np.int64), bin_offsets=bin_offsets,
                    piece_gid=flat[SAMPLE_IDS].astype(np.int64), piece_start=flat[SEQ_STARTS].astype(np.int64),
                    piece_len=flat[SEQ_LENS].astype(np.int64), piece_padded=padded,
                    dropped=empty, truncated=empty, tokens_dropped=0, tokens_truncated=0)
    columns, kept = {}, {}
    declared = {**COLUMN, **{c.name: c for name in limits for c in limit_columns(name)}}
    for name in names:
        column = declared.get(name)
        if column is not None and column.per == PACK:
            columns[name] = whole.column(name).to_numpy()
        elif column is None or column.per == SEQUENCE:
            kept[name] = whole.column(name).combine_chunks().flatten()  # one value per piece, as the input had it
    return WriteJob(plan, pack_lens, columns, assignment), kept


def _values(column: pa.ChunkedArray) -> np.ndarray:
    return column.combine_chunks().flatten().to_numpy()


@dataclass(frozen=True)
class _RunFigures:
    """What a materialize run reports of itself: every rank's report, its timings, the shards an
    interrupted run had finished, the source's blocks, and its input tokens equal to the pad id
    (a plan of Megatron pairs, which reads no token, records none)."""

    ranks: list[dict[str, Any]]
    timings: dict[str, float]
    resumed_shards: int
    resumed_tokens: int
    blocks: int
    tokens_equal_to_pad_id: int

    def apply(self, metrics: dict[str, Any], *, with_ranks: bool = True) -> dict[str, Any]:
        """`metrics` (a plan's) with this run's ranks, scale-out, throughput and timings in place of
        the plan's: what the packs achieve is the plan's, how they were written is this run's.
        `with_ranks`: whether `ranks` and `scale_out` belong there (not in an epoch's own metrics)."""
        counts = metrics.get("counts", {})
        corpus = Corpus(sequences=int(counts.get("sequences_in", 0)), tokens=int(counts.get("tokens_in", 0)),
                        skipped_empty=0, blocks=self.blocks,
                        tokens_equal_to_pad_id=self.tokens_equal_to_pad_id)
        metrics.pop("scale_out", None)
        metrics.pop("ranks", None)
        if with_ranks and len(self.ranks) > 1:  # as pack reports them: with more than one rank
            metrics["scale_out"] = scale_out(self.ranks)
            metrics["ranks"] = self.ranks
        if "throughput" in metrics:
            metrics["throughput"] = throughput(corpus, self.ranks, self.timings, resumed_shards=self.resumed_shards,
                                               resumed_tokens=self.resumed_tokens)
        metrics["timings"] = self.timings
        return metrics


def _reports(plan: Plan, shards: dict, run: _RunFigures,
             execution: dict[str, Any]) -> tuple[list, list, list]:
    """The plan's reports and manifests as the materialized output's: no `kind`, no plan_only, the
    inputs as `pack` records them, the options of where and how this run executes (`execution`),
    the shards written, this run's ranks, throughput and timings (`run`): the manifest `pack`
    writes without --plan-only."""
    timings = run.timings
    entries = [shards[n] for n in sorted(shards)]
    reports, manifests = [], []
    epochs = plan.shard_epoch is not None
    for o, output in enumerate(plan.outputs):
        manifest = copy.deepcopy(output.manifest)
        manifest.pop("kind", None)
        manifest["config"].pop("plan_only", None)
        manifest["config"].update(execution)
        for entry in manifest["inputs"]:
            for key in ("absolute_path", "mtime_ns", "footer", "block_digests"):
                entry.pop(key, None)
        mine = [shards[g] for g, (oo, _) in enumerate(plan.shard_output) if oo == o]
        manifest["shards"] = [{"path": s.path.split("/", 1)[1] if epochs else s.path, "rows": s.rows,
                               "tokens": s.tokens, "sha256": s.sha256} for s in mine]
        manifest["timings"] = timings
        prefix = f"{epoch_dir(o)}/" if epochs else ""
        metrics = run.apply(output.recorded_metrics() or {}, with_ranks=not epochs)
        reports.append((f"{prefix}{METRICS}", metrics))
        manifests.append((f"{prefix}{MANIFEST}", manifest))
    if epochs:
        top = run.apply(read_json_object(plan.root / METRICS, "make the plan again"))
        reports.insert(0, (METRICS, top))
        index = read_json_object(plan.root / EPOCHS, "make the plan again")
        index["timings"] = timings
        manifests.append((EPOCHS, index))
    return reports, manifests, entries

"""`packctl.pack(config)`: scan -> order -> plan -> assign -> materialize -> report, on one rank or many.

Preflight takes the options once (`_Decided`: every stage's spec, what the outputs record, the
index); from then on every stage receives the run's context (`packctl.runtime.RunContext`: the
communicator, progress, timings), never the PackConfig. A run without MPI is the same code with one
rank. Only lengths travel through scan, order, plan and assign; tokens are read in materialize.

    rank r:  scan its blocks (by bytes)          source/parquet.py
             order: sample-sort, whole windows   order.py (dealt by their sequences)
             plan its windows                    plan.py (plan/)
             assign: its run of packs to write,  pipeline/assign.py
                     equal tokens on every rank
             materialize its packs' row groups   materialize.py
             summarize its plan; summaries       report.py (no rank gathers another's plan)
             added up over ranks
    rank 0:  _metrics.json, _manifest.json (last)  report.py, contract/manifest.py -> OUT

With --epochs K, order and plan run once per epoch (each rank's windows of every epoch are one run
of the global order: pipeline/plan.py), and the joined plan is assigned and materialized as one, so
every block is decoded as often as for one epoch and its sequences are written K times; each epoch
is reported as an output of its own (OUT/epoch-0000e), and OUT/_epochs.json comes last.

Shards are fixed runs of packs in global order (pipeline/assign.py), never cut by rank, so the output
bytes do not depend on the number of ranks.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from packctl.config import PackConfig
from packctl.specs import Specs, TooLong, WriteSpec
from packctl.pipeline.assign import WriteJob, assign, hand_over, units_of
from packctl.mpi.comm import Comm, broadcast_outcome, get_comm
from packctl.contract.manifest import DATA_DIR, EPOCHS, MANIFEST, METRICS, epoch_dir
from packctl.errors import PackctlError
from packctl.pipeline.manifest import RunRecord
from packctl.compile_ahead import CompileAhead
from packctl.jit import CompileClock
from packctl.source.kinds import check_options, options_of
from packctl.source.parquet import describe_block, split_blocks
from packctl.source.scan import TokenSource, index_inputs, scan_blocks
from packctl.source.resolve import normalize_spec, pattern_reaching, resolve, respell
from packctl.source.groups import read_group_starts
from packctl.source.mixture import resolve_sources, with_blend
from packctl.pipeline.mixture import blend_corpus, blend_metrics, source_table, with_mixture
from packctl.contract.manifest import ShardEntry
from packctl.output import commit as protocol
from packctl.output.journal import RUN_FILE, partial_dir, read_block_digests
from packctl.output.lock import OutputLock
from packctl.output.outdir import Faults, OutputDir
from packctl.output.paths import check_output_location, is_store_output, on_store
from packctl.output.resume import inspect_output
from packctl.pipeline.outcome import PackResult, already_complete, open_partial_output
from packctl.pipeline.materialize import Scanned, ShardFormat, choose_read_own, materialize, read_amplification
from packctl.plan.order import epoch_seed
from packctl.plan.prefix import piece_parents
from packctl.pipeline.order import check_limits, check_too_long, order_and_distribute
from packctl.pipeline.plan import Planned, check_something_to_pack, join_epochs, plan_stage
from packctl.pipeline.prefix import share_prefix_lengths
from packctl.pipeline.step_loss import step_loss_columns
from packctl.pipeline.report import (Corpus, RankSummary, Transfer, epochs_index, epochs_metrics, input_order_lengths,
                                     metrics_of, padded_batching_over_ranks, rank_report, throughput)
from packctl.runtime import Progress, RunContext, RunInterrupted, SignalGuard, in_background, run_guarded
from packctl.source.index import Resolution, SequenceIndex

if TYPE_CHECKING:
    from packctl.output.stored import StoreOutput

__all__ = ["PackResult", "Progress", "RunInterrupted", "pack", "run_fingerprint"]


def pack(config: PackConfig, *, progress: Progress | None = None, comm: Comm | None = None,
         faults: Faults | None = None) -> PackResult:
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
    them there, and `config.resume` continues it (output/journal.py). The partial directory becomes
    OUT by the commit protocol (output/commit.py), and every run first finishes or undoes a commit
    a crash interrupted. A run (without `config.overwrite`, or with `config.resume`) on an OUT that
    already holds its output changes nothing and returns it (`PackResult.note`: "already
    complete"). `faults` simulates a crash at any named step, or a full disk (tests).
    """
    comm = comm or get_comm()
    config.check_types()  # OUT's path is used at once: a value of the wrong type is refused first
    progress = progress if (progress is not None and comm.rank == 0) else Progress()
    if is_store_output(config.output):  # OUT on a store: no lock, its commit is one PUT (output/stored.py)
        from packctl.output.stored import StoreOutput, refuse_on_store

        refuse_on_store(config.output, epochs=config.epochs, ranks=comm.size)
        out = lock = StoreOutput(config.output)
    else:
        out = Path(config.output)
        lock = OutputLock(out)
    guard = SignalGuard()
    run = _Run()

    def body() -> PackResult:
        ctx, run.jit = RunContext(comm, progress, faults), CompileClock()
        run.ahead = CompileAhead.start(comm.size)
        decided = broadcast_outcome(comm, lambda: _preflight(config, out, lock, guard, faults))
        return _pack(decided, ctx, out, guard, run)

    def release() -> None:
        if run.ahead is not None:
            run.ahead.stop()
        if run.output is not None:
            run.output.close()

    return run_guarded(comm, progress, out, lock, guard, body, lambda: run.output, on_exit=release)


@dataclass
class _Run:
    """What a run holds from its start to its end, whatever way it ends."""
    output: OutputDir | None = None
    ahead: CompileAhead | None = None  # the first run after an install: kernels compiled beside it
    jit: CompileClock | None = None  # the kernels' compile time, inside the stages' timings


def _pack(decided: _Decided, ctx: RunContext, out: Path, guard: SignalGuard, run: _Run) -> PackResult:
    """The stages of a run preflight decided (`decided`): scan, order and plan each epoch,
    assign, materialize, report and commit."""
    comm, timings = ctx.comm, ctx.timings
    if decided.note is not None:  # OUT already holds this run's output
        note = decided.note
        return already_complete(out, note) if comm.rank == 0 else PackResult(output=out, counts={}, metrics={},
                                                                        timings={}, note=note)
    specs, record, index, done = decided.specs, decided.record, decided.index, decided.done

    with ctx.timed("scan"):
        scanned, corpus = _scan(ctx, index, specs, plan_only=record.plan_only)
        if specs.order.mixture is not None:  # a blend's counts are of its uses
            corpus = blend_corpus(comm, scanned.index, specs.order, corpus)
    digests = _block_digests(comm, scanned)
    if done and digests is not None:
        broadcast_outcome(comm, lambda: _check_blocks_unchanged(out, scanned.index, digests))
    each = [_plan_epoch(ctx, scanned, corpus, specs, epoch, decided.inputs) for epoch in range(specs.order.epochs)]
    epochs, sequences_planned = [planned for planned, _ in each], [n for _, n in each]
    planned = join_epochs(epochs)
    with ctx.timed("assign"):
        job, transfer = _assign(comm, planned, scanned, specs.write, [e.plan.num_bins for e in epochs])

    output = run.output = open_partial_output(comm, out, decided.overwrite, decided.fingerprint, done, ctx.faults)
    if comm.rank == 0 and digests is not None:
        output.keep_block_digests(digests)
    # each rank summarizes its own windows beside materialize; the summaries are added up in report
    summaries = in_background(lambda: [RankSummary.of(p, specs.report, epoch=e, rank=comm.rank,
                                                       group_starts=index.group_starts)
                                        for e, p in enumerate(epochs)])
    if run.ahead is not None:
        run.ahead.wait()  # compiled meanwhile: materialize loads them from the cache
    with ctx.timed("materialize"):
        written = materialize(ctx, job, scanned, output, _shard_format(record, specs, scanned.index),
                              read_own=transfer.read_own)
    with ctx.timed("report"):
        mixture = blend_metrics(comm, scanned.index, specs.order, epochs[0]) if specs.order.mixture is not None else None
        corpus.tokens_equal_to_pad_id = (comm.allreduce_sum(scanned.source.tokens_equal_to_pad_id)
                                         if scanned.tokens_read else None)
        figures = _plan_figures(comm, epochs, summaries.result(), scanned.index)
        shard_epoch = job.assignment.shard_epoch
        # rank 0 only: one entry per shard
        shards = comm.gather([{n: i for n, i in written.shards.items() if shard_epoch is None or shard_epoch[n] == e}
                              for e in range(len(epochs))])
    timings["total"] = time.perf_counter() - ctx.started
    timings["compile"] = run.jit.seconds  # inside the stages above; throughputs leave it out
    ranks = comm.allgather(rank_report(comm, scanned.index, job.plan, written, timings, transfer,
                                       sequences_planned=sum(sequences_planned)))
    if comm.rank != 0:
        comm.barrier()
        return PackResult(output=out, counts={}, metrics={"ranks": ranks}, timings=timings)

    whole_run = throughput(corpus, ranks, timings, resumed_shards=len(done or {}),
                           resumed_tokens=sum(e.tokens for e in (done or {}).values()))
    epoch_shards = [{n: i for s in shards for n, i in s[e].items()} for e in range(specs.order.epochs)]
    facts = _RunFacts(record, specs, index, corpus, whole_run, timings, job.assignment.shard_opens_window, digests,
                      mixture)
    metrics, reports, manifests, listed = _outputs(facts, figures, epoch_shards, ranks, epochs)
    with guard.deferred():  # from here a signal waits: the output is moments from complete
        output.commit(reports=reports, manifests=manifests, shards=listed, overwrite=decided.overwrite)
    comm.barrier()
    return PackResult(output=out, counts=metrics["counts"], metrics=metrics, timings=timings, shards=listed,
                      plan_only=record.plan_only)


def _plan_epoch(ctx: RunContext, scanned: Scanned, corpus: Corpus, specs: Specs, epoch: int,
                inputs: tuple[str, ...]) -> tuple[Planned, int]:
    """Order and plan one epoch (this rank's windows of it), with the epoch's own seed (plan/order.py
    `epoch_seed`), so its shuffle, ffs packing and step grouping are its own; with the number of
    sequences this rank planned."""
    comm = ctx.comm
    specs = specs.for_epoch(epoch_seed(specs.order.seed, epoch)) if epoch else specs
    with ctx.timed("order"):
        ordered = order_and_distribute(comm, scanned.index, specs.order, specs.groups, specs.windows, epoch)
    with ctx.timed("plan"):
        planned = plan_stage(comm, ordered, specs, progress=ctx.counter("plan", len(ordered.gids)))
        if epoch == 0:  # every epoch packs the same sequences
            check_something_to_pack(comm, planned.plan, scanned.index, specs.lengths, inputs, corpus.skipped_empty)
        if planned.balanced is not None:  # every pack of a step gets the step's loss tokens
            parents = None if scanned.index.shared is None else piece_parents(planned.plan,
                                                                               scanned.index.group_starts)
            planned.columns.update(step_loss_columns(comm, planned.plan, planned.balanced.result.step,
                                                     scanned.index, scanned.source, scanned.block_bounds, parents))
    return planned, len(ordered.gids)


def _plan_figures(comm: Comm, epochs: list[Planned], summaries: list[RankSummary], scanned_index: SequenceIndex
                  ) -> list[tuple[RankSummary, int]]:
    """The summary of every rank's plan of each epoch, added up, with the padded-batching baseline
    of its pieces in input order; with --epochs, then the same of all epochs together. Every rank
    holds its own pieces and those of the sample ids it scanned, never all of them."""
    merged = [comm.allreduce_sum(s) for s in summaries]
    gid_starts = np.array(comm.allgather(int(scanned_index.gid_lo)), dtype=np.int64)
    epoch_of, lengths = input_order_lengths(comm, [(p.plan.piece_gid, p.plan.piece_len) for p in epochs], gid_starts)
    figures = [(m, padded_batching_over_ranks(comm, lengths[epoch_of == e], m.packs.baseline_batch_size))
               for e, m in enumerate(merged)]
    if len(epochs) > 1:
        every = sum(merged[1:], merged[0])
        figures.append((every, padded_batching_over_ranks(comm, lengths, every.packs.baseline_batch_size)))
    return figures


@dataclass(frozen=True)
class _RunFacts:
    """What every output of one run reports alike (rank 0): what it records of its options and
    its specs, its inputs, corpus counts, throughput and timings; `opens_window`: whether each
    global shard opens a planning window (the manifest's `window_starts`); `digests`: the input
    blocks' digests (listed in a plan's manifest); `mixture`: a blend's per-source metrics."""
    record: RunRecord
    specs: Specs
    index: SequenceIndex
    corpus: Corpus
    whole_run: dict
    timings: dict[str, float]
    opens_window: np.ndarray | None
    digests: list[int] | None
    mixture: dict | None


def _outputs(facts: _RunFacts, figures: list[tuple[RankSummary, int]], epoch_shards: list[dict[int, ShardEntry]],
             ranks: list[dict], epochs: list[Planned]) -> tuple[dict, list, list, list[ShardEntry]]:
    """Rank 0: (metrics, reports, manifests, listed shards) of the run: one output, or with --epochs
    one per epoch, each in its folder, with OUT/_metrics.json of them all and _epochs.json
    listing them (last: every epoch is complete)."""
    specs = facts.specs
    if specs.order.epochs == 1:
        metrics, listed, manifest = _report(facts, figures[0], epoch_shards[0], ranks, buckets=epochs[0].buckets)
        return metrics, [(METRICS, metrics)], [(MANIFEST, manifest)], listed
    reports, manifests, listed = [], [], []
    for e in range(specs.order.epochs):
        epoch_metrics, in_epoch, manifest = _report(facts, figures[e], epoch_shards[e], [],
                                                    buckets=epochs[e].buckets, epoch=e)
        reports.append((f"{epoch_dir(e)}/{METRICS}", epoch_metrics))
        manifests.append((f"{epoch_dir(e)}/{MANIFEST}", manifest))
        listed += in_epoch
    summary, baseline = figures[-1]
    metrics = epochs_metrics(specs.report, summary, baseline, ranks, facts.corpus, [m for _, m in reports],
                             buckets=epochs[0].buckets)
    metrics["throughput"], metrics["timings"] = facts.whole_run, facts.timings
    if facts.mixture is not None:
        metrics["mixture"] = facts.mixture
    reports.insert(0, (METRICS, metrics))
    manifests.append((EPOCHS, epochs_index(specs.report, metrics, facts.timings)))
    return metrics, reports, manifests, listed


def _report(facts: _RunFacts, figures: tuple[RankSummary, int], shards: dict[int, ShardEntry], ranks: list[dict], *,
            buckets: np.ndarray | None, epoch: int | None = None) -> tuple[dict, list[ShardEntry], dict]:
    """Rank 0: the metrics, shards and manifest of one output: all of OUT, or the folder of one
    epoch (its manifest lists the shards relative to the folder, its `epoch` says which).
    `figures`: the summary of its plan and its baseline (`_plan_figures`); `shards`: its shards by
    global number."""
    record, specs, index, corpus, timings = facts.record, facts.specs, facts.index, facts.corpus, facts.timings
    mixture, digests, opens_window = facts.mixture, facts.digests, facts.opens_window
    summary, baseline = figures
    metrics = metrics_of(specs.report, summary, baseline, ranks, corpus, buckets=buckets,
                         groups=index.group_starts is not None)
    metrics["throughput"] = facts.whole_run
    metrics["timings"] = timings
    numbered = sorted(shards.items())
    listed_shards = [info for _, info in numbered]
    listed = listed_shards if epoch is None else [dataclasses.replace(i, path=i.path.split("/", 1)[1])
                                                  for i in listed_shards]
    manifest = record.manifest(index.files, listed, metrics["counts"], timings, index.fingerprints)
    if mixture is not None:  # --source: what each source gave, and the manifest's table of sources
        metrics["mixture"] = mixture
        manifest["sources"] = source_table(specs.order.mixture, index.files, index.fingerprints)
    if record.plan_only and digests is not None:  # materialize checks each block it decodes against them
        for f, entry in enumerate(manifest["inputs"]):
            entry["block_digests"] = [d for block, d in zip(index.blocks, digests) if block.file == f]
    if opens_window is not None:
        manifest["window_starts"] = [k for k, (n, _) in enumerate(numbered) if opens_window[n]]
    if epoch is not None:
        manifest["epoch"] = metrics["epoch"] = {"index": epoch, "of": specs.order.epochs,
                                                "seed": epoch_seed(specs.order.seed, epoch)}
    return metrics, listed_shards, manifest


def _scan(ctx: RunContext, index: SequenceIndex, specs: Specs, plan_only: bool = False) -> tuple[Scanned, Corpus]:
    """Decode and check this rank's blocks (equal bytes per rank); the corpus counts of all ranks.

    A plan (`plan_only`) needs of the tokens only each piece's loss tokens (materialize.py): an
    input whose kind knows lengths without decoding (`InputKind.scan_lengths`: Megatron, from its
    `.idx` alone, no `.bin` read) is scanned so; other blocks are decoded and checked, the
    per-sequence loss tokens counted when there is a labels column, and kept in memory only then
    (the pieces of cut sequences are counted in them). Under --too-long error, such an input's
    over-long sequence is refused from those lengths, before a token of it is decoded."""
    comm = ctx.comm
    block_bounds = split_blocks(index.blocks, comm.size)
    lo, hi = int(block_bounds[comm.rank]), int(block_bounds[comm.rank + 1])
    scan = specs.scan
    stage = ctx.counter("scan", hi - lo, total=int(block_bounds[-1]))
    cheap = index.kind.scan_lengths(index, lo, hi, None if not plan_only else stage, skip_empty=scan.skip_empty) if (
        plan_only or specs.lengths.too_long == TooLong.ERROR) else None
    if cheap is not None and not plan_only:
        check_too_long(comm, cheap, specs.lengths)
    if plan_only and cheap is not None:
        index = cheap
        source = TokenSource.of_index(index, None, 0, skip_empty=scan.skip_empty)
        scanned = Scanned(index, source, block_bounds, tokens_read=False)
    else:
        labels = index.labels_column is not None
        budget = 0 if plan_only and not labels else scan.memory_budget  # 0: no decoded block kept
        index, source = scan_blocks(index, range(lo, hi), budget, progress=stage, skip_empty=scan.skip_empty,
                                    pad_token_id=scan.pad_token_id,
                                    count_loss_tokens=scan.count_loss_tokens or (plan_only and labels),
                                    share_prefix=scan.share_prefix)
        if scan.share_prefix:
            index.shared = share_prefix_lengths(comm, index)
        scanned = Scanned(index, source, block_bounds)
    check_limits(comm, index, specs.lengths, specs.report.limits)
    check_too_long(comm, index, specs.lengths)
    skipped = comm.allreduce_sum(int(np.count_nonzero(index.lengths == 0))) if scan.skip_empty else 0
    corpus = Corpus(sequences=index.num_sequences, tokens=comm.allreduce_sum(int(index.lengths.sum())),
                    skipped_empty=skipped, blocks=len(index.blocks))
    return scanned, corpus


def _block_digests(comm: Comm, scanned: Scanned) -> list[int] | None:
    """The `block_digest` of every input block, in gid order, from every rank's scan; None when
    scan read lengths only (a plan of Megatron pairs)."""
    merged: dict[int, int] = {}
    for part in comm.allgather(scanned.source.digests):
        merged.update(part)
    if len(merged) != len(scanned.index.blocks):
        return None
    return [merged[b] for b in range(len(scanned.index.blocks))]


def _check_blocks_unchanged(out: Path, index: SequenceIndex, digests: list[int]) -> None:
    """`--resume` keeps shards an earlier run wrote from its blocks: each block must hold what it
    held then (a file rewritten with the same size, modification time and footer does not)."""
    store = on_store(out)
    recorded = out.recorded_blocks if store else read_block_digests(partial_dir(out))
    where = out.url(out.run_prefix.rstrip("/")) if store else partial_dir(out)
    if recorded is None or len(recorded) != len(digests):
        return  # nothing recorded to compare: the inputs' fingerprints were checked
    for b, (then, now) in enumerate(zip(recorded, digests)):
        if then != now:
            block = index.blocks[b]
            raise PackctlError(f"{index.files[block.file].path}: --resume refused: {describe_block(block)} holds other "
                               f"tokens than the interrupted run in {where} read (its size, modification "
                               f"time and footer are the same); delete that {'prefix' if store else 'directory'} and "
                               "run without --resume")


def _assign(comm: Comm, planned: Planned, scanned: Scanned, spec: WriteSpec,
            epoch_packs: list[int]) -> tuple[WriteJob, Transfer]:
    """Deal the writing out by tokens (pipeline/assign.py), move the plan to its writers, and choose
    how tokens reach them (--token-transfer). `epoch_packs`: this rank's packs of each epoch."""
    pack_epoch = np.repeat(np.arange(spec.epochs), epoch_packs) if spec.epochs > 1 else None
    assignment = assign(comm.allgather(units_of(planned.plan.window_bins, planned.pack_lens, spec.shard_rows,
                                                pack_epoch=pack_epoch)), comm.size)
    job = hand_over(comm, planned.plan, planned.pack_lens, planned.columns, assignment)
    amplification = read_amplification(comm, job.plan, scanned.index) if comm.size > 1 else 1.0
    return job, Transfer(read_own=choose_read_own(spec.token_transfer, amplification, spec.order, comm.size),
                         amplification=amplification)


def _shard_format(record: RunRecord, specs: Specs, index: SequenceIndex) -> ShardFormat:
    """How shards are written; their `packctl` metadata records the options themselves."""
    mixture = specs.order.mixture
    return ShardFormat(metadata=record.shard_metadata(index.files), pad_token_id=specs.write.pad_token_id,
                       budget=specs.write.memory_budget, carried=specs.write.carried, plan_only=record.plan_only,
                       source_starts=None if mixture is None else mixture.gid_starts,
                       share_prefix=specs.write.share_prefix)


@dataclass(frozen=True)
class _Decided:
    """What preflight decides before a token is read, every option taken: each stage's spec
    (`specs`, a blend's draw included), what the outputs record of the options (`record`),
    INPUT's index, the run fingerprint and the shards `--resume` keeps; or only `note`, when OUT
    already holds this run's output. Past preflight a run reads its options from here, never from
    its PackConfig. `inputs`: INPUT as given, for messages."""

    note: str | None = None
    specs: Specs | None = None
    record: RunRecord | None = None
    index: SequenceIndex | None = None
    fingerprint: dict | None = None
    done: dict | None = None
    inputs: tuple[str, ...] = ()
    overwrite: bool = False


def _preflight(config: PackConfig, out: Path, lock: OutputLock, guard: SignalGuard, faults: Faults | None
               ) -> _Decided:
    """Everything decided from options and Parquet footers, before any token is read: resolves
    INPUT (`packctl.source.resolve`; the run records it normalized), takes the output lock,
    finishes or undoes a commit a crash interrupted (output/commit.py `recover`), and decides what
    to do with what earlier runs left (output/resume.py)."""
    reached = (faults or Faults()).reached
    config, index, source_files, resolution = _indexed(with_blend(config), out)
    record = RunRecord.of(config, index.labels_column, [f.path for f in index.files])
    fingerprint = record.fingerprint(index.files, index.fingerprints)
    decided = _Decided(specs=with_mixture(config.specs(index.labels_column), config, index, source_files),
                       record=record, index=index, fingerprint=fingerprint, inputs=tuple(config.inputs),
                       overwrite=config.overwrite)
    if on_store(out):
        with guard.deferred(stop_after=True):  # finishing an interrupted commit: a signal waits for it
            found = out.settle(fingerprint, resume=config.resume, overwrite=config.overwrite)
        return _found(decided, found, out)
    check_output_location(out, inputs=[p for f in index.files for p in index.kind.partners(f.path)],
                          input_dirs=[str(i) for i in config.inputs] or resolution.specs)
    lock.acquire()
    reached("lock:taken")
    with guard.deferred(stop_after=True):  # finishing an interrupted commit: a signal waits for it
        protocol.recover(out, reached)
    found = inspect_output(out, fingerprint, resume=config.resume, overwrite=config.overwrite)
    if found.publish:
        with guard.deferred():
            protocol.publish(out, overwrite=config.overwrite, reached=reached)
        return _Decided(note=f"{out}: already complete: the interrupted run had written all of it; it is now in place")
    return _found(decided, found, out)


def _indexed(config: PackConfig, out: Path | StoreOutput
             ) -> tuple[PackConfig, SequenceIndex, list[int] | None, Resolution]:
    """The options checked and INPUT resolved and indexed (footers read, carried columns checked):
    the config with INPUT as the run records it, the index, where each --source's files start
    (None without a blend), and the resolution."""
    config.validate()
    if not on_store(out):
        check_output_location(out)
    options = options_of(dataclasses.asdict(config))
    source_files = None
    if config.sources:  # a blend: each source resolved on its own, its files after those of the sources before
        entries = config.source_entries()
        _refuse_output_in_reach(out, [normalize_spec(p) for e in entries for p in e.paths])
        resolution, source_files = resolve_sources(entries, split=config.split, options=options)
    else:
        specs = [normalize_spec(s) for s in config.inputs]
        _refuse_output_in_reach(out, specs)
        resolution = resolve(specs, split=config.split, options=options)
        if config.resume:
            resolution = _spelled_as_earlier_run(out, resolution)
        config = dataclasses.replace(config, inputs=resolution.specs)
    carried = config.carried()
    check_options(resolution, tokens_column=config.tokens_column, labels_column=config.labels_column,
                  carried=carried)
    index = index_inputs(resolution, options, carried)
    if carried.group is not None:
        index.group_starts = read_group_starts(index, carried.group)
    return config, index, source_files, resolution


def _found(decided: _Decided, found, out) -> _Decided:
    """`_preflight`'s answer once what earlier runs left is decided (`found`, an Outcome)."""
    if found.complete:
        return _Decided(note=f"{out}: already complete with these inputs and options; nothing to do")
    return dataclasses.replace(decided, done=found.done)


def _refuse_output_in_reach(out: Path | StoreOutput, specs: list[str]) -> None:
    """An OUT that an INPUT pattern matches would be read as input by the next run of the same
    command (and its partial directory by `--resume`): as for an OUT inside an input directory."""
    if on_store(out):
        out.check_location(specs)
        return
    for shard in (out / DATA_DIR / "train-00000.parquet", out / epoch_dir(0) / DATA_DIR / "train-00000.parquet",
                  partial_dir(out) / DATA_DIR / "train-00000.parquet"):
        spec = pattern_reaching(specs, str(shard))
        if spec is not None:
            raise PackctlError(f"{out}: INPUT {spec} matches its shards ({shard}), so they would be read as input by "
                               "the next run; choose an -o that INPUT does not match, or narrow INPUT")


def _spelled_as_earlier_run(out: Path, resolution: Resolution) -> Resolution:
    """The same files spelled another way (`data` then `/abs/data`) are the same input: `--resume`
    continues with the INPUT and paths the interrupted run recorded (its run.json; for a run that
    completed, OUT's manifest), so the shards it writes carry the same metadata as those it keeps,
    and a completed OUT is recognised. Other inputs are left as they are (and refused by the
    fingerprint check)."""
    if on_store(out):
        records = out.earlier_records()
    else:
        records = [_json_file(partial_dir(out) / RUN_FILE, "fingerprint"), _json_file(out / MANIFEST)]
    for earlier in records:
        try:
            specs = [str(s) for s in earlier["config"]["inputs"]]
            paths = [str(entry["path"]) for entry in earlier["inputs"]]
        except (KeyError, TypeError):
            continue
        return respell(resolution, specs, paths)
    return resolution


def _json_file(path: Path, key: str | None = None) -> Any:
    """The JSON of a file (its `key`); None when it cannot be read."""
    try:
        value = json.loads(path.read_text())
        return value[key] if key else value
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_fingerprint(config: PackConfig, index: SequenceIndex) -> dict[str, Any]:
    """What must not change between an interrupted run of `config` over `index` and its
    `--resume` (pipeline/manifest.py `RunRecord.fingerprint`)."""
    record = RunRecord.of(config, index.labels_column, [f.path for f in index.files])
    return record.fingerprint(index.files, index.fingerprints)

"""`packctl.tokenize_corpus(config)`: raw text and chat records -> tokenized Parquet that `packctl
pack` reads as it is, with the guarantees of `pack` (atomic commit, `--resume`, the same bytes for
any number of workers or MPI ranks).

    index   every raw file counted and fingerprinted once (rawfiles.py)
    units   the records cut into shards of --shard-records, file by file, numbered in file order:
                a.jsonl (25,000 records), b.jsonl (5,000), --shard-records 10,000
                -> part-00000 a[0:10000]  part-00001 a[10000:20000]  part-00002 a[20000:25000]
                   part-00003 b[0:5000]
            so a shard's bytes depend on its records only, never on who tokenized it
    work    ranks take runs of shards (balanced by records); each rank's --workers processes
            tokenize whole shards (encode.py), the rank journals them as they finish
    commit  rank 0 writes _metrics.json, then _manifest.json (kind "tokenized"), then the
            directory becomes OUT (output/commit.py)

OUT/data/part-NNNNN.parquet columns (docs/tokenize.md):

    input_ids      list<int32>   the token ids of one row
    labels         list<int32>   the token where it is trained on, -100 where it is not
    record_id      int64         the input record it came from: files sorted by path, row by row
    prompt_length  int32         tokens of the prompt (prompt-completion and preference rows)
    chosen         bool          preference rows: the chosen answer (True) or the rejected one
    (--group-column / --keep-column values, as the input has them)

A preference record becomes two adjacent rows with one `record_id` (`pack --group-column
record_id` keeps them in one pack); every other record becomes one row or is dropped
(`--on-bad-row drop`), counted by reason in the manifest.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from packctl.contract.manifest import DATA_DIR, MANIFEST, METRICS, ShardEntry
from packctl.errors import PackctlError
from packctl.mpi.comm import Comm, broadcast_outcome, get_comm
from packctl.output import commit as protocol
from packctl.output.lock import OutputLock
from packctl.output.outdir import Faults, OutputDir
from packctl.output.paths import check_output_location
from packctl.output.resume import inspect_output
from packctl.contract.manifest import TOKENIZED
from packctl.tokenize.options import CHOSEN, LABELS, PROMPT_LENGTH, RECORD_ID, TOKENS, TokenizeConfig
from packctl.tokenize.rawfiles import RawFile, RawIndex, TextUnit, find_inputs, index_file, read_records
from packctl.version import __version__

if TYPE_CHECKING:
    # Imported where used: a worker process imports this module to tokenize its shards, and
    # packctl.pipeline brings in the stages of pack (numba), 0.3 s more for every worker started.
    from packctl.runtime import Progress, SignalGuard

TOKENIZED_KIND = TOKENIZED
TOKENIZED_FORMAT_VERSION = 1
# Parquet metadata key of a tokenized shard: what made it (tokenizer, template, mask rule) and the
# shard's own counts. Not pack's `packctl` key: a tokenized corpus is input to pack, not an output.
SHARD_METADATA_KEY = b"packctl.tokenized"
ROW_GROUP_ROWS = 1024  # pack decodes a row group at a time: small groups keep its blocks small
DROPPED_EXAMPLES = 5  # per shard, the first rows dropped, with where and why


@dataclass
class TokenizeResult:
    output: Path
    counts: dict[str, Any]
    metrics: dict[str, Any]
    shards: list[ShardEntry] = field(default_factory=list)
    note: str | None = None


@dataclass(frozen=True)
class Unit:
    """One output shard: records [first, first + count) of file `file`; `record_id` of the first."""

    shard: int
    file: int
    first: int
    count: int
    record_id: int

    @property
    def name(self) -> str:
        return f"{DATA_DIR}/part-{self.shard:05d}.parquet"


def units_of(index: RawIndex, shard_records: int) -> list[Unit]:
    units: list[Unit] = []
    for f, raw in enumerate(index.files):
        for first in range(0, raw.records, shard_records):
            units.append(Unit(len(units), f, first, min(shard_records, raw.records - first),
                              index.record_offsets[f] + first))
    return units


def tokenize_corpus(config: TokenizeConfig, *, progress: Progress | None = None, comm: Comm | None = None,
                    faults: Faults | None = None) -> TokenizeResult:
    """Tokenize `config.inputs` into `config.output` (module docstring).

    >>> tokenize_corpus(TokenizeConfig(inputs=["chat.jsonl"], output="tok", tokenizer="tok-dir"))  # doctest: +SKIP
    """
    from packctl.runtime import Progress, SignalGuard, run_guarded

    comm = comm or get_comm()
    progress = progress if (progress is not None and comm.rank == 0) else Progress()
    out = Path(config.output)
    lock = OutputLock(out)
    guard = SignalGuard()
    state: dict[str, OutputDir | None] = {"output": None}
    return run_guarded(comm, progress, out, lock, guard,
                       lambda: _tokenize(config, comm, progress, out, lock, guard, state, faults),
                       lambda: state["output"])


@dataclass
class _Prepared:
    index: RawIndex
    spec: Any  # encode.TokenizeSpec, its format resolved from the columns
    fingerprint: dict
    tokenizer_info: dict
    spec_info: dict
    done: dict | None
    note: str | None = None


def _tokenize(config: TokenizeConfig, comm: Comm, progress: Progress, out: Path, lock: OutputLock,
              guard: SignalGuard, state: dict, faults: Faults | None) -> TokenizeResult:
    from packctl.runtime import timed

    started = time.perf_counter()
    timings: dict[str, float] = {}
    with timed(timings, "index"):
        prepared = broadcast_outcome(comm, lambda: _preflight(config, out, lock, guard, faults, progress))
    if prepared.note is not None:
        if comm.rank != 0:
            return TokenizeResult(out, {}, {}, note=prepared.note)
        metrics = json.loads((out / METRICS).read_text())
        return TokenizeResult(out, metrics.get("counts", {}), metrics, protocol.listed_shards(out) or [],
                              note=prepared.note)
    units = units_of(prepared.index, config.shard_records)
    mine = _my_units(units, comm)

    created: dict[str, OutputDir] = {}

    def create() -> str:
        created["dir"] = OutputDir.create(out, overwrite=config.overwrite, fingerprint=prepared.fingerprint,
                                          done=prepared.done, faults=faults)
        return str(created["dir"].tmp)

    tmp = broadcast_outcome(comm, create)
    output = state["output"] = created.get("dir") or OutputDir(out, Path(tmp), rank=comm.rank,
                                                               done=prepared.done, faults=faults)
    done = prepared.done or {}
    todo = [u for u in mine if u.name not in done]
    records_total = comm.allreduce_sum(sum(u.count for u in mine))
    advance = progress.stage("tokenize", records_total)
    for u in mine:
        if u.name in done:
            advance(u.count)
    with timed(timings, "tokenize"):
        written = _run_units(config, prepared, todo, output, advance, comm.size)
    kept = {u.name: _shard_summary(output.tmp / u.name, done[u.name]) for u in mine if u.name in done}
    summaries = comm.gather({**written, **kept})
    timings["total"] = time.perf_counter() - started
    if comm.rank != 0:
        comm.barrier()
        return TokenizeResult(out, {}, {})
    shards: dict[str, tuple[ShardEntry, dict]] = {}
    for part in summaries:
        shards.update(part)
    listed = [shards[u.name][0] for u in units]
    counts = _counts(prepared.index, [shards[u.name][1] for u in units])
    elapsed = timings["tokenize"]
    fresh = sum(written_info[1]["tokens"] for written_info in written.values())
    metrics = {"counts": counts, "timings": timings,
               "throughput": {"tokens_per_s": (fresh / elapsed) if elapsed > 0 else None,
                              "records_per_s": (sum(s[1]["records"] for s in written.values()) / elapsed
                                                if elapsed > 0 else None),
                              "workers": min(_workers(config, comm.size), max(1, len(todo))), "ranks": comm.size,
                              "note": "this rank's work in this run (shards kept by --resume not counted)"}}
    manifest = _manifest(config, prepared, listed, counts)
    with guard.deferred():
        output.commit(reports=[(METRICS, metrics)], manifests=[(MANIFEST, manifest)], shards=listed,
                      overwrite=config.overwrite)
    comm.barrier()
    return TokenizeResult(out, counts, metrics, listed)


def _preflight(config: TokenizeConfig, out: Path, lock: OutputLock, guard: SignalGuard, faults: Faults | None,
               progress: Progress) -> _Prepared:
    """Options, tokenizer and inputs checked, every file counted and fingerprinted, the lock
    taken, an interrupted commit finished, and what earlier runs left decided: all before a
    record is tokenized."""
    from packctl.tokenize.options import build_spec
    from packctl.tokenize.tokenizer import LocalTokenizer

    reached = (faults or Faults()).reached
    config.validate()
    check_output_location(out)
    tokenizer = LocalTokenizer.load(config.tokenizer)
    paths = find_inputs(list(config.inputs))
    check_output_location(out, inputs=paths, input_dirs=[str(i) for i in config.inputs])
    unit = TextUnit(config.text_unit)
    advance = progress.stage("index", len(paths))
    files = []
    for path in paths:
        files.append(index_file(path, stride=config.shard_records, text_unit=unit))
        advance(1)
    index = RawIndex(files)
    if index.records == 0:
        raise PackctlError(f"{', '.join(config.inputs)}: no record to tokenize (the files are empty)")
    spec = build_spec(config, files)
    tokenizer_info, spec_info = tokenizer.describe(), spec.describe()
    fingerprint = {"kind": TOKENIZED_KIND, "format_version": TOKENIZED_FORMAT_VERSION, "packctl_version": __version__,
                   "config": config.content(), "tokenizer": tokenizer_info,
                   "inputs": [f.fingerprint() for f in files]}
    lock.acquire()
    reached("lock:taken")
    with guard.deferred(stop_after=True):
        protocol.recover(out, reached)
    found = inspect_output(out, fingerprint, resume=config.resume, overwrite=config.overwrite)
    if found.publish:
        with guard.deferred():
            protocol.publish(out, overwrite=config.overwrite, reached=reached)
        return _Prepared(index, spec, fingerprint, tokenizer_info, spec_info, None,
                         note=f"{out}: already complete: the interrupted run had written all of it; it is now in place")
    if found.complete:
        return _Prepared(index, spec, fingerprint, tokenizer_info, spec_info, None,
                         note=f"{out}: already complete: it holds the output of these options and inputs")
    return _Prepared(index, spec, fingerprint, tokenizer_info, spec_info, found.done)


def _my_units(units: list[Unit], comm: Comm) -> list[Unit]:
    """This rank's run of shards: contiguous, cut where the records before reach r/size of all."""
    if comm.size == 1:
        return units
    counts = np.array([u.count for u in units], dtype=np.int64)
    ends = np.cumsum(counts)
    total = int(ends[-1]) if len(ends) else 0
    cuts = [int(np.searchsorted(ends, total * r / comm.size, side="left")) for r in range(comm.size + 1)]
    cuts[0], cuts[-1] = 0, len(units)
    return units[cuts[comm.rank]:cuts[comm.rank + 1]]


def _workers(config: TokenizeConfig, ranks: int) -> int:
    if config.workers:
        return config.workers
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, min(ranks, cores)))


def _run_units(config: TokenizeConfig, prepared: _Prepared, units: list[Unit], output: OutputDir,
               advance: Callable[[int], None], ranks: int) -> dict[str, tuple[ShardEntry, dict]]:
    """Tokenize `units` (in this process, or in worker processes), each staged and journaled as
    it finishes. Returns shard name -> (its entry, its summary)."""
    workers = min(_workers(config, ranks), max(1, len(units)))
    written: dict[str, tuple[ShardEntry, dict]] = {}

    def finish(unit: Unit, result: "ShardBytes") -> None:
        staged = output.stage_bytes(unit.name, result.data, rows=result.summary["rows"],
                                    tokens=result.summary["tokens"])
        written[unit.name] = (output.commit_shard(staged), result.summary)
        advance(unit.count)

    job = _Job(config, prepared.spec, prepared.index.files, prepared.tokenizer_info, prepared.spec_info)
    if workers == 1:
        for unit in units:
            finish(unit, job.run(unit))
        return written
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init, initargs=(job,)) as pool:
        pending: dict[Future, Unit] = {}
        queue = list(units)
        try:
            while queue or pending:
                while queue and len(pending) < 2 * workers:
                    unit = queue.pop(0)
                    pending[pool.submit(_worker_run, unit)] = unit
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=lambda f: pending[f].shard):
                    finish(pending.pop(future), future.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return written


@dataclass
class ShardBytes:
    data: Any  # an encoded Parquet file (bytes-like)
    summary: dict


class _Job:
    """What a worker needs to tokenize any shard of the run; the tokenizer is loaded once per
    process, on first use."""

    def __init__(self, config: TokenizeConfig, spec, files: list[RawFile], tokenizer_info: dict, spec_info: dict):
        self.config, self.spec, self.files = config, spec, files
        self.tokenizer_info, self.spec_info = tokenizer_info, spec_info
        self._tokenizer = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    def _load(self) -> None:
        from packctl.tokenize.tokenizer import LocalTokenizer

        self._tokenizer = LocalTokenizer.load(self.config.tokenizer)
        if self._tokenizer.describe() != self.tokenizer_info:
            raise PackctlError(f"{self.config.tokenizer}: the tokenizer changed during the run; run again")

    def run(self, unit: Unit) -> ShardBytes:
        if self._tokenizer is None:
            self._load()
        return tokenize_unit(unit, self.files[unit.file], self.spec, self._tokenizer, self.config,
                             self._metadata())

    def _metadata(self) -> dict:
        return {"kind": TOKENIZED_KIND, "packctl_version": __version__, "tokenizer": self.tokenizer_info,
                "tokenize": self.spec_info}


_WORKER_JOB: _Job | None = None


def _worker_init(job: _Job) -> None:
    global _WORKER_JOB
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the run; workers end with the pool
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one process a core: no threads inside
    _WORKER_JOB = job


def _worker_run(unit: Unit) -> ShardBytes:
    assert _WORKER_JOB is not None
    return _WORKER_JOB.run(unit)


def tokenize_unit(unit: Unit, raw: RawFile, spec, tokenizer, config: TokenizeConfig, metadata: dict) -> ShardBytes:
    """One shard: its records read, tokenized (encode.py), and encoded as Parquet with the run's
    metadata and the shard's own counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packctl.contract.arrow import arrow_array
    from packctl.tokenize.encode import RowError, tokenize_records
    from packctl.tokenize.options import is_preference, writes_prompt_length

    records = read_records(raw, unit.first, unit.count)
    try:
        batch = tokenize_records([r.fields for r in records], spec, tokenizer)
    except RowError as exc:
        where = records[exc.record]
        raise PackctlError(f"{raw.describe(where.row, where.line)} field '{exc.field}': {exc.reason}; fix the row, "
                           "or pass --on-bad-row drop to count and skip such rows") from None
    rows = len(batch.offsets) - 1
    record_ids = unit.record_id + batch.record.astype(np.int64)
    # Through the buffers (contract/arrow.py): pa.array(ndarray) imports pandas, 0.25 s a process.
    offsets = arrow_array(batch.offsets, pa.int32() if batch.offsets[-1] < 2**31 else pa.int64())
    list_of = pa.ListArray if offsets.type == pa.int32() else pa.LargeListArray
    columns = {
        TOKENS: list_of.from_arrays(offsets, arrow_array(batch.input_ids, pa.int32())),
        LABELS: list_of.from_arrays(offsets, arrow_array(batch.labels, pa.int32())),
        RECORD_ID: arrow_array(record_ids, pa.int64()),
    }
    if writes_prompt_length(spec):
        columns[PROMPT_LENGTH] = arrow_array(batch.prompt_length, pa.int32())
    if is_preference(spec):
        chosen = np.packbits(batch.branch == 0, bitorder="little")  # Arrow's bit order
        columns[CHOSEN] = pa.Array.from_buffers(pa.bool_(), rows, [None, pa.py_buffer(chosen)])
    for name in ([config.group_column] if config.group_column else []) + list(config.keep_columns):
        values = [records[int(k)].fields.get(name) for k in batch.record]
        if name == config.group_column:
            missing = next((int(k) for k, v in zip(batch.record, values) if v is None), None)
            if missing is not None:
                where = records[missing]
                raise PackctlError(f"{raw.describe(where.row, where.line)} field '{name}': no group value; give every "
                                   "row of --group-column a value")
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError) as exc:
            raise PackctlError(f"{raw.path} field '{name}': values of mixed types cannot be one column ({exc}); "
                               "give the field one type in every row") from None
    dropped = [(int(unit.record_id + k), raw.describe(records[k].row, records[k].line), fld, reason)
               for k, fld, reason in batch.dropped]
    by_reason: dict[str, int] = {}
    for *_, reason in dropped:
        by_reason[reason] = by_reason.get(reason, 0) + 1
    tokens = int(batch.offsets[-1])
    loss = int(np.count_nonzero(batch.labels != -100))
    summary = {"records": unit.count, "rows": rows, "tokens": tokens, "loss_tokens": loss,
               "dropped": len(dropped), "dropped_by_reason": by_reason,
               "dropped_examples": [{RECORD_ID: r, "where": w, "field": f, "reason": why}
                                    for r, w, f, why in dropped[:DROPPED_EXAMPLES]]}
    table = pa.table(columns)
    table = table.replace_schema_metadata({SHARD_METADATA_KEY: json.dumps({**metadata, "shard": summary},
                                                                          sort_keys=True).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS, compression="zstd", compression_level=3,
                   use_dictionary=False, write_statistics=False)
    return ShardBytes(sink.getvalue(), summary)


def _shard_summary(path: Path, entry: ShardEntry) -> tuple[ShardEntry, dict]:
    """A kept shard's entry and its counts, read back from its metadata (--resume)."""
    import pyarrow.parquet as pq

    metadata = pq.read_metadata(path).metadata or {}
    return entry, json.loads(metadata[SHARD_METADATA_KEY])["shard"]


def _counts(index: RawIndex, summaries: list[dict]) -> dict[str, Any]:
    by_reason: dict[str, int] = {}
    for s in summaries:
        for reason, n in s["dropped_by_reason"].items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    tokens = sum(s["tokens"] for s in summaries)
    loss = sum(s["loss_tokens"] for s in summaries)
    return {"files": len(index.files), "records": index.records, "rows": sum(s["rows"] for s in summaries),
            "tokens": tokens, "loss_tokens": loss, "masked_fraction": (1 - loss / tokens) if tokens else 0.0,
            "dropped": sum(s["dropped"] for s in summaries), "dropped_by_reason": dict(sorted(by_reason.items())),
            "dropped_examples": [e for s in summaries for e in s["dropped_examples"]][:20]}


def _manifest(config: TokenizeConfig, prepared: _Prepared, shards: list[ShardEntry], counts: dict) -> dict:
    return {"kind": TOKENIZED_KIND, "format_version": TOKENIZED_FORMAT_VERSION, "packctl_version": __version__,
            "config": config.content(), "tokenizer": prepared.tokenizer_info, "tokenize": prepared.spec_info,
            "inputs": [f.fingerprint() for f in prepared.index.files],
            "shards": [dataclasses.asdict(s) for s in shards], "counts": counts}

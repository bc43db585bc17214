"""What a run of `pack` or `materialize` returns, and the output directory both open: the
scaffolding the two share (pipeline/run.py, pipeline/from_plan.py).

    out = open_partial_output(comm, OUT, overwrite, fingerprint, done=None, faults=None)   every rank
    ...                                                    shards written into out.tmp, committed
    PackResult(output=OUT, counts=..., metrics=..., timings=..., shards=...)
    already_complete(OUT, note)      a run that found OUT written by the same options
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packctl.contract.manifest import METRICS, ShardEntry
from packctl.mpi.comm import Comm, broadcast_outcome
from packctl.output import commit as protocol
from packctl.output.outdir import Faults, OutputDir
from packctl.output.paths import on_store

if TYPE_CHECKING:
    from packctl.output.stored import StoreOutput

__all__ = ["PackResult", "already_complete", "open_partial_output"]


@dataclass
class PackResult:
    """What a pack run did: where it wrote, the counts of the manifest, metrics and timings.
    Under MPI, rank 0 holds the whole result; other ranks get their own timings only."""

    output: Path
    counts: dict[str, int]
    metrics: dict[str, Any]
    timings: dict[str, float]
    shards: list[ShardEntry] = field(default_factory=list)
    # "OUT: already complete ...": a run that found its output written (counts, metrics, timings
    # and shards are then OUT's); the CLI prints it on stderr
    note: str | None = None
    plan_only: bool = False  # --plan-only: the packs were planned, no token was moved


def already_complete(out: Path | StoreOutput, note: str) -> PackResult:
    """The result of a run whose output OUT already holds: OUT's counts, metrics and shards."""
    if on_store(out):
        metrics, shards = out.committed_report()
    else:
        metrics = json.loads((out / METRICS).read_text())
        shards = protocol.listed_shards(out) or []
    return PackResult(output=out, counts=metrics.get("counts", {}), metrics=metrics,
                      timings=metrics.get("timings", {}), shards=shards, note=note)


def open_partial_output(comm: Comm, out: Path, overwrite: bool, fingerprint: dict, done: dict | None,
                 faults: Faults | None) -> OutputDir:
    """Rank 0 creates (or, resuming, cleans) the partial output directory; every rank writes its
    shards into it, skipping those in `done`."""
    if on_store(out):  # one process writes a store output (refused under MPI before)
        from packctl.output.stored import StoreOutputDir

        return StoreOutputDir.create(out, fingerprint=fingerprint, done=done, faults=faults)
    created: dict[str, OutputDir] = {}

    def create() -> str:
        created["dir"] = OutputDir.create(out, overwrite=overwrite, fingerprint=fingerprint, done=done, faults=faults)
        return str(created["dir"].tmp)

    tmp = broadcast_outcome(comm, create)
    return created["dir"] if "dir" in created else OutputDir(out, Path(tmp), rank=comm.rank, done=done, faults=faults)

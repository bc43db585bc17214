"""How a run behaves as a process: progress, signals, failure cleanup, timings, memory.

    with SignalGuard().installed():     SIGINT/SIGTERM raise `Interrupted` in the main thread
        ...                             -> `after_failure` turns it into RunInterrupted (exit 130/143)
    with timed(timings, "scan"): ...    seconds per stage, for metrics.json
    RunContext(comm, progress)          what every stage of pack and materialize takes
"""
from __future__ import annotations

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

from packctl.errors import PackctlError


class Progress:
    """Receives stage progress; the default shows nothing (the CLI passes a rich display).
    `close(stopped=True)`: the run stopped (a signal, an error) in its last stage, which did not
    end; a display shows it where it stopped, not complete."""

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        return lambda n: None

    def close(self, stopped: bool = False) -> None:
        pass


def job_stage(progress: Progress, name: str, own: int, total: int) -> Callable[[int], None]:
    """A stage's progress for the whole job: `total` is the work of every rank (the job's
    blocks, sequences or packs), and this rank's `own` share advances it in proportion, as the
    ranks share a stage's work evenly (scan by bytes, plan by sequences, materialize by tokens).
    Only rank 0 draws; one process is its own job (own == total). A rank with no share of the
    stage (more ranks than planning windows) has its part done at once: its bar is full while
    the other ranks finish theirs, and the next stage starts when they have.

        4 ranks, rank 0 writes 6,400 of 25,600 packs: its 3,200th pack shows 12,800/25,600
    """
    advance = progress.stage(name, total)
    if own == total:
        return advance
    if own == 0:
        advance(total)
        return lambda n: None
    scale = total / own
    counts = [0, 0]  # this rank's work done, the job's work shown

    def step(n: int) -> None:
        counts[0] += n
        shown = min(total, round(counts[0] * scale))
        if shown > counts[1]:
            advance(shown - counts[1])
            counts[1] = shown
    return step


class RunInterrupted(PackctlError):
    """SIGINT or SIGTERM stopped the run; exit code 128 + the signal number (130, 143)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class Interrupted(BaseException):
    """Raised in the main thread by the signal handler (a BaseException, like KeyboardInterrupt,
    so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class SignalGuard:
    """SIGINT and SIGTERM stop the run by raising in the main thread; writer threads finish the
    shard they are writing (journaled), the others are not started. During the final commit a
    signal is deferred, and the run completes; while a run finishes an earlier run's interrupted
    commit (before it packs), a signal waits for that, then stops the run.

    The exception a signal raises can be lost: raised while a C extension runs Python code whose
    errors it cannot pass on (pyarrow importing pandas on first use: "Exception ignored in ..."),
    it never reaches the run. So the signal is also remembered, and `deferred()` (every run passes
    it before its commit) raises it again: a run that got SIGTERM never completes."""

    def __init__(self) -> None:
        self._defer = False
        self._stopping = False
        self._waiting: int | None = None  # a signal that came while deferred
        self._raised: int | None = None  # the signal whose Interrupted was raised

    def _handle(self, signum, frame) -> None:
        if self._stopping:
            return
        if self._defer:
            self._waiting = signum
            return
        self._stopping = True
        self._raised = signum
        raise Interrupted(signum)

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
    def deferred(self, *, stop_after: bool = False) -> Iterator[None]:
        """A signal waits for the block; with `stop_after` it then stops the run. A signal whose
        Interrupted was lost on its way (class docstring) stops the run here, before the block."""
        if self._raised is not None:
            raise Interrupted(self._raised)
        self._defer = True
        try:
            yield
        finally:
            self._defer = False
        if stop_after and self._waiting is not None and not self._stopping:
            self._stopping = True
            raise Interrupted(self._waiting)


def after_failure(comm, output, exc: BaseException) -> BaseException:
    """Clean up after a failed or interrupted run and say what happened to the work done.

    A single process removes its partial directory unless it holds finished shards or is
    complete; those are kept for `--resume` (under MPI other ranks may still be writing: the
    directory is always kept)."""
    kept, complete = 0, False
    if output is not None and comm.rank == 0:
        kept, complete = output.finished_shards(), output.is_complete()
        if comm.size == 1 and kept == 0 and not complete:
            output.abort()
    where = output.where if output is not None else None
    if complete:
        resume_hint = (f"the complete output is kept in {where}: rerun the same command with --resume to put it "
                       "in place")
    elif kept:
        resume_hint = (f"{kept} finished shard(s) are kept in {where}: rerun the same command with --resume to "
                       "continue")
    else:
        resume_hint = ""
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        message = f"interrupted by {name}; " + (resume_hint or "no shard was finished: run the command again")
        return RunInterrupted(message, signum)
    if isinstance(exc, PackctlError) and resume_hint:
        exc.args = (f"{exc}; {resume_hint}",)
    return exc


def run_guarded(comm, progress: Progress, out, lock, guard: SignalGuard, body: Callable[[], Any],
                output: Callable[[], Any], on_exit: Callable[[], None] | None = None) -> Any:
    """The frame every command that writes an output runs in (pack, materialize, tokenize):
    `body()` with SIGINT/SIGTERM raising in it; on any failure the progress bars stop where the
    run stopped, `after_failure` decides what is kept of `output()` (the run's OutputDir, or
    None before it opened one) and words the error, and the directories above OUT the run
    created are removed again; always the lock is released (and `on_exit` run).

        return run_guarded(comm, progress, out, lock, guard, lambda: _pack(...), lambda: run.output)
    """
    from packctl.output.paths import missing_parents, remove_empty

    made = missing_parents(out) if isinstance(out, Path) else []  # the directories above OUT this run creates
    failed = False
    try:
        with guard.installed():
            return body()
    except BaseException as exc:
        failed = True
        progress.close(stopped=True)  # before any message: the bars stop where the run stopped
        failure = after_failure(comm, output(), exc)
        if failure is exc:
            raise
        raise failure from None
    finally:
        if on_exit is not None:
            on_exit()
        lock.release()
        progress.close()
        if failed:
            remove_empty(made)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def in_background(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
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
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0  # a stage run once per epoch adds up


@dataclass
class RunContext:
    """What every stage of a run (`pack`, `materialize`) takes beside its spec and its input: the
    communicator (one rank without MPI), the progress display (rank 0 draws; other ranks get a
    silent one), the run's timings, to which each stage adds its own, and the simulated faults of
    tests. A stage reads as

        with ctx.timed("plan"):
            planned = plan_stage(ctx, ordered, specs)      # advancing ctx.counter("plan", n)
    """

    comm: Any
    progress: Progress = field(default_factory=Progress)
    faults: Any = None  # output/outdir.py `Faults`, or None
    timings: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def timed(self, name: str):
        """Seconds spent in stage `name`, added to `timings` (a stage run once per epoch adds up)."""
        return timed(self.timings, name)

    def counter(self, name: str, own: int, total: int | None = None) -> Callable[[int], None]:
        """The progress callback of this rank's `own` units of stage `name` (`job_stage`), of
        `total` over every rank; without `total` every rank's `own` is added up (a collective)."""
        return job_stage(self.progress, name, own, self.comm.allreduce_sum(own) if total is None else total)

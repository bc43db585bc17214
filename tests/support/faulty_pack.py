"""`packctl pack` (or `packctl materialize`, `packctl tokenize`) as a user runs it, with a failure at a chosen point
(tests of crashes and resume).

    python tests/support/faulty_pack.py --kill-at commit:manifest-written pack CORPUS -o OUT ...   # also under mpiexec
    python tests/support/faulty_pack.py --kill-at shard:renamed --kill-count 3 --kill-rank 1 pack ...
    python tests/support/faulty_pack.py --kill-after 2[:SIGTERM] pack CORPUS -o OUT ...
    python tests/support/faulty_pack.py --fail-write-after 0 pack CORPUS -o OUT ...

The options become a `packctl.output.outdir.Faults` handed to `packctl.pipeline.pack`; the rest of the
command line goes to the CLI unchanged, so exit codes and messages are the real ones. The steps a
run can be stopped at are named in packctl/output/commit.py (`STEPS`).

`run_forked(argv, faults)` (or `fork_pack`, not waited for) does the same in a child process
forked from the caller, whose imports and compiled kernels it shares: a real process killed at a
real step, without the start-up of a new interpreter (the crash tests run a hundred of them).
A `--kill-signal SIGSTOP` (Faults(kill_signal=signal.SIGSTOP)) freezes the run there instead:
`Forked.stopped()` waits for that, SIGCONT lets it go on.
"""
from __future__ import annotations

import functools
import io
import os
import signal
import sys
import tempfile
import time


def faults_of(argv: list[str]):
    """(Faults, the rest of argv) from the leading options of the module docstring."""
    from packctl.output.outdir import Faults

    options: dict = {}
    kill_after = None
    while argv and (argv[0].startswith("--kill") or argv[0] == "--fail-write-after"):
        option, value = argv[0], argv[1]
        argv = argv[2:]
        if option == "--kill-after":
            count, _, name = value.partition(":")
            kill_after = int(count)
            if name:
                options["kill_signal"] = int(getattr(signal, name))
        elif option == "--kill-at":
            options["kill_at"] = value
        elif option == "--kill-count":
            options["kill_count"] = int(value)
        elif option == "--kill-rank":
            options["kill_rank"] = int(value)
        elif option == "--kill-signal":
            options["kill_signal"] = int(getattr(signal, value))
        elif option == "--fail-write-after":
            options["fail_write_after_shards"] = int(value)
        else:
            raise SystemExit(f"unknown option {option}")
    return Faults(kill_after_shards=kill_after, **options), argv


def main(argv: list[str]) -> None:
    from packctl.cli import main as cli_main

    faults, argv = faults_of(argv)
    _with_faults(faults)
    sys.argv = ["packctl", *argv]
    cli_main()


def _with_faults(faults) -> None:
    """pack, materialize and tokenize of this process run with `faults`."""
    from packctl import pipeline
    from packctl.tokenize import run as tokenize_run

    pipeline.pack = functools.partial(pipeline.pack, faults=faults)
    pipeline.materialize_plan = functools.partial(pipeline.materialize_plan, faults=faults)
    tokenize_run.tokenize_corpus = functools.partial(tokenize_run.tokenize_corpus, faults=faults)


class Forked:
    """`packctl ARGV...` with `faults`, running in a child forked from this process
    (`fork_pack`); `wait()` gives (exit code, or minus the signal that ended it; stdout; stderr)."""

    def __init__(self, argv: list[str], faults):
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 99
            try:
                os.dup2(self._out.fileno(), 1)
                os.dup2(self._err.fileno(), 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
                from packctl.cli.app import run

                _with_faults(faults)
                code = run([str(a) for a in argv])
            except BaseException:  # the test must see it, never a second pytest
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)

    def stopped(self, timeout: float = 60) -> bool:
        """Wait until the child stops itself (`kill_signal=SIGSTOP`); False if it ended instead."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED)
            if done:
                if os.WIFSTOPPED(status):
                    return True
                self._status = status
                return False
            time.sleep(0.005)
        return False

    def wait(self, timeout: float = 120) -> tuple[int, str, str]:
        status = getattr(self, "_status", None)
        deadline = time.monotonic() + timeout
        while status is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if not done:
                status = None
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    _, status = os.waitpid(self.pid, 0)
                time.sleep(0.005)
        self._out.seek(0)
        self._err.seek(0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        result = code, self._out.read().decode(), self._err.read().decode()
        self._out.close()
        self._err.close()
        return result


def fork_pack(argv: list[str], faults) -> Forked:
    return Forked(argv, faults)


def run_forked(argv: list[str], faults, timeout: float = 120) -> tuple[int, str, str]:
    """`packctl ARGV...` with `faults`, in a forked child, waited for (`Forked.wait`)."""
    return Forked(argv, faults).wait(timeout)


if __name__ == "__main__":
    main(sys.argv[1:])


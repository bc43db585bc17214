"""The `packctl` application: the typer app every command registers on, how errors end a command
(one line on stderr, the exit code of the error), and the process entry point."""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from typing import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from packctl.errors import PackctlError

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Pack variable-length tokenized Parquet datasets into THD shards for LLM training.")


def _print_version(value: bool) -> None:
    if value:
        from packctl.version import __version__

        print(f"packctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the packctl version and exit.")) -> None:
    """Pack variable-length tokenized Parquet datasets into THD shards for LLM training."""


def fail(exc: PackctlError) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    raise typer.Exit(exc.exit_code)


@contextmanager
def ranks_stop_together(comm) -> Iterator[None]:
    """Errors under MPI: one that every rank raised (bad option, bad input found before reading)
    is printed by rank 0 and every rank exits with its code; one that only this rank hit (its own
    blocks, a failed write) is printed with the rank, and all ranks are aborted, so none hangs."""
    try:
        yield
    except PackctlError as exc:
        if comm.size == 1 or exc.everywhere:
            if comm.rank == 0:
                fail(exc)
            raise typer.Exit(exc.exit_code)
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] rank {comm.rank}: {escape(str(exc))}",
                                                   highlight=False)
        comm.abort(exc.exit_code)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except BaseException:
        if comm.size == 1:
            raise
        traceback.print_exc()
        print(f"rank {comm.rank}: internal error; aborting all ranks", file=sys.stderr, flush=True)
        comm.abort(1)


def run(argv: list[str] | None = None) -> int:
    """`packctl ARGV...` in this process; returns the exit code instead of exiting (tests call it
    in-process; `main` is the `packctl` executable). Usage errors (an unknown option, a value of
    the wrong type) print one line and return 2, as every other error does."""
    try:
        code = app(args=argv, prog_name="packctl", standalone_mode=False)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the parser's own exceptions (click's, or typer's copy of click)
        if _is(exc, "Exit"):
            return int(exc.exit_code)
        if _is(exc, "Abort"):
            print("interrupted", file=sys.stderr)
            return 130
        if _is(exc, "NoArgsIsHelpError"):  # `packctl` or `packctl pack` alone: the help
            print(exc.ctx.get_help(), file=sys.stderr)
            return 2
        if _is(exc, "ClickException"):
            message = exc.format_message().replace("\n", " ")
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                message = f"{message} (see {ctx.command_path} --help)"
            Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
            return int(exc.exit_code)
        raise
    return code if isinstance(code, int) else 0


def _is(exc: BaseException, name: str) -> bool:
    """Whether `exc` is a `name` of click, whichever copy of click raised it (typer ships its own)."""
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def main() -> None:
    """The `packctl` executable."""
    _exit_now(SystemExit(run()))


def _exit_now(done: SystemExit) -> None:
    """End the `packctl` process without tearing the interpreter down: every output is written,
    fsync'd and closed by now, and freeing a large run's objects one by one takes about 0.4 s
    (docs/performance.md). Under MPI the normal exit runs, so that MPI is finalized."""
    if "mpi4py" in sys.modules:
        raise done
    code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    if done.code is not None and not isinstance(done.code, int):
        print(done.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

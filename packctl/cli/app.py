"""The `packctl` application: the typer app every command registers on, how errors end a command
(one line on stderr, the exit code of the error), and the process entry point."""
from __future__ import annotations

import errno
import gc
import os
import re
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, get_args, get_origin

import typer
from typer.core import TyperCommand, TyperGroup

from packctl.errors import PackctlError


class _PlainValues:
    """How typer converts the value of one option, skipped where converting changes nothing.

    typer converts every option's value with a pydantic validator it builds for the option on first
    use, options left unset included: importing pydantic and building the validators of `pack`'s
    50 options cost a pack about 0.06 s. Values that need no conversion are taken as typer
    would give them: None for an option not given (() for a repeated one), and, for options of these
    types without a parser or bounds of their own, a string for a string option, strings for a list
    of strings, plain decimals (`4096`, `-1`, `0.25`) for numbers. Anything else (`1e3`, ` 5`,
    `5_000`, a path) goes to typer's own conversion, built then, so values and error messages stay
    typer's (tests/cli/test_startup.py compares the two).

    typer has no public API for this: it reaches into typer's `param._runtime_param` (set by
    `_take_plain_values`, the one place that does) and `typer._coercion.build_runtime_param`.
    Measured with typer 0.29: without it a pack of sample_data takes 5-7% more time (A/B 1.04-1.07,
    15 interleaved pairs), on top of a pack already about 1.4x a plain pyarrow copy. If typer
    renames either, tests/cli/test_startup.py fails: the comparison cannot import typer's
    conversion, and a pack loads pydantic again.
    """

    _INT = re.compile(r"-?[0-9]{1,18}")  # ASCII digits only: pydantic refuses other digits int() takes
    _FLOAT = re.compile(r"-?[0-9]{1,15}(\.[0-9]{1,15})?")

    def __init__(self, descriptor) -> None:
        self._descriptor = descriptor
        self._typer = None
        info, annotation = descriptor.parameter_info, descriptor.annotation
        own_rules = (descriptor.file_annotation is not None or info.parser is not None or info.min is not None
                     or info.max is not None or info.clamp)
        self._type = None if own_rules else (
            annotation if annotation in (str, int, float) else
            list if get_origin(annotation) is list and get_args(annotation) == (str,) else None)

    @staticmethod
    def applies_to(param) -> bool:
        """Whether `param` is a typer parameter whose conversion typer has not built yet."""
        return getattr(param, "type_descriptor", None) is not None and getattr(param, "_runtime_param", 0) is None

    def coerce(self, value, param, ctx):
        if value is None:
            return () if param.multiple or param.nargs == -1 else None
        if self._type is str and type(value) is str:
            return value
        if self._type is int and type(value) is str and self._INT.fullmatch(value):
            return int(value)
        if self._type is float and type(value) is str and self._FLOAT.fullmatch(value):
            return float(value)
        if self._type is list and isinstance(value, (list, tuple)) and all(type(v) is str for v in value):
            return list(value)
        if self._typer is None:
            from typer._coercion import build_runtime_param

            self._typer = build_runtime_param(self._descriptor)
        return self._typer.coerce(value, param=param, ctx=ctx)


def _take_plain_values(params: list) -> list:
    for param in params:
        if _PlainValues.applies_to(param):
            param._runtime_param = _PlainValues(param.type_descriptor)
    return params


class Command(TyperCommand):
    """A packctl command: typer's, taking plain option values as they are (`_PlainValues`), with
    its --help in groups (each option's `rich_help_panel`: Input, Packing, ... for `pack`) and
    values named as a user types them (`--capacity N`, `--output OUT`, `INPUT...`), not as
    Python types. Every command registers with `@app.command(NAME, cls=Command)`."""

    def get_params(self, ctx):
        return _readable(_take_plain_values(super().get_params(ctx)))

    def collect_usage_pieces(self, ctx) -> list[str]:
        """`[OPTIONS] PLAN`, `[OPTIONS] [INPUT...]`: an optional argument in brackets."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = _argument_name(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx, formatter) -> None:
        """Arguments, then the options panel by panel (config.PANELS order), then the others
        under "Options"."""
        from packctl.config import PANELS

        arguments, panels = [], {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((_argument_name(param), record[1]))
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        for title in sorted(panels, key=lambda t: PANELS.index(t) if t in PANELS else len(PANELS)):
            with formatter.section(title):
                formatter.write_dl(panels[title])


# How --help names the value of an option by its type, where the option names none itself.
_METAVARS = {int: "N", float: "NUMBER", str: "TEXT", Path: "PATH"}


def _readable(params: list) -> list:
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if param.param_type_name == "option" and param.metavar is None and not param.is_flag and descriptor:
            param.metavar = _METAVARS.get(descriptor.annotation, "TEXT")
    return params


def _argument_name(param) -> str:
    """An argument as --help and the usage line name it: its metavar, else its name in capitals;
    `...` when it takes several."""
    name = param.metavar or param.name.upper()
    return name if param.nargs == 1 or name.endswith("...") else f"{name}..."


class _Group(TyperGroup):
    """The `packctl` group (its own options: --version, --help, completion), as `Command`; its
    list of commands gives each command's first sentence whole, wrapped to the terminal."""

    def get_params(self, ctx):
        return _readable(_take_plain_values(super().get_params(ctx)))

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=_SENTENCE)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


_SENTENCE = 1_000  # characters: a command's first sentence, never cut


app = typer.Typer(cls=_Group, add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
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


class _Stopped(PackctlError):
    """SIGINT or SIGTERM while a command loaded its modules (`loading_modules`)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def fail(exc: PackctlError) -> None:
    raise typer.Exit(_fail_line(str(exc), exc.exit_code))


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
        _fail_line(f"rank {comm.rank}: {exc}", exc.exit_code)
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
    the wrong type) print one line and return 2, as every other error does; so do running out of
    memory and a stdout that cannot be written (a full device), while a stdout closed by its
    reader (`packctl stats X | head -1`) ends the command quietly with 141, as SIGPIPE would."""
    args = list(sys.argv[1:] if argv is None else argv)
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)
    try:
        code = app(args=args, prog_name="packctl", standalone_mode=False)
        sys.stdout.flush()  # what is still buffered is part of the result: a failure to write it is one too
    except StdoutFailed as exc:
        return _stdout_failed(exc.cause, stdout, exc.note)
    except KeyboardInterrupt:
        return _fail_line(INTERRUPTED_EARLY, 130)
    except PackctlError as exc:  # raised outside a command's own handling (`loading_modules`)
        return _fail_line(str(exc), exc.exit_code)
    except MemoryError:
        command = next((a for a in args if a in MEMORY_ADVICE), None)
        return _fail_line(f"out of memory while running packctl {command or ''}".rstrip() +
                          f"; {MEMORY_ADVICE.get(command, 'free memory on this machine')}", 2)
    except Exception as exc:  # the parser's own exceptions (click's, or typer's copy of click)
        if _is(exc, "Exit"):
            if isinstance(exc.__cause__, KeyboardInterrupt):  # typer's Exit(130) for a SIGINT it caught
                return _fail_line(INTERRUPTED_EARLY, 130)
            return int(exc.exit_code)
        if _is(exc, "Abort"):
            return _fail_line(INTERRUPTED_EARLY, 130)
        if _is(exc, "NoArgsIsHelpError"):  # `packctl` or `packctl pack` alone: the help
            print(exc.ctx.get_help(), file=sys.stderr)
            return 2
        if _is(exc, "ClickException"):
            message = exc.format_message().replace("\n", " ")
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                message = f"{message} (see {ctx.command_path} --help)"
            return _fail_line(message, int(exc.exit_code))
        raise
    finally:
        if isinstance(sys.stdout, _Stdout):
            sys.stdout = stdout
    return code if isinstance(code, int) else 0


# SIGINT before a command's own handling of signals began (while Python and packctl load)
INTERRUPTED_EARLY = "interrupted by SIGINT before the command started; nothing was written"

# What to change when a command runs out of memory (packctl pack says it per stage: cli/pack.py).
MEMORY_ADVICE = {
    "pack": "lower --memory-budget, --window or --capacity",
    "stats": "lower --window, or give fewer inputs at once",
    "verify": "a shard is checked in memory: pack with a lower --shard-rows, or check on a larger machine",
    "export": "a shard is converted in memory: pack with a lower --shard-rows, or export on a larger machine",
    "sample": "lower --sequences or --max-length",
}
# Exit code of a command whose reader closed stdout: what a shell reports for a process ended by
# SIGPIPE (128 + 13), which `set -o pipefail` pipelines know.
EXIT_CLOSED_PIPE = 141


class StdoutFailed(Exception):
    """Writing the result to stdout failed: `cause` is the OSError (EPIPE, ENOSPC ...)."""

    def __init__(self, cause: OSError):
        super().__init__(str(cause))
        self.cause = cause
        self.note = ""  # what the command did all the same ("out is complete")


class _Stdout:
    """sys.stdout while a command runs: a write or flush that fails raises StdoutFailed, so that a
    full device or a closed pipe is told apart from every other failed write. Everything else is
    the stream's own (isatty for rich, encoding, fileno)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StdoutFailed(exc) from None

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutFailed(exc) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _stdout_failed(exc: OSError, stream, note: str = "") -> int:
    """The end of a command whose result could not be written to stdout. What stdout still buffers
    is dropped (the process's stdout is pointed at /dev/null), so that no later flush fails again."""
    if stream is sys.__stdout__:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
    if exc.errno == errno.EPIPE:  # the reader is gone (`| head -1`): nothing is wrong, nothing to say
        return EXIT_CLOSED_PIPE
    reason = os.strerror(exc.errno) if exc.errno else (str(exc) or type(exc).__name__)
    return _fail_line(f"cannot write the result to stdout ({reason})" + (f"; {note}" if note else ""), 2)


def console(**options):
    """A rich Console (`options` as rich takes them), rich loaded on first use: a command that
    prints nothing on the way (`pack -q`, `pack --json`) does not load it."""
    from rich.console import Console

    return Console(**options)


def _fail_line(message: str, code: int) -> int:
    """Print `error: message` on stderr (if stderr can take it) and return `code`."""
    from rich.markup import escape

    try:
        console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    except OSError:
        pass
    return code


def _is(exc: BaseException, name: str) -> bool:
    """Whether `exc` is a `name` of click, whichever copy of click raised it (typer ships its own)."""
    return any(cls.__name__ == name for cls in type(exc).__mro__)


@contextmanager
def loading_modules() -> Iterator[None]:
    """Where a command imports the modules it runs on (numpy, pyarrow, numba, packctl's pipeline):
    Python's cyclic garbage collector is paused meanwhile. Importing them creates some 70,000
    objects that live as long as the process, which the collector would otherwise scan again and
    again (about 0.04 s of a pack of sample_data). In the `packctl` executable they are then left
    out of every later collection (`gc.freeze`); a program calling `run` keeps its collector as it
    was.

    SIGINT and SIGTERM wait for the imports, then stop the command in one line (exit 130, 143):
    raised inside an import, their exception could be lost (an extension module that imports
    with errors ignored) or end in a traceback."""
    paused = gc.isenabled()
    gc.disable()
    came: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if _EXECUTABLE:
            gc.freeze()
        if paused:
            gc.enable()
    if came:
        name = signal.Signals(came[0]).name
        raise _Stopped(f"interrupted by {name} before the command started; nothing was written", 128 + came[0])


_EXECUTABLE = False  # True in the `packctl` process (main)


def main() -> None:
    """The `packctl` executable."""
    global _EXECUTABLE
    _EXECUTABLE = True
    _exit_now(SystemExit(run()))


def _exit_now(done: SystemExit) -> None:
    """End the `packctl` process without tearing the interpreter down: every output is written,
    fsync'd and closed by now, and freeing a large run's objects one by one takes about 0.4 s
    (docs/performance.md). Under MPI the normal exit runs, so that MPI is finalized."""
    code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    if done.code is not None and not isinstance(done.code, int):
        print(done.code, file=sys.stderr)
    try:
        sys.stdout.flush()
    except OSError as exc:  # run() flushed the result already; this is a last line of defence
        failed = _stdout_failed(exc, sys.stdout)
        code = code or failed
    try:
        sys.stderr.flush()
    except OSError:
        pass
    if "mpi4py" in sys.modules:
        raise SystemExit(code)
    os._exit(code)

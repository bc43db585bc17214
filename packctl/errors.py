"""Errors users can act on, and the exit codes the CLI maps them to."""
from __future__ import annotations

import re

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2


class PackctlError(Exception):
    """A problem with the user's input, options or environment.

    The message is one line that says what is wrong, where (file, row, column when there is one)
    and what to change. The CLI prints it without a traceback and exits with `exit_code`.

    `everywhere`: under MPI, every rank raised this same error (a bad option, an input problem found
    from the footers, or one rank's finding shared with all): rank 0 prints it once and every rank
    exits with its code. Otherwise it is this rank's own (its blocks, its writes): printed with
    the rank, and all ranks are aborted.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str = "", *, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere


class MissingExtraError(PackctlError):
    """An optional dependency is not installed; the message carries the exact install line."""

    def __init__(self, module: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the '{module}' package, which is not installed: "
            f"pip install 'packctl[{extra}]'"
        )


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency lazily, or fail with the install line.

    >>> np = require("numpy", "dev", "this example")
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(module.split(".")[0], extra, purpose) from exc


# The switches errors advise, as the Python API takes them (the CLI's flags otherwise)
_KEYWORDS = {"--resume --overwrite": "resume=True, overwrite=True", "--overwrite": "overwrite=True",
             "--resume": "resume=True"}
_ADVISED = re.compile(r"\b(pass|with|without|and) (--resume --overwrite|--overwrite|--resume)\b")


def in_api_terms(message: str) -> str:
    """An error's advice as a Python caller follows it: the keyword arguments of `PackConfig`, not
    the command line's flags.

        in_api_terms("out: already exists; pass --overwrite to replace it or choose another -o")
        -> "out: already exists; pass overwrite=True to replace it or choose another -o"
    """
    return _ADVISED.sub(lambda m: f"{m[1]} {_KEYWORDS[m[2]]}", message)

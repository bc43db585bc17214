"""Errors users can act on, and the exit codes the CLI maps them to."""
from __future__ import annotations

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2


class PackctlError(Exception):
    """A problem with the user's input, options or environment.

    The message is one line that says what is wrong, where (file, row, column when there is one)
    and what to change. The CLI prints it without a traceback and exits with `exit_code`.
    """

    exit_code = EXIT_BAD_INPUT


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

"""The first run after an install compiles the later stages' kernels in a second process.

A kernel compiles in numba's Python pipeline under one global lock, so a thread cannot compile
while the run works; a process can. When the kernels a run will need are not in numba's cache yet
(their cache index files are missing: the first run after an install or an upgrade), `pack` starts

    python -m packctl.compile_ahead NAME...

which compiles each named kernel of `KERNELS` with its signature into numba's cache and prints its
name when done, while the run scans its input (compiling the scan kernel itself). Before planning,
the run waits for the child (at most `WAIT_SECONDS`), and its own calls then load the kernels from
the cache. Anything that goes wrong with the child (it dies, it is slow, it cannot write the cache,
a signature is not the one the run uses) only costs time: the run compiles what it does not find,
as it always does, with the same machine code, and the child is stopped and waited for on every
way out of the run (an error, SIGINT, SIGTERM). Under MPI no child is started: the ranks of a node
would start one each.

`KERNELS` holds the exact signatures a run over int32 token and label columns uses (the common
layout; tests/cli/test_compile_ahead.py fails when a run calls them differently).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import threading
import time

# (module, kernel, dtypes of its arguments); "i64[]" is a C-contiguous writable 1-d int64 array,
# "i64" a scalar, "b" a bool. In the order a run calls them: the child compiles them in that order.
KERNELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("packctl.source.blocks", "_gather_masked",
     ("u16[]", "u8[]", "i64[]", "i64[]", "i32[]", "i32[]", "i64[]")),
    ("packctl.arrays", "_segment_positions", ("i64[]", "i32[]")),
    ("packctl.arrays", "_count_not_equal", ("i32[]", "i64[]", "i64[]", "i64", "i64[]")),
)
WAIT_SECONDS = 10.0


def signature(dtypes: tuple[str, ...]) -> tuple:
    """numba's argument types for `dtypes`: ("i64[]", "b") -> (Array(int64, 1, 'C'), boolean)."""
    from numba.core import types
    scalars = {"i64": types.int64, "i32": types.int32, "u16": types.uint16, "u8": types.uint8, "b": types.boolean}
    return tuple(types.Array(scalars[d[:-2]], 1, "C") if d.endswith("[]") else scalars[d] for d in dtypes)


def kernel(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def missing() -> list[str]:
    """Names of the `KERNELS` whose cache index is missing (none when the kernels are not cached at
    all: packctl/jit.py compiles them in memory then)."""
    from packctl.jit import cache_index_path

    names = []
    for module, name, _ in KERNELS:
        index = cache_index_path(kernel(module, name))
        if index is None:
            return []
        if not os.path.exists(index):
            names.append(name)
    return names


class CompileAhead:
    """The child process compiling `names` (module docstring); `wait()` before the kernels are
    needed, `stop()` on every way out."""

    def __init__(self, names: list[str], command: list[str] | None = None) -> None:
        self.names = set(names)
        self.done: set[str] = set()
        self._changed = threading.Condition()
        self._finished = False  # the child's output has ended
        self.process = subprocess.Popen(
            command or _child_command(names), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, cwd=_PACKAGE_ROOT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, ranks: int) -> CompileAhead | None:
        """The child, when one process runs and kernels are missing from the cache; else None."""
        if ranks > 1:
            return None
        try:
            names = missing()
            return cls(names) if names else None
        except Exception:  # noqa: BLE001 - only a shortcut: the run compiles what it lacks
            return None

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.done.add(line.strip())
                self._changed.notify_all()
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    def wait(self) -> None:
        """Until every kernel is compiled, the child has ended, or `WAIT_SECONDS` have passed (the
        child compiles them in about 0.8 s from its start: a bound, not an estimate); then the child
        is stopped."""
        deadline = time.monotonic() + WAIT_SECONDS
        with self._changed:
            while not self.names <= self.done and not self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        self.stop()

    def stop(self) -> None:
        """Ends the child (when still running) and reaps it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=1.0)
        self.process.stdout.close()


# The folder packctl is imported from: the child runs there, so `-m` finds this packctl and no
# module of the user's working directory (Python 3.11's -P says the same; 3.10 lacks it).
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_command(names: list[str]) -> list[str]:
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "packctl.compile_ahead", *names]


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this process if the run that started it dies (SIGKILL)."""
    import ctypes
    import signal
    with contextlib.suppress(Exception):  # elsewhere the child ends by itself after compiling
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(names: list[str]) -> int:
    _die_with_parent()
    table = {name: (module, dtypes) for module, name, dtypes in KERNELS}
    for name in names:
        module, dtypes = table[name]
        kernel(module, name).compile(signature(dtypes))
        print(name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Compiled kernels, and the clock of their compilation.

Every numba kernel of packctl is declared with `njit` from here. Importing this module registers
a listener of numba's compile events, so a run can tell the seconds spent compiling (the first run
after an install, or after a source change; later runs load the kernels from numba's cache in
milliseconds) from the seconds spent packing:

    jit = CompileClock()
    ...                # a kernel compiles on its first call
    jit.seconds        # 1.45 on a fresh install (sample_data), 0.0 once cached

Throughputs divide by the run time less `jit.seconds`, never by compilation.
"""
from __future__ import annotations

import threading
import time

import numba
from numba.core import event

njit = numba.njit


class _CompileListener(event.Listener):
    """Wall seconds inside numba's outermost compile events, summed over threads."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.total = 0.0

    def on_start(self, ev: event.Event) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.started = time.perf_counter()
        self._local.depth = depth + 1

    def on_end(self, ev: event.Event) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            with self._lock:
                self.total += time.perf_counter() - self._local.started


_LISTENER = _CompileListener()
event.register("numba:compile", _LISTENER)


def compile_seconds() -> float:
    """Seconds this process has spent compiling kernels so far."""
    return _LISTENER.total


class CompileClock:
    """Compile seconds since the clock was made."""

    def __init__(self) -> None:
        self._start = compile_seconds()

    @property
    def seconds(self) -> float:
        return compile_seconds() - self._start

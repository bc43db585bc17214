"""Compiled kernels, and the clock of their compilation.

Every numba kernel of packctl is declared with `njit` from here. Importing this module registers
a listener of numba's compile events, so a run can tell the seconds spent compiling (the first run
after an install, or after a source change; later runs load the kernels from numba's cache in
milliseconds) from the seconds spent packing:

    jit = CompileClock()
    ...                # a kernel compiles on its first call
    jit.seconds        # under 1 on a fresh install (sample_data), 0.0 once cached

Throughputs divide by the run time less `jit.seconds`, never by compilation.

The kernels are cached on disk (`cache=True`) where a directory can take them, chosen before
numba looks (numba itself gives up with a RuntimeError when the package directory is read-only and
HOME is not writable):

    NUMBA_CACHE_DIR, when the user set it: numba's own choice, left alone
    the package's __pycache__, when writable: numba's own choice too
    $XDG_CACHE_HOME/packctl/numba, ~/.cache/packctl/numba, or $TMPDIR/packctl-numba-UID
        (packctl.cachedir: the first writable one)
    none writable: the kernels compile in memory, on every run (a few seconds), and still run

A kernel found in the cache is loaded with numba's runtime initialized and nothing more
(`_KernelCache`): numba itself first initializes its whole CPU target, which only compiling needs
(about 0.15 s, docs/performance.md "Fixed cost").
"""
from __future__ import annotations

import functools
import os
import threading
import time

import numba
from numba.core import config as numba_config
from numba.core import event
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys

from packctl.cachedir import user_cache_dir, writable


def njit(*args, **options):
    """numba.njit, with `cache=True` kept only where a cache directory can be written (the module
    docstring): the same kernels on a read-only install, compiled in memory as a last resort.

    packctl's kernels are called from Python and from one another, never passed around as function
    values, so numba does not compile the C-callable wrapper it makes for that
    (`no_cfunc_wrapper`): 6% less compiling on a first run, the same machine code."""
    if args and callable(args[0]):  # @njit without options
        return njit(**options)(args[0])
    options.setdefault("no_cfunc_wrapper", True)
    if not options.get("cache"):
        return numba.njit(*args, **options)

    def decorate(fn):
        folder = cache_dir(os.path.dirname(os.path.abspath(fn.__code__.co_filename)))
        if folder == "":  # nowhere to cache: compile in memory
            return numba.njit(*args, **{**options, "cache": False})(fn)
        previous = numba_config.CACHE_DIR
        if folder:
            numba_config.CACHE_DIR = folder  # numba picks a kernel's cache as the kernel is declared
        try:
            return _light_loading(numba.njit(*args, **options)(fn))
        except RuntimeError as exc:  # numba's "cannot cache function ...: no locator available"
            if "no locator available" not in str(exc):
                raise
            return numba.njit(*args, **{**options, "cache": False})(fn)
        finally:
            numba_config.CACHE_DIR = previous

    return decorate


class _KernelCache(FunctionCache):
    """numba's disk cache of one kernel, loaded without initializing numba's whole CPU target.

    Before it loads a cached kernel, numba initializes its CPU target (`refresh()`: it imports some
    50 modules of implementations and installs about 2,000 typing templates), which only compiling
    needs: cached machine code needs numba's runtime (NRT), nothing else. So a kernel found in the
    cache is loaded with the runtime initialized; one that is not found is compiled as numba
    compiles it (compiling initializes the target itself); and anything unexpected while loading
    this way falls back to numba's own load, which then behaves as it always does.
    """

    def load_overload(self, sig, target_context):
        try:
            rtsys.initialize(target_context)
            return self._load_overload(sig, target_context)
        except Exception:  # noqa: BLE001 - numba's own path decides what a failure means
            return super().load_overload(sig, target_context)


# numba offers no public API for what the two functions below do; they are the only places packctl
# reaches into numba's internals (a kernel's `_cache`, its `_cache_file._index_path`,
# `FunctionCache._load_overload`). What they buy and what guards them:
#   _light_loading    a pack of sample_data 0.15 s less, 17% of its CPU (A/B 1.17-1.20 without it,
#                     9 interleaved pairs), which takes a pack of sample_data from about 1.4x a plain
#                     pyarrow copy of it to 1.6x. If numba renames what it uses, loading falls back
#                     to numba's own (the same kernels, slower), and
#                     tests/cli/test_startup.py::test_a_cached_kernel_loads_without_initializing_numbas_target
#                     fails.
#   cache_index_path  whether a kernel is in the cache without loading it, so that the first run
#                     after an install compiles in a second process (packctl/compile_ahead.py: about
#                     0.8 s of a first run). If numba renames it, the child is never started (no
#                     harm but the time), and tests/cli/test_compile_ahead.py fails.

def _light_loading(kernel):
    """`kernel` with its disk cache loaded the light way (`_KernelCache`), where it has one."""
    if type(getattr(kernel, "_cache", None)) is FunctionCache:
        kernel._cache.__class__ = _KernelCache
    return kernel


def cache_index_path(kernel) -> str | None:
    """The file of numba's cache that indexes `kernel`'s compiled signatures (it exists once the
    kernel has been compiled into the cache), or None for a kernel not cached on disk."""
    cache_file = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
    return None if cache_file is None else cache_file._index_path


@functools.cache
def cache_dir(source_dir: str) -> str | None:
    """Where the kernels of the modules in `source_dir` are cached: None when numba's own choice
    works (NUMBA_CACHE_DIR set by the user, or `source_dir`/__pycache__ writable), else a cache
    directory of packctl's (packctl.cachedir), or "" when none is writable (compile in memory)."""
    if os.environ.get("NUMBA_CACHE_DIR") or writable(os.path.join(source_dir, "__pycache__")):
        return None
    return user_cache_dir("numba") or ""


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

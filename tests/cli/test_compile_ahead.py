"""The first run after an install compiles materialize's kernels in a second process
(packctl/compile_ahead.py): the signature table matches what a run calls, and anything wrong with
that process costs only time (same output, no error line, no process left)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packctl import compile_ahead
from packctl.compile_ahead import KERNELS, CompileAhead
from tests.support.adversary import packctl

_RUN_COLD = """
import json, sys
from numba.core import event
import packctl.compile_ahead as ahead

compiled, started = [], []
class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(getattr(ev.data["dispatcher"].py_func, "__name__", "?"))
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
start = ahead.CompileAhead.start.__func__
def recorded(cls, *args):
    child = start(cls, *args)
    started.append(child)
    return child
ahead.CompileAhead.start = classmethod(recorded)
from packctl.cli.app import run
code = run(sys.argv[1:])
child = started[0]
print(json.dumps({"code": code, "compiled": compiled, "given": sorted(child.names) if child else [],
                  "done": sorted(child.done) if child else [],
                  "returncode": child.process.returncode if child else None}))
"""


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "data").glob("*.parquet"))}


@pytest.mark.slow
def test_a_cold_run_loads_every_kernel_of_the_table_from_the_child(tmp_path, sample_data):
    """With numba's cache empty, the run compiles none of the kernels the child was given: the
    child compiled them with exactly the signatures the run calls (a drifted signature would be
    compiled again by the run, and this test fails)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _RUN_COLD, "pack", str(sample_data), "-o", str(tmp_path / "out"),
                           "--too-long", "split", "-q"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["code"] == 0
    assert result["given"] == sorted(name for _, name, _ in KERNELS)
    assert result["done"] == result["given"]
    assert result["returncode"] is not None  # waited for
    assert "_compact" in result["compiled"]  # the listener sees what the run compiles itself
    assert not set(result["compiled"]) & set(result["given"]), result["compiled"]


def test_the_table_names_kernels_with_signatures_numba_accepts():
    for module, name, dtypes in KERNELS:
        kernel = compile_ahead.kernel(module, name)
        assert kernel.py_func.__code__.co_argcount == len(dtypes), name
        compile_ahead.signature(dtypes)  # every dtype spelled as the table spells them


def _child_running(command: list[str]):
    """CompileAhead.start made to start `command` as the child, and the children it made."""
    children = []

    def start(cls, ranks):
        child = cls([name for _, name, _ in KERNELS], command=command)
        children.append(child)
        return child

    return classmethod(start), children


@pytest.mark.parametrize("command", [
    [sys.executable, "-c", "import sys; sys.exit(3)"],  # dies at once
    [sys.executable, "-c", "print('something else', flush=True)"],  # ends without its kernels
    [sys.executable, "-m", "packctl.compile_ahead", "_no_such_kernel"],  # a name not in the table
], ids=["dies", "ends-early", "unknown-kernel"])
def test_a_child_that_fails_costs_only_time(monkeypatch, tmp_path, small_sample_data, command):
    reference = packctl("pack", small_sample_data, "-o", tmp_path / "reference", "--too-long", "split", "-q")
    assert reference.code == 0, reference.stderr
    start, children = _child_running(command)
    monkeypatch.setattr(CompileAhead, "start", start)
    result = packctl("pack", small_sample_data, "-o", tmp_path / "out", "--too-long", "split", "-q")
    assert (result.code, result.stdout, result.stderr) == (0, "", "")
    assert _shard_bytes(tmp_path / "out") == _shard_bytes(tmp_path / "reference")
    assert len(children) == 1 and children[0].process.returncode is not None


def test_a_slow_child_is_waited_for_a_bounded_time_then_killed(monkeypatch, tmp_path, small_sample_data):
    start, children = _child_running([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(CompileAhead, "start", start)
    monkeypatch.setattr(compile_ahead, "WAIT_SECONDS", 0.2)
    result = packctl("pack", small_sample_data, "-o", tmp_path / "out", "--too-long", "split", "-q")
    assert (result.code, result.stderr) == (0, "")
    assert children[0].process.returncode == -9  # killed, and reaped


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_a_run_that_ends_early_stops_the_child(monkeypatch, tmp_path, small_sample_data, interruption):
    """SIGINT (KeyboardInterrupt) or a failure during scan: the child is killed and reaped."""
    from packctl.pipeline import run as pipeline_run

    start, children = _child_running([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(CompileAhead, "start", start)

    def failing_scan(*args, **kwargs):
        raise interruption("interrupted")

    monkeypatch.setattr(pipeline_run, "_scan", failing_scan)
    with contextlib.suppress(BaseException):  # what the command line makes of it is not the point here
        packctl("pack", small_sample_data, "-o", tmp_path / "out", "--too-long", "split", "-q")
    assert children and children[0].process.returncode == -9


def test_no_child_under_mpi_nor_with_the_kernels_cached(monkeypatch):
    assert CompileAhead.start(2) is None
    monkeypatch.setattr(compile_ahead, "missing", list)
    assert CompileAhead.start(1) is None


def test_no_child_where_the_kernels_are_not_cached(monkeypatch):
    """Kernels compiled in memory (nowhere to cache them, packctl/jit.py) have no cache index."""
    monkeypatch.setattr(compile_ahead, "kernel", lambda module, name: object())
    assert compile_ahead.missing() == []


def test_only_the_kernels_missing_from_the_cache_are_compiled(monkeypatch, tmp_path):
    indexes = {name: tmp_path / f"{name}.nbi" for _, name, _ in KERNELS}

    class Kernel:
        def __init__(self, name):
            self._cache = type("Cache", (), {"_cache_file": type("File", (), {"_index_path": str(indexes[name])})})

    monkeypatch.setattr(compile_ahead, "kernel", lambda module, name: Kernel(name))
    first, *rest = indexes
    indexes[first].write_bytes(b"")
    assert compile_ahead.missing() == rest
    for name in rest:
        indexes[name].write_bytes(b"")
    assert compile_ahead.missing() == []


def _triple(values):
    return values * 3


def test_a_kernels_cache_index_appears_when_it_is_compiled(monkeypatch, tmp_path):
    """packctl.jit.cache_index_path reads numba's internals: this fails loudly when numba moves them
    (the child would silently never start)."""
    import numpy as np

    from packctl import jit

    monkeypatch.setattr(jit, "cache_dir", lambda source_dir: str(tmp_path))
    kernel = jit.njit(cache=True)(_triple)
    index = jit.cache_index_path(kernel)
    assert isinstance(index, str) and not os.path.exists(index)
    assert kernel(np.arange(3)).tolist() == [0, 3, 6]
    assert os.path.exists(index)
    assert jit.cache_index_path(jit.njit(_triple)) is None  # not cached on disk

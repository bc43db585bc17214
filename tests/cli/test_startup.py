"""The fixed cost of a packctl process (docs/performance.md "Fixed cost"): what a run loads, how
option values are converted, where Arrow's allocator is tuned, how cached kernels are loaded. Checked by behaviour and by module,
never by time."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest


def _pack_params():
    import typer.main

    from packctl.cli.app import app

    group = typer.main.get_command(app)
    command = group.commands["pack"]
    ctx = command.make_context("pack", ["x", "-o", "y"], resilient_parsing=True)
    return {p.name: p for p in command.params}, ctx


@pytest.mark.parametrize("name, values", [
    ("capacity", ["4096", "0", "-1", "007", "-0", "+5", " 5", "5 ", "5_000", "1e3", "5.0", "4096.5", "x", "",
                  "٣", "99999999999999999999", "123456789012345678"]),
    ("attn_coeff", ["0.5", "1", "-2.25", ".5", "1e-3", " 2.5", "nan", "inf", "1_0.5", "0.1000000000000000055511",
                    "x", ""]),
    ("output", ["out", "", " x ", "\udcff", "-"]),
    ("too_long", ["split", "nonsense"]),
    ("keep_columns", [("a",), ("a", "b"), ()]),
    ("inputs", [("sample_data",), ("a", "b/*.parquet"), ()]),
    ("config", ["pack.toml"]),
    ("overwrite", [True, False]),
])
def test_plain_option_values_are_converted_as_typer_converts_them(name, values):
    """packctl takes option values that need no conversion as they are (packctl.cli.app
    _PlainValues); for every value, the result (or the error message) is typer's own."""
    from typer._coercion import build_runtime_param

    from packctl.cli.app import _PlainValues

    params, ctx = _pack_params()
    param = params[name]
    for value in [None, *values]:
        outcomes = []
        for conversion in (_PlainValues(param.type_descriptor), build_runtime_param(param.type_descriptor)):
            try:
                result = conversion.coerce(value, param=param, ctx=ctx)
                outcomes.append((type(result), repr(result)))
            except Exception as exc:  # noqa: BLE001 - the same error either way
                outcomes.append((type(exc), str(exc)))
        assert outcomes[0] == outcomes[1], (value, outcomes)


def test_a_pack_loads_neither_pydantic_nor_rich_nor_arrow_compute(tmp_path, sample_data):
    """typer's pydantic validators, rich (a pack with -q prints nothing) and Arrow's compute
    functions cost a pack of sample_data about 0.1 s together; a plain pack needs none of them."""
    args = ["pack", str(sample_data), "-o", str(tmp_path / "out"), "--too-long", "split", "--capacity", "4096",
            "-q"]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "packctl", *args], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "pyarrow" in imported and "numba" in imported  # the log is read right
    assert not imported & {"pydantic", "rich", "pyarrow.compute", "tomllib"}, imported & {
        "pydantic", "rich", "pyarrow.compute", "tomllib"}


def test_a_cached_kernel_loads_without_initializing_numbas_target(tmp_path):
    """A kernel found in numba's cache runs without numba's CPU target initialized (packctl.jit
    _KernelCache): numba.np.linalg is one of the modules only that initialization imports."""
    module = tmp_path / "kernels.py"
    module.write_text(
        "import numpy as np\n"
        "from packctl.jit import njit\n\n"
        "@njit(cache=True)\n"
        "def running(values):\n"
        "    out = np.empty(len(values), np.int64)\n"
        "    total = 0\n"
        "    for k in range(len(values)):\n"
        "        total += values[k]\n"
        "        out[k] = total\n"
        "    return out\n")
    code = ("import sys, numpy as np, kernels\n"
            "print(kernels.running(np.arange(5)).tolist(), 'numba.np.linalg' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    first, second = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                    cwd=tmp_path, env=env, check=False) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.split() == ["[0,", "1,", "3,", "6,", "10]", "True"]  # compiled: the target initialized
    assert second.stdout.split() == ["[0,", "1,", "3,", "6,", "10]", "False"]  # loaded from the cache


def _double(values):
    return values * 2


def test_a_kernel_that_cannot_be_loaded_the_light_way_is_loaded_as_numba_loads_it(monkeypatch, tmp_path):
    import numpy as np
    from numba.core.caching import FunctionCache

    from packctl import jit

    monkeypatch.setattr(jit, "cache_dir", lambda source_dir: str(tmp_path))
    double = _double
    assert jit.njit(cache=True)(double)(np.arange(3)).tolist() == [0, 2, 4]  # compiled and cached
    calls = []
    real = FunctionCache._load_overload

    def fails_once(self, sig, target_context):
        calls.append(sig)
        if len(calls) == 1:
            raise RuntimeError("unexpected")
        return real(self, sig, target_context)

    monkeypatch.setattr(FunctionCache, "_load_overload", fails_once)
    kernel = jit.njit(cache=True)(double)
    assert type(kernel._cache).__name__ == "_KernelCache"
    assert kernel(np.arange(3)).tolist() == [0, 2, 4]
    assert len(calls) == 2 and kernel.stats.cache_hits  # the light load failed; numba's own found it


def test_commands_load_their_modules_with_the_collector_paused_and_leave_it_as_it_was():
    from packctl.cli.app import loading_modules

    frozen = gc.get_freeze_count()
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with loading_modules():
                assert not gc.isenabled()
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert gc.get_freeze_count() == frozen  # only the packctl executable freezes what it loaded


def test_only_the_packctl_process_tunes_arrows_allocator(monkeypatch):
    """`import packctl` leaves a program's environment alone; the `packctl` command sets
    MIMALLOC_PURGE_DELAY before anything of the command (pyarrow among it) is imported, and a
    user's own setting wins."""
    env = {k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DELAY"}
    code = ("import os, sys, packctl, packctl.__main__\n"
            "print(os.environ.get('MIMALLOC_PURGE_DELAY'), 'pyarrow' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert proc.stdout.split() == ["None", "False"], proc.stderr[-2000:]

    import packctl.cli
    from packctl.__main__ import entry

    seen = []
    monkeypatch.setattr(packctl.cli, "main", lambda: seen.append(os.environ.get("MIMALLOC_PURGE_DELAY")))
    monkeypatch.delenv("MIMALLOC_PURGE_DELAY", raising=False)
    entry()
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "50")
    entry()
    assert seen == ["1000", "50"]

"""The environment (docs/errors.md "The environment"): a read-only install, an unwritable HOME,
nowhere to cache compiled kernels. packctl runs all the same: numba's cache goes where it can be
written (packctl.jit, packctl.cachedir), or the kernels compile in memory.

The tests run as root, whom permissions do not stop: a read-only install is made real by turning
every __pycache__ of a copy of the package into a regular file (numba can neither create nor
write it), and HOME into a regular file. Where another user can run this Python, the same is
done for real with `setpriv --reuid=65534` on a copy that user cannot write.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa
import pytest
from support.adversary import Result, assert_every_sample_once
from support.data import write_table

import packctl
from packctl import cachedir, jit

PACKAGE = Path(packctl.__file__).resolve().parent
NOBODY = 65534


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "a.parquet"
    rows = [list(range(1, 2 + k % 9)) for k in range(40)]
    return write_table(path, {"input_ids": pa.array(rows, pa.list_(pa.int32()))})


def _install(tmp_path: Path, *, writable_caches: bool = False) -> Path:
    """A copy of the package to run from; with `writable_caches` False, numba cannot cache beside
    its sources (every __pycache__ a regular file)."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "packctl", ignore=shutil.ignore_patterns("__pycache__"))
    if not writable_caches:
        for folder in [site / "packctl", *(p for p in (site / "packctl").rglob("*") if p.is_dir())]:
            (folder / "__pycache__").write_text("not a directory")
    return site


def _environment(site: Path, tmp_path: Path, **extra: str) -> dict:
    """The environment of a user whose HOME and XDG cache cannot be written, NUMBA_CACHE_DIR unset."""
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH", "MPLCONFIGDIR")}
    env.update(PYTHONPATH=str(site), HOME=str(home), XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env.update(extra)
    return env


def _pack(corpus: Path, out: Path, env: dict, prefix: list[str] | None = None) -> Result:
    cmd = (prefix or [sys.executable, "-m", "packctl"]) + ["pack", str(corpus), "-o", str(out), "--capacity", "16",
                                                           "-q"]
    # run from the installed copy's folder: `-m` puts the working directory first on sys.path
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False,
                          cwd=env["PYTHONPATH"])
    return Result(proc.returncode, proc.stdout, proc.stderr)


def _cached_kernels(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.nbi")) if folder.exists() else []


@pytest.mark.slow
def test_a_read_only_install_caches_in_the_xdg_cache(corpus, tmp_path):
    site = _install(tmp_path)
    env = _environment(site, tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    result = _pack(corpus, tmp_path / "out", env)
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert _cached_kernels(tmp_path / "xdg" / "packctl" / "numba")
    assert_every_sample_once(tmp_path / "out", [corpus])


@pytest.mark.slow
def test_a_read_only_install_with_an_unwritable_home_caches_in_a_private_temp_dir(corpus, tmp_path):
    site = _install(tmp_path)
    env = _environment(site, tmp_path)
    for run in ("first", "second"):  # the second loads what the first cached
        result = _pack(corpus, tmp_path / run, env)
        assert result.code == 0, result.stderr
        assert_every_sample_once(tmp_path / run, [corpus])
    temp = tmp_path / "tmp" / f"packctl-numba-{os.getuid()}"
    assert _cached_kernels(temp)
    assert stat.S_IMODE(temp.stat().st_mode) == 0o700


@pytest.mark.slow
def test_nowhere_to_cache_compiles_in_memory(corpus, tmp_path):
    """HOME, XDG and the temp directory all unwritable (the temp directory a regular file): the
    kernels compile in memory, and the run is the same."""
    site = _install(tmp_path)
    env = _environment(site, tmp_path)
    blocked = tmp_path / "temp-is-a-file"
    blocked.write_text("")
    code = ("import sys, tempfile; tempfile.tempdir = sys.argv.pop(1); "
            "from packctl.cli import main; sys.argv[0] = 'packctl'; main()")
    prefix = [sys.executable, "-c", code, str(blocked)]
    result = _pack(corpus, tmp_path / "out", env, prefix)
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert not _cached_kernels(tmp_path)
    assert_every_sample_once(tmp_path / "out", [corpus])


def _nobody_runs_python() -> bool:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        return False
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                           "-c", "import numba, pyarrow"], capture_output=True, timeout=120, check=False)
    return proc.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _nobody_runs_python(), reason="no other user can run this Python here (setpriv, or the "
                                                      "interpreter is private to root)")
def test_a_real_read_only_install_as_another_user(corpus):
    """Everything under a directory of its own in /tmp (pytest's is private to root): the package
    read-only, HOME missing, a shared temp directory."""
    base = Path(tempfile.mkdtemp(prefix="packctl-readonly-"))
    try:
        base.chmod(0o755)
        site = _install(base, writable_caches=True)
        subprocess.run(["chmod", "-R", "a+rX,a-w", str(site)], check=True)
        source = base / "a.parquet"
        shutil.copy(corpus, source)
        source.chmod(0o644)
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o1777)  # a temp directory: everyone may create in it
        env = _environment(site, base, HOME="/nonexistent", XDG_CACHE_HOME="/nonexistent/cache", TMPDIR=str(shared))
        prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-m",
                  "packctl"]
        result = _pack(source, shared / "out", env, prefix)
        assert result.code == 0, result.stderr
        assert _cached_kernels(shared / f"packctl-numba-{NOBODY}")
        assert_every_sample_once(shared / "out", [source])
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# In this process: the choice itself

def _add(a, b):
    return a + b


def test_kernels_compile_in_memory_where_numba_finds_no_cache(monkeypatch):
    """numba raises at declaration when no cache directory works; packctl's njit compiles the
    kernel in memory instead."""
    from numba.core import caching

    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", [])
    monkeypatch.setattr(jit, "cache_dir", lambda source_dir: None)
    with pytest.raises(RuntimeError, match="no locator available"):
        numba.njit(cache=True)(_add)  # the failure packctl's njit turns into a kernel that runs
    kernel = jit.njit(cache=True)(_add)
    assert kernel(np.int64(2), np.int64(3)) == 5


def test_no_cache_directory_means_an_uncached_kernel(monkeypatch):
    monkeypatch.setattr(jit, "cache_dir", lambda source_dir: "")
    kernel = jit.njit(cache=True, nogil=True)(_add)
    assert kernel(1, 2) == 3
    assert type(kernel._cache).__name__ == "NullCache"


def test_a_chosen_directory_holds_the_kernel_and_numba_is_left_as_it_was(monkeypatch, tmp_path):
    from numba.core import config

    before = config.CACHE_DIR
    monkeypatch.setattr(jit, "cache_dir", lambda source_dir: str(tmp_path))
    kernel = jit.njit(cache=True)(_add)
    assert kernel(4, 5) == 9
    assert config.CACHE_DIR == before
    assert _cached_kernels(tmp_path)


def test_the_cache_directories_in_order(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cachedir.user_cache_dir("numba") == str(tmp_path / "xdg" / "packctl" / "numba")
    (tmp_path / "xdg-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-file"))  # not a directory
    assert cachedir.user_cache_dir("numba") == str(tmp_path / "home" / ".cache" / "packctl" / "numba")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # ignored, as XDG says
    assert cachedir.user_cache_dir("numba") == str(tmp_path / "home" / ".cache" / "packctl" / "numba")
    (tmp_path / "home").rename(tmp_path / "home-dir")
    (tmp_path / "home").write_text("")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cachedir.user_cache_dir("numba") == str(tmp_path / "tmp" / f"packctl-numba-{os.getuid()}")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "xdg-file"))  # a regular file
    assert cachedir.user_cache_dir("numba") is None


@pytest.mark.parametrize("mode, used", [(0o700, True), (0o755, True), (0o775, False), (0o777, False)])
def test_a_temp_cache_directory_others_can_write_is_not_used(tmp_path, mode, used):
    """numba loads compiled code from its cache: a directory another user could write into (made
    by someone else, or opened up) is never one."""
    folder = tmp_path / "packctl-numba-x"
    folder.mkdir()
    folder.chmod(mode)
    assert cachedir.own_private_dir(str(folder)) is used


def test_a_temp_cache_directory_that_is_a_link_is_not_used(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    assert not cachedir.own_private_dir(str(tmp_path / "link"))


@pytest.mark.slow
def test_a_plot_with_an_unwritable_home_says_nothing_of_matplotlib(corpus, tmp_path):
    """Matplotlib warns on stderr, and rebuilds its font list each time, when its config directory
    cannot be written: packctl gives it a cache directory of its own."""
    pytest.importorskip("matplotlib")
    env = _environment(_install(tmp_path, writable_caches=True), tmp_path)
    proc = subprocess.run([sys.executable, "-m", "packctl", "stats", str(corpus), "--capacity", "16", "--plot",
                           str(tmp_path / "p.png"), "--json"], capture_output=True, text=True, env=env, timeout=600,
                          check=False, cwd=env["PYTHONPATH"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    assert (tmp_path / "p.png").stat().st_size > 0
    assert (tmp_path / "tmp" / f"packctl-matplotlib-{os.getuid()}").is_dir()

"""What every adversarial test asserts: a failure is one clear line with its exit code and leaves
nothing behind; a success holds every source sample exactly once.

    result = packctl("pack", str(corpus), "-o", str(out))         # in this process
    result = packctl_process("pack", ...)                          # a process of its own
    assert_clean_error(result, 2, "hard link", "a.parquet")
    assert_nothing_left(out)
    assert_every_sample_once(out, [corpus])
"""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.contract import check_contract, load_checker
from support.referee import every_sample_once


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[str]:
        """The non-empty lines of stderr."""
        return [line for line in self.stderr.splitlines() if line.strip()]


def packctl(*args: str) -> Result:
    """`packctl ARGS...` run in this process (packctl.cli.app.run), stdout and stderr captured. An
    exception that escapes the command line fails the test: it would be a traceback for a user."""
    from packctl.cli.app import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run([str(a) for a in args])
    return Result(code, out.getvalue(), err.getvalue())


def packctl_process(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300,
                    launcher: list[str] | None = None) -> Result:
    """`packctl ARGS...` as a user runs it, in a process of its own (`python -m packctl`), or
    behind `launcher` (mpiexec, tests/support/faulty_pack.py)."""
    cmd = (launcher or [sys.executable, "-m", "packctl"]) + [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_clean_error(result: Result, code: int = 2, *mentions: str) -> str:
    """Exit `code`, exactly one line on stderr, starting with `error:`, naming each of `mentions`,
    and no traceback anywhere. Returns the line."""
    where = f"exit {result.code}, stderr:\n{result.stderr}\nstdout:\n{result.stdout}"
    assert "Traceback" not in result.stderr + result.stdout, where
    assert result.code == code, where
    assert len(result.lines) == 1, where
    line = result.lines[0]
    assert line.startswith("error: "), where
    for text in mentions:
        assert str(text) in line, f"{text!r} not in {line!r}"
    return line


def leftovers(out: Path) -> list[Path]:
    """What packctl keeps beside OUT while it runs (`.OUT.packctl-lock`, `-partial`, `-old`, ...)."""
    return sorted(Path(out).parent.glob(f".{Path(out).name}.packctl-*"))


def assert_nothing_left(out: Path) -> None:
    """No OUT and nothing of packctl's beside it."""
    assert not Path(out).exists(), f"{out} exists"
    assert leftovers(out) == [], leftovers(out)


def assert_complete(out: Path) -> None:
    """A complete output (its manifest, or _epochs.json, written last) and nothing left beside it."""
    out = Path(out)
    assert (out / "_manifest.json").is_file() or (out / "_epochs.json").is_file(), f"{out} is not complete"
    assert leftovers(out) == [], leftovers(out)


def assert_every_sample_once(out: Path, sources: list[Path]) -> None:
    """Every row of the source files in OUT once, whole or in pieces, with its tokens and labels,
    or counted in the manifest as dropped or truncated: the independent contract checker with
    --source when it is beside the repository, else the referee of tests/support/referee.py."""
    out = Path(out)
    assert_complete(out)
    checker = load_checker()
    if checker is not None:
        assert check_contract(checker, out, [Path(s) for s in sources]) == []
    else:
        assert every_sample_once(out, [Path(s) for s in sources]) == []

"""SIGINT and SIGTERM at any moment of a `packctl` process end it in one line, exit 130 or 143
(docs/errors.md "Interrupted runs and --resume"): while Python loads the command line, while a
command loads its modules, and while a run imports a module lazily inside a C extension that
drops exceptions (pyarrow imports pandas on first use and ignores errors it cannot pass on).

Each case runs `python -m packctl` in a child whose import hook sends the signal when the named
module starts to load, so the signal lands exactly there, whatever the machine's speed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.adversary import leftovers
from support.data import write_table
from support.paths import ROOT

# The child: a meta-path hook that signals this process once, when MODULE is first imported.
CHILD = """
import os, signal, sys, runpy
module, signum = sys.argv[1], getattr(signal, sys.argv[2])

class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == module and not os.environ.get("_FIRED"):
            os.environ["_FIRED"] = "1"
            sys.stderr.write("signalled\\n")
            os.kill(os.getpid(), signum)
        return None

sys.meta_path.insert(0, Hook())
sys.argv = ["packctl", *sys.argv[3:]]
runpy.run_module("packctl", run_name="__main__", alter_sys=True)
"""


def _run(module: str, signame: str, *argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", CHILD, module, signame, *map(str, argv)], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    from support.runs import pack_to

    root = tmp_path_factory.mktemp("signals")
    corpus = write_table(root / "in" / "a.parquet", {"input_ids": [[5, 6, 2], [7, 2], [8, 9, 4, 2]] * 8})
    pack_to(root / "plan", [corpus], capacity=8, shard_rows=3, plan_only=True)
    return pack_to(root, [corpus], capacity=8, shard_rows=3)[1]


# Each command, and a module it imports only once its run has begun (its signal handler installed).
COMMANDS = {
    "export": (lambda packed, target: ["export", packed, "-o", target, "--format", "megatron", "-q"], "pandas"),
    "pack": (lambda packed, target: ["pack", packed.parent / "in", "-o", target, "--capacity", "8", "-q"],
             "numpy.ma"),
    "materialize": (lambda packed, target: ["materialize", packed.parent / "plan" / "out", "-o", target, "-q"],
                    "pandas"),
}


def _assert_stopped(result: subprocess.CompletedProcess, signame: str, target: Path) -> None:
    lines = [line for line in result.stderr.splitlines() if line != "signalled"]
    assert "signalled" in result.stderr, result.stderr
    assert result.returncode == {"SIGINT": 130, "SIGTERM": 143}[signame], result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and signame in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not target.exists()
    if "--resume" not in lines[0]:  # finished shards are kept for --resume, and the line says so
        assert leftovers(target) == []


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when", ["python loads the command line", "the command loads its modules",
                                  "the run imports a module lazily"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_signal_during_an_import_stops_the_command_in_one_line(packed, tmp_path, command, when, signame):
    argv, lazy = COMMANDS[command]
    module = {"python loads the command line": "typer", "the command loads its modules": "pyarrow.parquet",
              "the run imports a module lazily": lazy}[when]
    result = _run(module, signame, *argv(packed, tmp_path / "target"))
    _assert_stopped(result, signame, tmp_path / "target")

"""The README's Quickstart blocks run in order, as a new user runs them, on a smaller corpus: each
succeeds, none needs an option the README leaves out, and the Quickstart's pack run twice is
"already complete" (exit 0)."""
from __future__ import annotations

import re
import shlex

import pytest

from support.adversary import packctl
from support.paths import ROOT

README = (ROOT / "README.md").read_text()


def _blocks(language: str, after: str) -> list[str]:
    """The `language` blocks of the README from the heading `after` to the next `## ` heading."""
    section = README.split(after, 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def _commands(block: str) -> list[list[str]]:
    """The `packctl ...` lines of a bash block, as argv (comments dropped, `mpiexec -n N` too: one
    process writes what N do)."""
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    argvs = [argv[argv.index("packctl") + 1:] for argv in lines if "packctl" in argv]
    return [[a if a != "100000" else "400" for a in argv] for argv in argvs]  # a smaller corpus


def _run(argv: list[str]) -> None:
    result = packctl(*argv, *(["-q"] if argv[0] == "pack" else []))
    assert result.code == 0, f"packctl {shlex.join(argv)}: {result.stderr}"


@pytest.mark.slow
def test_the_quickstart_blocks_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quickstart = _blocks("bash", "## Quickstart")
    first = _commands(quickstart[0])
    assert [argv[0] for argv in first] == ["sample", "pack"]
    for argv in first:
        _run(argv)
    again = packctl(*first[1], "-q")  # the same pack again: its result is there
    assert again.code == 0 and again.lines == ["packed: already complete with these inputs and options; nothing to do"]
    exec(compile(_blocks("python", "## Quickstart")[0], "README.md", "exec"), {})
    (tmp_path / "pack.toml").write_text(_blocks("toml", "## Quickstart")[0])
    _run(["pack", "--config", "pack.toml"])
    for block in quickstart[1:]:
        for argv in _commands(block):
            if argv[0] in ("pack", "stats") and "corpus" in argv:  # the commands over the Quickstart corpus
                _run(argv)
    plan_only = re.search(r"`packctl (pack corpus -o plan [^`]*)`", README)[1]
    _run(shlex.split(plan_only))
    outputs = [p.name for p in tmp_path.iterdir() if (p / "_manifest.json").is_file()]
    assert sorted(outputs) == ["packed", "packed-api", "packed-shuffled", "packed-toml", "plan"]

"""The README run in a clone as written: its test command passes there with nothing beside the
clone (CI runs it so), and what its blocks write stays out of `git status`."""
from __future__ import annotations

import re

from support.paths import ROOT


def test_ci_runs_the_readmes_test_command_in_a_clone_with_nothing_beside_it():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"Run the tests.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    assert command.endswith("python -m pytest"), command
    ci = (ROOT / ".ci" / "run").read_text()
    clone = re.search(r'git clone -q \. "(\$\w+)/packctl"\n\(cd "\1/packctl" && (.*)\)\n', ci)
    assert clone, "no step that runs the tests in a fresh clone"
    assert _as_in_readme(clone.group(2)) == command


def test_ci_first_runs_the_readmes_core_tier_on_a_core_install():
    """The core tier runs before the full suite, in a venv of its own without extras."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"On a core install.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    assert "pip install . " in command and command.endswith('pytest -m "not torch and not mpi"'), command
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [line for line in ci.splitlines() if "python -m pytest" in line]
    assert _as_in_readme(steps[0]) == command and len(steps) == 3, steps


def _as_in_readme(line: str) -> str:
    """A test command of .ci/run as the README writes it: CI's pip runs quiet (-q) and its pytest
    lists the slowest tests (--durations)."""
    return re.sub(r" --durations=\d+$", "", line.replace("pip install -q ", "pip install "))


def test_every_output_the_readme_writes_is_ignored():
    readme = (ROOT / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```(?:bash|python|toml)\n(.*?)```", readme, re.S))
    written = set(re.findall(r"(?:-o |output *= *\[?\")([\w.-]+)", blocks))
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert {"out", "corpus", "packed", "corpus-eos", "packed-eos", "packed-olmo"} <= written  # the pattern reads them
    assert {f"/{name}/" for name in written} - ignored == set()
    assert "/pack.toml" in ignored  # the README's TOML example, saved as it says

"""What the README's blocks write, run in a clone as written, stays out of `git status`: every
`-o DIR` and `output="DIR"` of README.md is an ignored folder at the root in .gitignore."""
from __future__ import annotations

import re

from support.paths import ROOT


def test_every_output_the_readme_writes_is_ignored():
    readme = (ROOT / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```(?:bash|python|toml)\n(.*?)```", readme, re.S))
    written = set(re.findall(r"(?:-o |output *= *\[?\")([\w.-]+)", blocks))
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert {"out", "corpus", "packed", "corpus-eos", "packed-eos", "packed-olmo"} <= written  # the pattern reads them
    assert {f"/{name}/" for name in written} - ignored == set()
    assert "/pack.toml" in ignored  # the README's TOML example, saved as it says

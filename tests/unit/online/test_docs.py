"""docs/online.md's python blocks run as written and print what their comments say."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from support.docs import docs_block


def printed_and_promised(name: str) -> tuple[list[str], list[str]]:
    """What the block prints, line by line, and what its `print(...)  # VALUE` comments promise
    (the comment's text before a colon that explains it)."""
    block = docs_block(name, "online.md")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "docs/online.md", "exec"), {})
    promised = [re.split(r":\s", line.split("# ", 1)[1], maxsplit=1)[0].strip()
                for line in block.splitlines() if line.startswith("print(") and "# " in line]
    return out.getvalue().splitlines(), promised


@pytest.mark.parametrize("name", ["online-example", "nemo-rl", "verl", "ranks"])
def test_blocks_print_what_they_say(name):
    printed, promised = printed_and_promised(name)
    assert printed == promised


@pytest.mark.torch
def test_thd_batch_block():
    printed, promised = printed_and_promised("thd-batch")
    assert printed == promised

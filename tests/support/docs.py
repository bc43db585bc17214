"""The python blocks of docs/ that tests run as written."""
from __future__ import annotations

import re

from support.paths import DOCS


def docs_block(name: str, doc: str = "training.md") -> str:
    """The python block that follows `<!-- test: name -->` in docs/<doc>: the tests run the
    documented recipes as written."""
    text = (DOCS / doc).read_text()
    found = re.search(rf"<!-- test: {re.escape(name)} -->\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/{doc} has no python block after <!-- test: {name} -->"
    return found.group(1)


def run_docs_block(name: str, namespace: dict, doc: str = "training.md") -> dict:
    """Execute a documented block in `namespace` (what the reader has defined before it)."""
    exec(compile(docs_block(name, doc), str(DOCS / doc), "exec"), namespace)
    return namespace

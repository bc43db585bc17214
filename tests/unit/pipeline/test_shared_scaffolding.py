"""pack (pipeline/run.py) and materialize (pipeline/from_plan.py) share their scaffolding through
public modules (pipeline/outcome.py, packctl/runtime.py): no module of pipeline/ imports a private
name of another module."""
from __future__ import annotations

import ast
from pathlib import Path

import packctl.pipeline

PIPELINE = Path(packctl.pipeline.__file__).parent


def test_no_stage_imports_a_private_name_of_another_module():
    found = []
    for path in sorted(PIPELINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("packctl"):
                found += [f"{path.name}:{node.lineno} {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert len(list(PIPELINE.glob("*.py"))) > 5  # the folder is read
    assert not found, found

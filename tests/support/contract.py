"""The independent contract checker (../shared/contract/check_output.py), run in-process."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from support.paths import CHECKER


def load_checker():
    """The checker as a module, or None when the shared folder is not beside the repository."""
    if not CHECKER.exists():
        return None
    spec = importlib.util.spec_from_file_location("check_output", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_contract(contract, out: Path, sources: list[Path]) -> list[str]:
    """Run every rule of the checker in-process; returns the broken rules (empty when ok)."""
    manifest = json.loads((out / "_manifest.json").read_text())
    findings = contract.Findings()
    per_seq, toks, labs, _, _ = contract.check_shards(out, manifest, findings)
    files = []
    for s in sources:
        files += sorted(s.rglob("*.parquet")) if s.is_dir() else [s]
    contract.check_conservation(manifest, sorted(files), per_seq, toks, labs, findings)
    return findings.errors

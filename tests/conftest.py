from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = ROOT / "sample_data"
CHECKER = ROOT.parent / "shared" / "contract" / "check_output.py"


@pytest.fixture(scope="session")
def sample_data() -> Path:
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def contract():
    """The independent contract checker (../shared/contract/check_output.py) as a module."""
    if not CHECKER.exists():
        pytest.skip(f"contract checker not found at {CHECKER} (it lives in the shared folder beside the repo)")
    spec = importlib.util.spec_from_file_location("check_output", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_contract(contract, out: Path, sources: list[Path]) -> list[str]:
    """Run every rule of the checker in-process; returns the broken rules (empty when ok)."""
    import json

    manifest = json.loads((out / "_manifest.json").read_text())
    findings = contract.Findings()
    per_seq, toks, labs, _, _ = contract.check_shards(out, manifest, findings)
    files = []
    for s in sources:
        files += sorted(s.rglob("*.parquet")) if s.is_dir() else [s]
    contract.check_conservation(manifest, sorted(files), per_seq, toks, labs, findings)
    return findings.errors


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packctl.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def write_table(path: Path, columns: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def packed_on_ranks(tmp_path: Path, ranks: int, **options) -> Path:
    """Pack `options` in one process (tmp_path/one) and on `ranks` in-process ranks (tmp_path/many);
    assert every manifest's shards (each epoch's too) have the same sha256; return tmp_path/many."""
    import json

    from threadcomm import run_ranks

    options.setdefault("overwrite", True)
    pack(PackConfig(output=str(tmp_path / "one"), **options))
    run_ranks(ranks, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **options), comm=comm))
    manifests = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("_manifest.json"))
    assert manifests
    for name in manifests:
        digests = [[s["sha256"] for s in json.loads((tmp_path / d / name).read_text())["shards"]]
                   for d in ("one", "many")]
        assert digests[0] == digests[1], name
    return tmp_path / "many"


def pack_to(tmp_path: Path, inputs, **options):
    out = tmp_path / "out"
    options.setdefault("overwrite", True)
    return pack(PackConfig(inputs=[str(p) for p in inputs], output=str(out), **options)), out


def docs_block(name: str, doc: str = "training.md") -> str:
    """The python block that follows `<!-- test: name -->` in docs/<doc>: the tests run the
    documented recipes as written."""
    import re

    text = (ROOT / "docs" / doc).read_text()
    found = re.search(rf"<!-- test: {re.escape(name)} -->\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/{doc} has no python block after <!-- test: {name} -->"
    return found.group(1)


def run_docs_block(name: str, namespace: dict, doc: str = "training.md") -> dict:
    """Execute a documented block in `namespace` (what the reader has defined before it)."""
    exec(compile(docs_block(name, doc), str(ROOT / "docs" / doc), "exec"), namespace)
    return namespace

"""Runs of packctl as tests need them: the CLI in a process of its own, `pack` in-process, and the
same options on one process and on N in-process ranks with their shards compared."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from packctl import PackConfig, pack


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`packctl ARGS...` as a user runs it (`python -m packctl`), output captured as text."""
    return subprocess.run([sys.executable, "-m", "packctl", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def pack_to(tmp_path: Path, inputs, **options):
    """`pack` of `inputs` into tmp_path/out (replaced if there); returns (PackResult, OUT)."""
    out = tmp_path / "out"
    options.setdefault("overwrite", True)
    return pack(PackConfig(inputs=[str(p) for p in inputs], output=str(out), **options)), out


def packed_on_ranks(tmp_path: Path, ranks: int, **options) -> Path:
    """Pack `options` in one process (tmp_path/one) and on `ranks` in-process ranks (tmp_path/many);
    assert every manifest's shards (each epoch's too) have the same sha256; return tmp_path/many."""
    from support.threadcomm import run_ranks

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


def assert_ranks_shared_the_run(metrics: dict, ranks: int, sequences: int) -> None:
    """_metrics.json of a run on `ranks` ranks: every rank reported, the ranks scanned every sequence
    and wrote every pack between them."""
    if ranks > 1:
        assert len(metrics["ranks"]) == ranks
        assert sum(r["sequences_scanned"] for r in metrics["ranks"]) == sequences
        assert sum(r["packs_written"] for r in metrics["ranks"]) == metrics["packs"]
        assert metrics["scale_out"]["ranks"] == ranks

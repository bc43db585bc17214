"""benchmarks/gpu/run_all.sh --dry-run: the GPU run's steps on the CPU, with tiny corpora and the
sdpa backend, fill the same results file the GPU run fills (docs/verify.md, "flash-attn on a GPU")."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.paths import ROOT

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.torch]  # about a minute: packs, verifies, trains


def test_dry_run_fills_every_table_of_the_results(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run_all.sh"), "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--budget-s", "400"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] and results["device"] == "cpu"
    assert [s["status"] for s in results["steps"]] == ["ok"] * len(results["steps"])
    outputs = ["sample, 1024", "rl-longtail, 2048", "rl-longtail, 2048, cp 2"]
    rows = {(r["output"], r["backend"], r["dtype"]): r for r in results["attention"]}
    for output in outputs:
        for dtype in ("bf16", "fp16"):
            row = rows[output, "sdpa", dtype]
            assert row["status"] == "ok" and 0 < row["max_error_packed"] <= row["bound"]
    assert {r["output"] for r in results["bench"]} >= set(outputs)
    assert all(r["speedup"] > 0 and r["tokens_packed"] > 0 for r in results["bench"])
    assert [r["status"] for r in results["cp"]] == ["ok"]
    assert results["equivalence"]["passed"] >= 1 and results["equivalence"]["rc"] == 0
    assert [s[0] for s in results["train"]["steps"]] == [0, 1] and results["train"]["max_diff"] <= 1e-5
    assert results["environment"]["torch"] and results["environment"]["device_name"].startswith("CPU")
    table = (out / "results.md").read_text()
    for heading in ("## Attention: backends x dtypes", "## Packed vs padded", "## Loss and gradient equivalence",
                    "## Train example"):
        assert heading in table
    assert "| rl-longtail, 2048, cp 2 | sdpa | block-diagonal causal mask | fp16 |" in table
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]  # what $OUT brings back

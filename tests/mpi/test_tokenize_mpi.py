"""`packctl tokenize` under mpiexec: 1, 2 and 3 ranks write the same bytes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import MPIEXEC
from support.tokenizers import CHATML, tokenizer_dir

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install 'packctl[mpi]')")


def test_one_two_and_three_ranks_write_the_same_bytes(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok", template=CHATML)
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, first in (("a.jsonl", 0), ("b.jsonl", 23)):
        with open(raw / name, "w") as fh:
            for i in range(first, first + 23):
                chat = [{"role": "user", "content": f"what is {i} squared?"},
                        {"role": "assistant", "content": f"{i * i}"}]
                fh.write(json.dumps({"messages": chat}) + "\n")
    written = {}
    for ranks in (1, 2, 3):
        out = tmp_path / f"out{ranks}"
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "packctl", "tokenize", str(raw), "-o", str(out),
               "--tokenizer", str(tok), "--shard-records", "5", "--workers", "1", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        written[ranks] = {p.name: p.read_bytes() for p in sorted((out / "data").iterdir())}
        counts = json.loads((out / "_manifest.json").read_text())["counts"]
        assert counts["records"] == counts["rows"] == 46
    assert len(written[1]) == 10  # 23 records a file, by 5
    assert written[1] == written[2] == written[3]

"""`packctl pack --tokenizer` under mpiexec: 1 and 2 ranks, each tokenizing its own blocks of
raw chat records, write the same bytes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.paths import MPIEXEC
from support.tokenizers import CHATML, tokenizer_dir

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install 'packctl[mpi]')")]


def test_one_and_two_ranks_write_the_same_bytes(tmp_path):
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
    for ranks in (1, 2):
        out = tmp_path / f"out{ranks}"
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "packctl", "pack", str(raw), "-o", str(out),
               "--tokenizer", str(tok), "--capacity", "128", "--too-long", "split", "--shard-rows", "3", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        written[ranks] = {p.name: p.read_bytes() for p in sorted((out / "data").iterdir())}
        assert json.loads((out / "_manifest.json").read_text())["counts"]["sequences_in"] == 46
    assert len(written[1]) > 1
    assert written[1] == written[2]

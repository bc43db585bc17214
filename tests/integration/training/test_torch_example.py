"""docs/examples/train_tiny.py runs and its packed and unpacked losses agree."""
from __future__ import annotations

import importlib.util
import sys

import pytest
from support.paths import DOCS

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = DOCS / "examples" / "train_tiny.py"

pytestmark = pytest.mark.slow  # a proof on a real model (tiny Llama, CPU)


@pytest.mark.parametrize("attention", ["hf", "sdpa"])
def test_train_tiny_prints_matching_losses(attention, monkeypatch, capsys):
    """hf: transformers' SDPA finds the boundaries from position_ids; sdpa: packctl's varlen
    kernel, registered as a transformers attention, takes them from cu_seq_lens (the path
    flash-attn runs on a GPU)."""
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["train_tiny.py", "--steps", "2", "--packs-per-step", "2", "--attention", attention])
    module.main()
    lines = capsys.readouterr().out.splitlines()
    assert f"attention {attention} on cpu" in lines[0]
    steps = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(s[0]) for s in steps] == [0, 1]
    for step in steps:
        packed, unpacked, diff = float(step[2]), float(step[3]), float(step[4])
        assert abs(packed - unpacked) <= 1e-5 and diff <= 1e-5
    assert float(steps[1][2]) < float(steps[0][2])  # it trains

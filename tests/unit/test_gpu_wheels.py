"""benchmarks/gpu/wheels.py: wheels split into parts and carry batches here come back whole there."""
from __future__ import annotations

import importlib.util
import os

import pytest

from support.paths import ROOT

spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "benchmarks" / "gpu" / "wheels.py")
wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheels)

KIB = 1024 / wheels.MIB  # sizes in MiB as the options take them


@pytest.fixture
def fetched(tmp_path):
    """Three 'wheels' of 3000, 700 and 10 bytes in root/full, as fetch_wheels.sh leaves them."""
    full = tmp_path / "whl" / "full"
    full.mkdir(parents=True)
    for name, size in [("big-1-py3-none-any.whl", 3000), ("mid-1-py3-none-any.whl", 700), ("tiny-1-py3-none-any.whl", 10)]:
        (full / name).write_bytes(os.urandom(size))
    return tmp_path / "whl"


def test_split_keeps_each_batch_under_its_limit_and_join_restores_every_byte(fetched, tmp_path):
    batches = wheels.split(fetched, batch_mib=2 * KIB, part_mib=1 * KIB)  # parts of 1 KiB, batches of 2 KiB
    assert [b.name for b in batches] == ["1", "2"]
    for batch in batches:
        assert sum(p.stat().st_size for p in batch.iterdir() if p.name != wheels.SUMS) <= 2048
    assert sorted(p.name for b in batches for p in b.iterdir() if p.name.startswith("big")) == [
        f"big-1-py3-none-any.whl.part-00{i}" for i in range(3)]

    carried, stage = tmp_path / "carried", tmp_path / "stage"
    carried.mkdir()
    os.rename(batches[0], carried / "1")
    assert wheels.join(carried, stage) == 3  # one batch of two: parts still missing
    os.rename(carried / "1", tmp_path / "done-1")
    os.rename(batches[1], carried / "2")
    assert wheels.join(carried, stage) == 0
    for original in (fetched / "full").iterdir():
        assert (stage / "full" / original.name).read_bytes() == original.read_bytes()


def test_join_refuses_parts_that_do_not_match_their_hash(fetched, tmp_path):
    (batch,) = wheels.split(fetched, batch_mib=1, part_mib=1 * KIB)
    part = batch / "big-1-py3-none-any.whl.part-001"
    part.write_bytes(bytes(part.stat().st_size))
    assert wheels.join(fetched, tmp_path / "stage") == 2
    assert not (tmp_path / "stage" / "full" / "big-1-py3-none-any.whl").exists()

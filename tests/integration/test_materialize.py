"""Bounded-memory materialize: same bytes whatever the budget, spills cleaned up, blocks read once."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from support.contract import check_contract
from support.runs import pack_to
from packctl.pipeline.assign import shard_bounds


@pytest.fixture(scope="module")
def row_group_corpus(tmp_path_factory, sample_data):
    """sample_data rewritten with 64-row row groups: many blocks per file."""
    out = tmp_path_factory.mktemp("rg")
    for path in sorted(sample_data.glob("*.parquet")):
        pq.write_table(pq.read_table(path), out / path.name, row_group_size=64)
    return out


def _hashes(out):
    return [s["sha256"] for s in json.loads((out / "_manifest.json").read_text())["shards"]]


def test_shard_bounds_never_straddle_windows():
    assert shard_bounds(np.array([0, 5, 7]), 2).tolist() == [0, 2, 4, 5, 7]
    assert shard_bounds(np.array([0, 3]), 10).tolist() == [0, 3]
    assert shard_bounds(np.array([0]), 4).tolist() == [0]


@pytest.mark.parametrize("order", ["input", "shuffle", "curriculum"])
def test_same_bytes_whatever_the_budget(tmp_path, row_group_corpus, sample_data, contract, order):
    options = dict(capacity=2048, order=order, too_long="split", shard_rows=64, window=900)
    big, out_big = pack_to(tmp_path / "big", [row_group_corpus], **options)
    small, out_small = pack_to(tmp_path / "small", [row_group_corpus], memory_budget=200_000, **options)
    assert _hashes(out_big) == _hashes(out_small)
    assert len(_hashes(out_big)) > 5
    # with room for everything the input is read once; with 200 kB it is read twice and spills
    assert big.metrics["throughput"]["blocks_read_twice"] == 0
    assert big.metrics["throughput"]["spill_files"] == 0
    assert small.metrics["throughput"]["blocks_read_twice"] > 0
    if order != "input":
        assert small.metrics["throughput"]["spill_files"] > 0
    assert not (out_small / ".spill").exists()
    assert check_contract(contract, out_small, [sample_data]) == []


def test_blocks_and_file_rows_in_errors(tmp_path, row_group_corpus):
    # corrupt one row deep in a file: the error names the row of the file, not of its row group
    import pyarrow as pa

    path = row_group_corpus / "shard-00002.parquet"
    table = pq.read_table(path)
    ids = table.column("input_ids").to_pylist()
    ids[200] = ids[200][:3] + [-5] + ids[200][4:]
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(table.set_column(0, "input_ids", pa.array(ids, pa.list_(pa.int32()))), bad / "x.parquet",
                   row_group_size=64)
    from packctl import PackctlError

    with pytest.raises(PackctlError, match=r"x.parquet row 200 column 'input_ids': value -5 at position 3"):
        pack_to(tmp_path, [bad], capacity=8192)

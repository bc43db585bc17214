"""--keep-columns: per-sequence input columns carried into the packs, aligned with sample_ids."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.contract import check_contract
from support.adversary import packctl
from support.runs import pack_to
from support.data import write_table
from packctl import PackConfig, PackctlError, pack
from packctl.stats import stats
from support.threadcomm import run_ranks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("keep") / "in"
    gid = 0
    for f, rows in enumerate((40, 25)):
        lengths = rng.integers(1, 90, rows)
        ids = [rng.integers(1, 1000, n).tolist() for n in lengths]
        write_table(root / f"part-{f}.parquet", {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "doc_id": pa.array([f"doc-{gid + k}" for k in range(rows)]),
            "weight": pa.array((np.arange(rows) + gid) / 10.0),
        })
        gid += rows
    return root


def _kept(out, column):
    """(sample_ids, values) of every pack, flattened, in output order."""
    manifest = json.loads((out / "_manifest.json").read_text())
    ids, values = [], []
    for shard in manifest["shards"]:
        table = pq.read_table(out / shard["path"])
        for sample_ids, kept in zip(table.column("sample_ids").to_pylist(), table.column(column).to_pylist()):
            assert len(sample_ids) == len(kept)  # aligned with sample_ids, pack by pack
            ids += sample_ids
            values += kept
    return ids, values


def test_kept_values_follow_their_sequences_into_the_packs(tmp_path, corpus, contract):
    _, out = pack_to(tmp_path, [corpus], capacity=64, too_long="split", order="shuffle", algorithm="bfd",
                     keep_columns=["doc_id", "weight"], shard_rows=3)
    ids, docs = _kept(out, "doc_id")
    _, weights = _kept(out, "weight")
    assert docs == [f"doc-{g}" for g in ids]  # split sequences repeat their value in every piece
    assert weights == pytest.approx([g / 10.0 for g in ids])
    assert len(ids) > 65  # some sequences were split
    assert check_contract(contract, out, [corpus]) == []
    schema = pq.read_schema(next(out.glob("data/*.parquet")))
    assert schema.field("doc_id").type == pa.list_(pa.string())
    # the readers take the output with its extra columns (the loader where torch is installed)
    assert stats([str(out)])["packs"] > 0
    if importlib.util.find_spec("torch") is not None:
        from packctl.torch import PackedDataset

        assert len(PackedDataset(out)[0]["input_ids"]) == 64


def test_several_ranks_write_the_same_kept_columns(tmp_path, corpus):
    options = dict(inputs=[str(corpus)], capacity=64, too_long="split", order="shuffle", keep_columns=["doc_id"],
                   shard_rows=3, window=30, overwrite=True)
    pack(PackConfig(output=str(tmp_path / "one"), **options))
    run_ranks(3, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **options), comm=comm))
    one, many = (sorted((tmp_path / name).glob("data/*.parquet")) for name in ("one", "many"))
    assert len(one) == len(many) > 1
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in many]


def test_keep_columns_on_the_command_line(tmp_path, corpus):
    proc = packctl("pack", str(corpus), "-o", str(tmp_path / "out"), "--capacity", "128", "--too-long", "split",
                   "--keep-columns", "doc_id", "--keep-columns", "weight", "-q")
    assert proc.code == 0, proc.stderr
    assert {"doc_id", "weight"} <= set(pq.read_schema(tmp_path / "out" / "data" / "train-00000.parquet").names)


@pytest.mark.parametrize("columns, message", [
    (["nope"], "part-0.parquet: no column 'nope' to keep"),
    (["sample_ids"], "--keep-columns sample_ids: that name is an input or output column"),
    (["input_ids"], "--keep-columns input_ids: that name is an input or output column"),
    (["doc_id", "doc_id"], "a column is named twice"),
])
def test_bad_kept_columns_are_refused_before_anything_is_written(tmp_path, corpus, columns, message):
    with pytest.raises(PackctlError, match=message):
        pack(PackConfig(inputs=[str(corpus)], output=str(tmp_path / "out"), capacity=128, too_long="split",
                        keep_columns=columns))
    assert not (tmp_path / "out").exists()


def test_a_kept_column_of_another_type_in_one_file_is_named(tmp_path):
    write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
                                            "w": pa.array([1.0])})
    write_table(tmp_path / "in/b.parquet", {"input_ids": pa.array([[3]], pa.list_(pa.int32())),
                                            "w": pa.array(["x"])})
    with pytest.raises(PackctlError, match=r"b.parquet: column 'w' is .* here and .* in the files before"):
        pack(PackConfig(inputs=[str(tmp_path / "in")], output=str(tmp_path / "out"), capacity=8, keep_columns=["w"]))

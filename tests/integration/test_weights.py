"""--weight-column: one float weight per sequence, carried into the packs as `seq_weights`, aligned
with sample_ids, compared with the source by sample id; refused when null or not finite."""
from __future__ import annotations

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
from packctl.verify import VerifyOptions, verify
from support.threadcomm import run_ranks


def _weight(gid: int) -> float:
    return float(np.float32(1.0 / (gid + 3)))  # exact in float32: what the input holds


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two files, lengths 1-119 (over the capacity 64 of the tests: split or dropped), weights 1/(gid+3)."""
    rng = np.random.default_rng(1)
    root = tmp_path_factory.mktemp("weights") / "in"
    gid = 0
    for f, rows in enumerate((40, 25)):
        ids = [rng.integers(1, 1000, n).tolist() for n in rng.integers(1, 120, rows)]
        write_table(root / f"part-{f}.parquet", {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "weight": pa.array([_weight(gid + k) for k in range(rows)], pa.float32()),
        })
        gid += rows
    return root


def _weights(out):
    """(sample_ids, seq_weights) of every pack, flattened, in output order."""
    ids, weights = [], []
    for shard in json.loads((out / "_manifest.json").read_text())["shards"]:
        table = pq.read_table(out / shard["path"], columns=["sample_ids", "seq_weights"])
        for sample_ids, w in zip(table.column("sample_ids").to_pylist(), table.column("seq_weights").to_pylist()):
            assert len(sample_ids) == len(w)
            ids += sample_ids
            weights += w
    return ids, weights


@pytest.mark.parametrize("too_long", ["split", "drop"])
def test_each_sequence_keeps_its_own_weight(tmp_path, corpus, contract, too_long):
    _, out = pack_to(tmp_path, [corpus], capacity=64, too_long=too_long, order="shuffle", weight_column="weight",
                     dp_size=2, micro_batches=2)
    ids, weights = _weights(out)
    assert weights == [_weight(g) for g in ids]  # exact: neither scaled nor moved to another sequence
    manifest = json.loads((out / "_manifest.json").read_text())
    counts = manifest["counts"]
    assert len(set(ids)) == counts["sequences_packed"] == 65 - counts["sequences_dropped"]
    if too_long == "split":
        assert len(ids) > len(set(ids)) and counts["sequences_split"] > 0  # pieces repeat the weight
    else:
        assert counts["sequences_dropped"] > 0  # dropped sequences take their weight with them
    assert pq.read_schema(next(out.glob("data/*.parquet"))).field("seq_weights").type.value_type == pa.float64()
    assert check_contract(contract, out, [corpus]) == []
    assert verify(out, VerifyOptions(attention=False)).ok


def test_ranks_write_the_single_process_bytes(tmp_path, corpus):
    options = dict(inputs=[str(corpus)], capacity=64, too_long="split", order="shuffle", weight_column="weight",
                   token_transfer="exchange", overwrite=True)
    pack(PackConfig(output=str(tmp_path / "one"), **options))
    run_ranks(2, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **options), comm=comm))
    shards = [[s["sha256"] for s in json.loads((tmp_path / d / "_manifest.json").read_text())["shards"]]
              for d in ("one", "many")]
    assert shards[0] == shards[1]


@pytest.mark.parametrize("bad, shown", [(None, "null"), (float("nan"), "nan"), (float("inf"), "inf")])
def test_a_null_or_non_finite_weight_is_named(tmp_path, bad, shown):
    weights = [1.0, 0.5, bad, 2.0]
    path = write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[1, 2, 3]] * 4,
                                                       "w": pa.array(weights, pa.float64())})
    with pytest.raises(PackctlError) as info:
        pack_to(tmp_path, [path], capacity=16, weight_column="w")
    assert str(info.value).startswith(f"{path} row 2 column 'w': weight {shown}")
    proc = packctl("pack", str(path), "-o", str(tmp_path / "cli"), "--capacity", "16", "--weight-column", "w")
    assert proc.code == 2 and f"{path} row 2 column 'w'" in proc.stderr


def test_a_missing_or_non_numeric_weight_column_is_refused(tmp_path):
    path = write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[1, 2, 3]], "name": ["x"]})
    with pytest.raises(PackctlError, match="no column 'w' for --weight-column"):
        pack_to(tmp_path, [path], capacity=16, weight_column="w")
    with pytest.raises(PackctlError, match="column 'name' is string; --weight-column needs one number"):
        pack_to(tmp_path, [path], capacity=16, weight_column="name")

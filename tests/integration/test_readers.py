"""An output directory is a Parquet dataset: every common reader takes OUT itself, with no extra
arguments, and reads exactly the packs (format version 2: shards under data/, reports under names
dataset readers skip). Outputs of format version 1 (manifest.json and part-*.parquet at OUT's
root) are still read by verify, stats and packctl.torch.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from support.runs import pack_to
from packctl.contract.manifest import sha256_file
from packctl.contract.schema import METADATA_KEY
from packctl.stats import stats
from packctl.verify import VerifyOptions, verify

NO_ATTENTION = dict(attention=False)


@pytest.fixture(scope="module")
def out(tmp_path_factory, sample_data) -> Path:
    # several shards, so a reader that took one file, or the files out of order, is caught
    return pack_to(tmp_path_factory.mktemp("readers"), [sample_data], capacity=2048, too_long="split",
                   shard_rows=100)[1]


@pytest.fixture(scope="module")
def packs(out) -> pa.Table:
    """The packs as the manifest lists them, shard by shard."""
    manifest = json.loads((out / "_manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    return pa.concat_tables([pq.read_table(out / s["path"]) for s in manifest["shards"]])


def test_layout_on_disk(out):
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    shards = [n for n in names if n.endswith(".parquet")]
    assert set(names) == {"_manifest.json", "_metrics.json", "data", *shards}
    assert shards == [f"data/train-{k:05d}.parquet" for k in range(len(shards))]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["format_version"] == 2 and [s["path"] for s in manifest["shards"]] == shards


def _same_packs(table: pa.Table, packs: pa.Table) -> None:
    """Same rows in the same order (readers that sort nothing keep file order: shard by shard)."""
    assert table.num_rows == packs.num_rows
    for name in ("sample_ids", "input_ids", "seq_lengths"):
        assert table.column(name).combine_chunks().equals(packs.column(name).combine_chunks()), name


def _hf_table(dataset) -> pa.Table:
    return dataset.data.table if hasattr(dataset.data, "table") else dataset.data


READERS = {
    "pyarrow.parquet.read_table(OUT)": lambda out: pq.read_table(out),
    "pyarrow.dataset.dataset(OUT)": lambda out: pads.dataset(out).to_table(),
    "polars.scan_parquet(OUT/**/*.parquet)": lambda out: __import__("polars").scan_parquet(
        f"{out}/**/*.parquet").collect().to_arrow(),
    "polars.scan_parquet(OUT/data)": lambda out: __import__("polars").scan_parquet(out / "data").collect().to_arrow(),
    "datasets.load_dataset(OUT)": lambda out: _hf_table(
        __import__("datasets").load_dataset(str(out), split="train")),
    "datasets.load_dataset('parquet', data_dir=OUT)": lambda out: _hf_table(
        __import__("datasets").load_dataset("parquet", data_dir=str(out), split="train")),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_reader_takes_the_output_directory(reader, out, packs):
    if "polars" in reader:
        pytest.importorskip("polars")
    if "datasets" in reader:
        pytest.importorskip("datasets")
    table = READERS[reader](out)
    if "polars" in reader:  # polars reads lists as large_list; the values are what matter
        table = table.cast(pa.schema([(f.name, packs.schema.field(f.name).type) for f in table.schema]))
    _same_packs(table, packs)


def _as_version_1(out: Path, target: Path) -> Path:
    """The same packs laid out as format version 1 wrote them: part-*.parquet and manifest.json at
    OUT's root, format_version 1 in the manifest and the shards' `packctl` metadata, no seq_lengths."""
    target.mkdir()
    manifest = json.loads((out / "_manifest.json").read_text())
    for k, entry in enumerate(manifest["shards"]):
        table = pq.read_table(out / entry["path"]).drop_columns(["seq_lengths"])
        meta = json.loads(table.schema.metadata[METADATA_KEY])
        meta["format_version"] = 1
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
        entry["path"] = f"part-{k:05d}.parquet"
        pq.write_table(table, target / entry["path"])
        entry["sha256"] = sha256_file(target / entry["path"])
    manifest["format_version"] = 1
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2))
    shutil.copy(out / "_metrics.json", target / "metrics.json")
    return target


def test_version_1_outputs_are_still_read(out, tmp_path, sample_data):
    old = _as_version_1(out, tmp_path / "v1")
    report = verify(old, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    assert report.exit_code == 0, [str(v) for v in report.violations]
    assert stats([str(old)])["packs"] == stats([str(out)])["packs"]


@pytest.mark.torch
def test_version_1_outputs_are_still_read_by_the_loader(out, tmp_path):
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    old = _as_version_1(out, tmp_path / "v1")
    new, legacy = PackedDataset(out), PackedDataset(old)
    assert len(new) == len(legacy) and np.array_equal(new[7]["input_ids"], legacy[7]["input_ids"])


def test_version_2_output_without_seq_lengths_fails_verify(out, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    manifest = json.loads((broken / "_manifest.json").read_text())
    entry = manifest["shards"][0]
    pq.write_table(pq.read_table(broken / entry["path"]).drop_columns(["seq_lengths"]), broken / entry["path"])
    entry["sha256"] = sha256_file(broken / entry["path"])
    (broken / "_manifest.json").write_text(json.dumps(manifest))
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    assert [(v.rule, v.shard) for v in report.violations] == [("schema", "data/train-00000.parquet")]
    assert "seq_lengths is missing" in report.violations[0].message

"""The referee of tests/support/referee.py, which `assert_every_sample_once` uses in a clone with
nothing beside it: it accepts what `--too-long split`, `drop`, `truncate` and a `--limit` leave, and
finds a token changed, a sample lost and a count that lies."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import support.adversary as adversary
from support.adversary import assert_every_sample_once, packctl
from support.data import write_table
from support.referee import every_sample_once

LENGTHS = [3, 20, 5, 7, 1, 9, 30, 4, 6, 2]  # rows 1 and 6 are over --capacity 16
IMAGES = [0, 1, 0, 3, 0, 1, 0, 0, 2, 0]  # row 3 is over --limit images=2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two files, 10 rows; labels differ from the tokens so that a label from the wrong place shows."""
    folder = tmp_path_factory.mktemp("referee")
    first = 1
    for name, rows in (("a.parquet", slice(0, 6)), ("b.parquet", slice(6, 10))):
        lengths = LENGTHS[rows]
        tokens = [list(range(first + sum(lengths[:i]), first + sum(lengths[:i + 1]))) for i in range(len(lengths))]
        first += sum(lengths)
        write_table(folder / name, {"input_ids": pa.array(tokens, pa.list_(pa.int32())),
                                    "labels": pa.array([[1000 + t for t in row] for row in tokens], pa.list_(pa.int32())),
                                    "images": pa.array(IMAGES[rows], pa.int32())})
    return folder


@pytest.fixture(scope="module")
def outputs(corpus, tmp_path_factory) -> dict[str, Path]:
    """corpus packed at --capacity 16 under each way of treating a sample that does not fit."""
    base = tmp_path_factory.mktemp("referee-out")
    runs = {"split": ["--too-long", "split"], "truncate": ["--too-long", "truncate"],
            "drop": ["--too-long", "drop"], "over-limit": ["--too-long", "drop", "--limit", "images=2"]}
    for name, flags in runs.items():
        result = packctl("pack", corpus, "-o", base / name, "--capacity", "16", "--shard-rows", "2", *flags, "-q")
        assert result.code == 0, result.stderr
    return {name: base / name for name in runs}


@pytest.mark.parametrize("name, counted", [
    ("split", {"sequences_split": 2}), ("truncate", {"sequences_truncated": 2}),
    ("drop", {"sequences_dropped": 2}), ("over-limit", {"sequences_dropped": 3, "over_limit": 1}),
])
def test_the_referee_accepts_what_the_manifest_accounts_for(outputs, corpus, monkeypatch, name, counted):
    counts = json.loads((outputs[name] / "_manifest.json").read_text())["counts"]
    assert {key: counts[key] for key in counted} == counted  # the case is the one named
    assert every_sample_once(outputs[name], [corpus]) == []
    monkeypatch.setattr(adversary, "load_checker", lambda: None)  # as in a clone with nothing beside it
    assert_every_sample_once(outputs[name], [corpus])


def _copy(out: Path, to: Path) -> Path:
    shutil.copytree(out, to)
    return to


def _rewrite_first_shard(out: Path, change) -> None:
    """Apply `change` to the first shard's columns (name -> Python lists) and write it back."""
    manifest = json.loads((out / "_manifest.json").read_text())
    path = out / manifest["shards"][0]["path"]
    table = pq.read_table(path)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    change(columns)
    pq.write_table(pa.table({name: pa.array(columns[name], table.schema.field(name).type)
                             for name in table.column_names}, schema=table.schema), path)


def _bump_first_token(columns):
    columns["input_ids"][0][0] += 1


def _lose_a_sample(columns):
    """The last sequence of the first pack that holds two leaves OUT (its padding stays)."""
    row = next(r for r, ids in enumerate(columns["sample_ids"]) if len(ids) > 1)
    for name in ("sample_ids", "seq_lens", "cu_seqlens_padded"):
        columns[name][row].pop()


def _relabel_second_token(columns):
    columns["labels"][0][1] += 1


@pytest.mark.parametrize("case, change, finding", [
    ("a token changed", _bump_first_token, "do not rebuild"),
    ("a sample lost", _lose_a_sample, "1 samples dropped in OUT; the manifest counts sequences_dropped=0"),
    ("a label changed", _relabel_second_token, "labels of its sequence"),
])
def test_the_referee_finds_what_breaks_conservation(outputs, corpus, tmp_path, case, change, finding):
    out = _copy(outputs["split"], tmp_path / "out")
    _rewrite_first_shard(out, change)
    errors = every_sample_once(out, [corpus])
    assert any(finding in line for line in errors), errors


@pytest.mark.parametrize("key", ["sequences_split", "sequences_truncated", "sequences_dropped"])
def test_the_referee_holds_the_manifest_to_its_counts(outputs, corpus, tmp_path, key):
    out = _copy(outputs["split"], tmp_path / "out")
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest["counts"][key] += 1
    (out / "_manifest.json").write_text(json.dumps(manifest))
    assert any(f"{key}=" in line for line in every_sample_once(out, [corpus]))


def test_the_referee_reads_a_sliced_column(tmp_path):
    """A shard written from a slice of a table (offsets that start past 0) reads as its rows."""
    from support.referee import _rows

    column = pa.chunked_array([pa.array([[1], [2, 3], [4, 5, 6]], pa.list_(pa.int32())).slice(1)])
    assert [row.tolist() for row in _rows(column)] == [[2, 3], [4, 5, 6]]
    assert np.asarray(_rows(column)[0]).dtype == np.int64


def test_the_referee_tells_files_of_one_name_apart(tmp_path):
    """data/a.parquet and data/sub/a.parquet: sample ids run through the files in the manifest's
    order, matched by path, not by name."""
    write_table(tmp_path / "data/a.parquet", {"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))})
    write_table(tmp_path / "data/sub/a.parquet", {"input_ids": pa.array([[4, 5, 6]], pa.list_(pa.int32()))})
    assert packctl("pack", tmp_path / "data", "-o", tmp_path / "out", "--capacity", "8", "-q").code == 0
    assert every_sample_once(tmp_path / "out", [tmp_path / "data"]) == []

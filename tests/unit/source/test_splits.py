"""Dataset splits in a directory INPUT (source/splits.py): found as `datasets` finds them, refused
without --split, selected with it; a directory of one split packs as any directory."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from packctl.source.splits import select_split, split_files
from support.adversary import assert_clean_error, assert_every_sample_once, assert_nothing_left, packctl
from support.data import write_table

LAYOUTS = [
    ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-00000-of-00001.parquet"],
    ["train-0.parquet", "test-0.parquet"],
    ["train.parquet", "validation.parquet", "test.parquet"],
    ["train/a.parquet", "test/b.parquet"],
    ["training/a.parquet", "eval/b.parquet", "dev/c.parquet"],
    ["wiki.train.parquet", "wiki.test.parquet"],
    ["my_train_1.parquet", "my_val_1.parquet"],
    ["a.parquet", "b.parquet"],
    ["trainer.parquet", "contest.parquet"],
    ["train-0.parquet", "x.parquet"],
    ["sub/train/a.parquet", "sub/valid/b.parquet"],
    ["train_2024/a.parquet", "test_2024/a.parquet"],
    ["data/custom-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"],
    ["data/train-00000-of-00001.parquet", "extra/test.parquet"],
    ["train/test-0.parquet", "train/test-1.parquet", "valid/x.parquet"],
]


@pytest.mark.parametrize("files", LAYOUTS, ids=lambda f: "+".join(f))
def test_splits_are_those_datasets_finds(tmp_path, files):
    """The reference: `datasets.data_files`, which `load_dataset(DIR)` uses (a directory without
    split names is one `train` split there, and no split here)."""
    data_files = pytest.importorskip("datasets.data_files")
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    found = data_files.DataFilesDict.from_patterns(data_files.get_data_patterns(str(tmp_path)),
                                                   base_path=str(tmp_path))
    theirs = {str(split): sorted(os.path.relpath(f, tmp_path) for f in paths) for split, paths in found.items()}
    ours = {split: sorted(paths) for split, paths in split_files(sorted(files)).items()}
    assert ours == ({} if theirs == {"train": sorted(files)} and not ours else theirs)


def test_select_split():
    files = ["data/test-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"]
    assert select_split("hub", files, "train") == ["data/train-00000-of-00001.parquet"]
    assert select_split("hub", ["a.parquet", "train-0.parquet"], None) == ["a.parquet", "train-0.parquet"]
    with pytest.raises(Exception, match="pass --split NAME \\(one of train, test\\)"):
        select_split("hub", files, None)


@pytest.fixture
def hub(tmp_path) -> Path:
    """The Hub's sharded layout: two train shards and a test shard."""
    write_table(tmp_path / "hub/data/train-00000-of-00002.parquet", {"input_ids": [[1, 2, 3], [4, 5]]})
    write_table(tmp_path / "hub/data/train-00001-of-00002.parquet", {"input_ids": [[6, 7], [8]]})
    write_table(tmp_path / "hub/data/test-00000-of-00001.parquet", {"input_ids": [[9, 9, 9]]})
    return tmp_path / "hub"


def test_a_directory_of_splits_is_refused_without_split(tmp_path, hub):
    for argv in (["pack", hub, "-o", tmp_path / "out", "--capacity", "8", "-q"], ["stats", hub, "--capacity", "8"]):
        assert_clean_error(packctl(*argv), 2, f"{hub}: holds the dataset splits test "
                           "(data/test-00000-of-00001.parquet), train (data/train-00000-of-00002.parquet)",
                           "pass --split NAME (one of train, test)")
    assert_nothing_left(tmp_path / "out")


def test_split_selects_its_files_and_is_recorded(tmp_path, hub):
    out = tmp_path / "out"
    assert packctl("pack", hub, "-o", out, "--capacity", "8", "-q", "--split", "train").code == 0
    train = sorted((hub / "data").glob("train-*.parquet"))
    assert_every_sample_once(out, train)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["config"]["split"] == "train"
    assert [Path(i["path"]).name for i in manifest["inputs"]] == [p.name for p in train]
    # verify --source reads the split the output was packed from
    checked = packctl("verify", out, "--source", hub, "--no-attention")
    assert checked.code == 0, checked.stdout + checked.stderr
    assert packctl("stats", hub, "--capacity", "8", "--split", "test").code == 0
    missing = packctl("pack", hub, "-o", tmp_path / "v", "--capacity", "8", "-q", "--split", "validation")
    assert_clean_error(missing, 2, f"--split validation: {hub} has no file of that split (it holds the splits train, "
                       "test)")


def test_a_directory_of_one_split_packs_as_before(tmp_path):
    write_table(tmp_path / "one/train-0.parquet", {"input_ids": [[1, 2], [3]]})
    write_table(tmp_path / "one/notes.parquet", {"input_ids": [[4]]})
    out = tmp_path / "out"
    assert packctl("pack", tmp_path / "one", "-o", out, "--capacity", "8", "-q").code == 0
    assert_every_sample_once(out, sorted((tmp_path / "one").glob("*.parquet")))
    assert "split" not in json.loads((out / "_manifest.json").read_text())["config"]

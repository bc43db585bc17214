"""Where OUT may be, and what a refused run leaves there (docs/errors.md "Options and output"):
OUT is never the working directory or a directory above it, and a run that fails removes the
directories above OUT it created, and only those."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.adversary import assert_clean_error, leftovers, packctl
from support.data import write_table


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[1, 2, 3], [4, 5], [6] * 40]})


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("out, what", [(".", "the working directory"), ("..", "a directory above"),
                                       ("../..", "a directory above")])
def test_out_is_never_the_working_directory_or_above_it(tmp_path, corpus, monkeypatch, out, what, resume):
    """`pack ... -o . --overwrite` is refused before any work (it could never be renamed into
    place), and so is the same command with --resume."""
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = sorted(p.name for p in (tmp_path / "work").rglob("*"))
    result = packctl("pack", corpus, "-o", out, "--capacity", "64", "--too-long", "split", "--overwrite", "-q",
                     *(["--resume"] if resume else []))
    assert_clean_error(result, 2, f"{out}: is {what}", "choose an -o inside it")
    assert sorted(p.name for p in (tmp_path / "work").rglob("*")) == before
    assert (work / "keep.txt").read_text() == "mine"


def test_export_into_the_working_directory_is_refused(tmp_path, corpus, monkeypatch):
    assert packctl("pack", corpus, "-o", tmp_path / "packed", "--capacity", "64", "--too-long", "split",
                   "-q").code == 0
    monkeypatch.chdir(tmp_path / "in")
    result = packctl("export", tmp_path / "packed", "-o", ".", "--format", "nemo", "--overwrite")
    assert_clean_error(result, 2, ".: is the working directory")
    assert [p.name for p in (tmp_path / "in").iterdir()] == ["a.parquet"]


@pytest.mark.parametrize("command", ["pack", "materialize"])
def test_a_refused_run_removes_the_parents_of_out_it_created(tmp_path, corpus, command):
    """`-o nope2/deeper/out` with a too-long input: nope2/ and nope2/deeper/ go with the run; a
    directory that was there stays."""
    (tmp_path / "there").mkdir()
    out = tmp_path / "there" / "nope2" / "deeper" / "out"
    if command == "pack":
        result = packctl("pack", corpus, "-o", out, "--capacity", "8", "-q")  # a 40-token sequence: too long
        assert_clean_error(result, 2, "--too-long")
    else:
        assert packctl("pack", corpus, "-o", tmp_path / "plan", "--capacity", "64", "--too-long", "split",
                       "--plan-only", "-q").code == 0
        (tmp_path / "plan" / "data" / "train-00000.parquet").write_bytes(b"not a shard")
        result = packctl("materialize", tmp_path / "plan", "-o", out, "-q")
        assert result.code == 2, result.stderr
    assert [p.name for p in (tmp_path / "there").iterdir()] == []
    assert leftovers(out) == []


def test_a_refused_export_removes_the_parents_it_created(tmp_path, corpus):
    assert packctl("pack", corpus, "-o", tmp_path / "packed", "--capacity", "64", "--too-long", "split",
                   "-q").code == 0
    (tmp_path / "there").mkdir()
    result = packctl("export", tmp_path / "packed", "-o", tmp_path / "there" / "a" / "b" / "e", "--format", "olmo",
                     "--vocab-size", "64")  # no --eos-token-id: refused once the shards are read
    assert result.code == 2, result.stderr
    assert [p.name for p in (tmp_path / "there").iterdir()] == []

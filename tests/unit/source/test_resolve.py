"""packctl.source.resolve and the fingerprints of packctl.source.parquet: INPUT specs -> files,
and knowing a file again."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl.errors import PackctlError
from packctl.source.files import open_parquet, read_fingerprint
from packctl.source.resolve import _directories_up_to, normalize_spec, pattern_reaching, resolve, respell
from support.data import write_table


def parquet(path: Path, value: int = 1, rows: int = 2) -> Path:
    return write_table(path, {"input_ids": pa.array([[value + r] for r in range(rows)], pa.list_(pa.int32()))})


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("spec, normal", [
    ("data", "data"), ("data/", "data"), ("./data", "data"), ("./data//", "data"), ("data/./x/../y", "data/y"),
    ("/abs/data/", "/abs/data"), ("data/**/*.parquet", "data/**/*.parquet"), ("./*.parquet", "*.parquet"),
    (Path("data"), "data"),
])
def test_normalize_spec(spec, normal):
    assert normalize_spec(spec) == normal


def test_a_directory_gives_its_parquet_files_sorted_with_relative_paths(here):
    for name in ("b.parquet", "a.parquet", "sub/c.parquet", "sub/deeper/d.parquet"):
        parquet(here / "data" / name)
    (here / "data/README.md").write_text("not input")
    resolution = resolve(["./data/"])
    assert resolution.specs == ["data"]
    assert resolution.paths == ["data/a.parquet", "data/b.parquet", "data/sub/c.parquet", "data/sub/deeper/d.parquet"]
    first = resolution.files[0]
    st = os.stat("data/a.parquet")
    assert (first.device, first.inode, first.spec) == (st.st_dev, st.st_ino, "data")
    assert first.fingerprint.size == st.st_size and first.fingerprint.mtime_ns == st.st_mtime_ns


def test_the_current_directory(here):
    parquet(here / "a.parquet")
    assert resolve(["."]).paths == ["a.parquet"]
    assert resolve(["*.parquet"]).paths == ["a.parquet"]


def test_patterns_match_names_including_hidden_ones(here):
    for name in ("a.parquet", ".h.parquet", "_u.parquet", "sub/b.parquet"):
        parquet(here / "data" / name)
    assert resolve(["data/*.parquet"]).paths == ["data/.h.parquet", "data/_u.parquet", "data/a.parquet"]
    assert resolve(["data/?.parquet"]).paths == ["data/a.parquet"]
    assert resolve(["data/[ab].parquet"]).paths == ["data/a.parquet"]


def test_double_star_is_any_number_of_directories(here):
    for name in ("a.parquet", "x/b.parquet", "x/y/c.parquet"):
        parquet(here / "data" / name)
    assert resolve(["data/**/*.parquet"]).paths == ["data/a.parquet", "data/x/b.parquet", "data/x/y/c.parquet"]
    assert resolve(["data/**/y/*.parquet"]).paths == ["data/x/y/c.parquet"]
    assert resolve(["data/**"]).paths == ["data/a.parquet", "data/x/b.parquet", "data/x/y/c.parquet"]


def test_a_trailing_double_star_matches_every_file(here):
    parquet(here / "data/a.parquet")
    (here / "data/notes.txt").write_text("not Parquet")
    with pytest.raises(PackctlError, match="data/notes.txt: not a readable Parquet file"):
        resolve(["data/**"])


def test_a_fixed_part_after_a_pattern(here):
    parquet(here / "data/2024/train/a.parquet")
    parquet(here / "data/2025/train/b.parquet")
    parquet(here / "data/2025/test/c.parquet")
    assert resolve(["data/*/train/*.parquet"]).paths == ["data/2024/train/a.parquet", "data/2025/train/b.parquet"]


def test_a_pattern_that_matches_directories_walks_them(here):
    parquet(here / "data/p1/a.parquet")
    parquet(here / "data/p2/deep/b.parquet")
    assert resolve(["data/p*"]).paths == ["data/p1/a.parquet", "data/p2/deep/b.parquet"]


def test_absolute_patterns(tmp_path):
    parquet(tmp_path / "a.parquet")
    assert resolve([str(tmp_path / "*.parquet")]).paths == [str(tmp_path / "a.parquet")]


@pytest.mark.parametrize("spec, message", [
    ("missing", "missing: no such file or directory"),
    ("nothing-*.parquet", "nothing-*.parquet: the pattern matches no file"),
    ("empty", "empty: the directory holds no *.parquet file"),
    ("", "'': no such file or directory"),
])
def test_nothing_found(here, spec, message):
    (here / "empty").mkdir()
    with pytest.raises(PackctlError, match=message.replace("*", r"\*")):
        resolve([spec])


def test_identity_not_spelling_decides_what_is_the_same_file(here):
    parquet(here / "data/a.parquet")
    os.link(here / "data/a.parquet", here / "b.parquet")
    with pytest.raises(PackctlError, match=r"data/a.parquet: the same file as b.parquet \(hard links"):
        resolve(["data", "b.parquet"])
    (here / "c.parquet").symlink_to("data/a.parquet")
    with pytest.raises(PackctlError, match=r"data/a.parquet: the same file as c.parquet \(symbolic links"):
        resolve(["c.parquet", "data"])


def test_a_pattern_reaching_a_file_twice_reads_it_once(here):
    """`data/**` matches data/sub and data/sub/a.parquet: one spec, one path, read once."""
    parquet(here / "data/sub/a.parquet")
    assert resolve(["data/**"]).paths == ["data/sub/a.parquet"]


def test_outputs_are_recognised_by_their_manifest(here):
    parquet(here / "data/raw/a.parquet")
    parquet(here / "data/old/x.parquet")
    (here / "data/old/manifest.json").write_text(json.dumps({"format_version": 1, "packctl_version": "0.1"}))
    with pytest.raises(PackctlError, match="data/old/x.parquet: part of the packctl output data/old "
                                           r"\(it holds manifest.json\)"):
        resolve(["data"])
    (here / "data/old/manifest.json").write_text(json.dumps({"format_version": 1}))  # another tool's manifest
    assert resolve(["data"]).paths == ["data/old/x.parquet", "data/raw/a.parquet"]


def test_what_packctl_leaves_beside_an_output(here):
    parquet(here / "data/a.parquet")
    parquet(here / "data/.out.packctl-old-4242/data/train-00000.parquet", 5)
    with pytest.raises(PackctlError, match=r"inside data/.out.packctl-old-4242, the unfinished output of a packctl "
                                           "run writing data/out"):
        resolve(["data"])


def test_directories_up_to_the_root():
    assert _directories_up_to("a/b/c.parquet", "a") == ["a/b", "a"]
    assert _directories_up_to("c.parquet", ".") == ["."]
    assert _directories_up_to("/x/y/c.parquet", "/x/y") == ["/x/y"]


def test_respell_as_an_earlier_run(here):
    parquet(here / "data/a.parquet")
    parquet(here / "data/b.parquet", 3)
    absolute = resolve([str(here / "data")])
    again = respell(absolute, ["data"], ["data/a.parquet", "data/b.parquet"])
    assert again.specs == ["data"] and again.paths == ["data/a.parquet", "data/b.parquet"]
    assert [f.fingerprint for f in again.files] == [f.fingerprint for f in absolute.files]
    # other files, or another number of them, are not the same input: left as they are
    assert respell(absolute, ["data"], ["data/a.parquet"]) is absolute
    assert respell(absolute, ["x"], ["x/a.parquet", "x/b.parquet"]) is absolute


def test_fingerprint_checks_on_open(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"v": pa.array([1, 2, 3], pa.int32())}), path, compression="none", use_dictionary=False)
    fingerprint, metadata, st = read_fingerprint(str(path))
    assert metadata.num_rows == 3 and fingerprint.size == st.st_size == path.stat().st_size
    assert open_parquet(str(path), fingerprint).read().column("v").to_pylist() == [1, 2, 3]
    before = path.stat()
    pq.write_table(pa.table({"v": pa.array([4, 5, 6], pa.int32())}), path, compression="none", use_dictionary=False)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    assert open_parquet(str(path)).read().num_rows == 3  # without a fingerprint: no check
    with pytest.raises(PackctlError, match="a.parquet: changed while packctl was reading it .its Parquet footer"):
        open_parquet(str(path), fingerprint)
    path.write_bytes(b"tiny")
    with pytest.raises(PackctlError, match="changed while packctl was reading it .its size went from"):
        open_parquet(str(path), fingerprint)


@pytest.mark.parametrize("content, reason", [(b"PAR1", "too small for Parquet"),
                                             (b"PAR1" + b"x" * 20, "magic bytes not found"),
                                             (b"PAR1" + b"x" * 20 + b"\xff\xff\x00\x00PAR1", "may be truncated")])
def test_not_parquet(tmp_path, content, reason):
    path = tmp_path / "a.parquet"
    path.write_bytes(content)
    for read in (read_fingerprint, open_parquet):
        with pytest.raises(PackctlError, match=f"a.parquet: not a readable Parquet file .*{reason}"):
            read(str(path))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "x.parquet")
    with pytest.raises(PackctlError, match=r"x.parquet: not a regular file \(a FIFO\)"):
        read_fingerprint(str(tmp_path / "x.parquet"))


@pytest.mark.parametrize("pattern, reached", [
    ("data/*", True), ("data/*.parquet", False), ("data/**/*.parquet", True), ("data/**", True),
    ("data/p*/data/*.parquet", True), ("data/p*/data/*.txt", False), ("data/raw/*", False), ("*", True),
    ("data/packed/data/train-00000.parquet", False),  # not a pattern: directories are checked by check_output_path
])
def test_pattern_reaching(here, pattern, reached):
    shard = "data/packed/data/train-00000.parquet"
    assert (pattern_reaching(["other/*", pattern], shard) == pattern) is reached
    assert (pattern_reaching([str(here / pattern)], shard) is not None) is reached

"""Input resolution, and inputs that change under a run (docs/errors.md, "Input resolution" and
"Inputs that change under a run").

Every case is a layout a user's data directory can have, or a change a file can undergo while
packctl reads it or between a crash and `--resume`: hard and symbolic links, loops, FIFOs,
unreadable paths, earlier outputs inside the input, files rewritten with the same size and mtime.
A refused input is one line naming the path, exit 2, no traceback, nothing left beside OUT; an
accepted one packs every source sample exactly once.
"""
from __future__ import annotations

import importlib.util
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, PackctlError, pack
from packctl.output.outdir import Faults
from packctl.verify import VerifyOptions, verify
from support.adversary import (assert_clean_error, assert_complete, assert_every_sample_once, assert_nothing_left,
                               packctl, packctl_process)
from support.data import write_table
from support.megatron import data_columns, write_pair, write_twin
from support.paths import ROOT
from support.threadcomm import run_ranks

PACK = ("--capacity", "16", "-q")
# Blocks read twice: a pack of 2 tokens costs 24 bytes (3 int32 columns), the smallest --memory-budget
# packctl takes with --capacity 2, and less than any decoded block, so none stays in memory.
REREAD = ("--capacity", "2", "-q", "--memory-budget", "24")


def tokens(rows: int, first: int = 1) -> dict:
    """`rows` sequences of 1 to 3 tokens, the values starting at `first` (so files differ)."""
    return {"input_ids": pa.array([[first + r] * (r % 3 + 1) for r in range(rows)], pa.list_(pa.int32()))}


def data_file(path: Path, rows: int = 3, first: int = 1) -> Path:
    return write_table(path, tokens(rows, first))


def fixed_width_file(path: Path, value: int, rows: int = 12) -> Path:
    """Uncompressed, no dictionary: a rewrite with other values of the same width keeps the size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": pa.array([[value + r, value + r + 1] for r in range(rows)],
                                                   pa.list_(pa.int32()))}),
                   path, compression="none", use_dictionary=False, row_group_size=4)
    return path


def rewrite_keeping_size_and_mtime(path: Path, value: int) -> None:
    """The same rows with other token values: same size, same mtime, another footer (statistics)."""
    before = path.stat()
    fixed_width_file(path, value, rows=pq.ParquetFile(path).metadata.num_rows)
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def pack_ok(out: Path, *inputs, sources: list[Path] | None = None) -> dict:
    result = packctl("pack", *map(str, inputs), "-o", str(out), *PACK)
    assert result.code == 0, result.stderr
    assert_every_sample_once(out, sources if sources is not None else [Path(i) for i in inputs])
    return json.loads((out / "_manifest.json").read_text())


def refused(tmp_path: Path, *args, mentions=(), options=()) -> str:
    out = tmp_path / "out"
    result = packctl("pack", *map(str, args), "-o", str(out), *PACK, *options)
    line = assert_clean_error(result, 2, *map(str, mentions))
    assert_nothing_left(out)
    return line


def shard_digests(out: Path) -> list[str]:
    manifest = json.loads((out / "_manifest.json").read_text())
    return [hashlib.sha256((out / s["path"]).read_bytes()).hexdigest() for s in manifest["shards"]]


# --- the same file twice ------------------------------------------------------------------------

def test_hard_links_in_one_directory(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    os.link(a, tmp_path / "data/b.parquet")
    line = refused(tmp_path, tmp_path / "data", mentions=["data/b.parquet", "data/a.parquet", "hard links"])
    assert "the same file as" in line


def test_hard_links_across_two_directories(tmp_path):
    a = data_file(tmp_path / "one/a.parquet")
    data_file(tmp_path / "two/c.parquet", first=50)
    os.link(a, tmp_path / "two/b.parquet")
    refused(tmp_path, tmp_path / "one", tmp_path / "two", mentions=["two/b.parquet", "one/a.parquet", "hard links"])


def test_a_file_given_as_itself_and_through_its_directory(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    refused(tmp_path, a, tmp_path / "data", mentions=["data/a.parquet", "given twice"])


def test_the_same_path_given_twice(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    refused(tmp_path, a, a, mentions=["data/a.parquet", "given twice"])


def test_a_symlink_to_a_file_of_the_input(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/link.parquet").symlink_to("a.parquet")
    refused(tmp_path, tmp_path / "data", mentions=["data/link.parquet", "data/a.parquet", "symbolic link"])


def test_a_symlink_to_a_file_outside_the_input_is_read(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    elsewhere = data_file(tmp_path / "elsewhere/b.parquet", first=40)
    (tmp_path / "data/b.parquet").symlink_to(elsewhere)
    manifest = pack_ok(tmp_path / "out", tmp_path / "data", sources=[tmp_path / "data/a.parquet", elsewhere])
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["a.parquet", "b.parquet"]


def test_a_symlink_to_a_directory_already_in_the_input(tmp_path):
    data_file(tmp_path / "data/sub/a.parquet")
    (tmp_path / "data/again").symlink_to("sub")
    refused(tmp_path, tmp_path / "data", mentions=["data/sub/a.parquet", "data/again/a.parquet", "symbolic link"])


# --- links, loops, special files, permissions ---------------------------------------------------

def test_a_symlinked_subdirectory_is_followed(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    b = data_file(tmp_path / "shared/b.parquet", first=30)
    (tmp_path / "data/more").symlink_to(tmp_path / "shared", target_is_directory=True)
    manifest = pack_ok(tmp_path / "out", tmp_path / "data", sources=[a, b])
    assert [i["path"] for i in manifest["inputs"]] == [str(tmp_path / "data/a.parquet"),
                                                       str(tmp_path / "data/more/b.parquet")]
    assert manifest["counts"]["sequences_in"] == 6


def test_a_symlink_back_to_a_directory_above(tmp_path):
    data_file(tmp_path / "data/sub/a.parquet")
    (tmp_path / "data/sub/up").symlink_to("..", target_is_directory=True)
    refused(tmp_path, tmp_path / "data", mentions=["data/sub/up", "loop"])


def test_a_symlink_loop_between_two_links(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/x.parquet").symlink_to("y.parquet")
    (tmp_path / "data/y.parquet").symlink_to("x.parquet")
    refused(tmp_path, tmp_path / "data", mentions=["data/x.parquet", "symbolic link"])


def test_a_dangling_parquet_link(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/b.parquet").symlink_to(tmp_path / "gone/b.parquet")
    refused(tmp_path, tmp_path / "data", mentions=["data/b.parquet", "does not exist"])


def test_a_dangling_link_to_a_directory(tmp_path):
    """A link to a directory on a filesystem that is not mounted here: its files would be missing."""
    data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/shard_b").symlink_to("/nonexistent-mount/shard_b", target_is_directory=True)
    refused(tmp_path, tmp_path / "data", mentions=["data/shard_b", "does not exist"])


def test_a_dangling_link_given_as_input(tmp_path):
    (tmp_path / "a.parquet").symlink_to(tmp_path / "gone.parquet")
    refused(tmp_path, tmp_path / "a.parquet", mentions=["a.parquet", "does not exist"])


def test_a_fifo_named_parquet(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    os.mkfifo(tmp_path / "data/x.parquet")
    refused(tmp_path, tmp_path / "data", mentions=["data/x.parquet", "not a regular file", "FIFO"])
    refused(tmp_path, tmp_path / "data/x.parquet", mentions=["data/x.parquet", "FIFO"])
    refused(tmp_path, tmp_path / "data/*", mentions=["data/x.parquet", "FIFO"])
    refused(tmp_path, "/dev/null", mentions=["/dev/null", "a character device"])


def test_a_socket_named_parquet(tmp_path):
    import socket

    data_file(tmp_path / "data/a.parquet")
    path = tmp_path / "data/s.parquet"
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.bind(str(path))
        except OSError:
            pytest.skip("unix sockets cannot be bound here")
        refused(tmp_path, tmp_path / "data", mentions=["data/s.parquet", "socket"])


def test_a_directory_named_parquet_is_walked(tmp_path):
    """Spark writes `x.parquet/part-0000.parquet`: the directory is walked like any other."""
    a = data_file(tmp_path / "data/a.parquet")
    part = data_file(tmp_path / "data/x.parquet/part-00000.parquet", first=20)
    (tmp_path / "data/empty.parquet").mkdir()
    pack_ok(tmp_path / "out", tmp_path / "data", sources=[a, part])


def test_an_empty_directory_beside_data(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/empty").mkdir()
    pack_ok(tmp_path / "out", tmp_path / "data")


def test_not_parquet_but_named_parquet(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/notes.parquet").write_text("id,tokens\n1,2 3\n")
    refused(tmp_path, tmp_path / "data", mentions=["data/notes.parquet", "not a readable Parquet file"])


def test_a_zero_row_file_among_others(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    empty = write_table(tmp_path / "data/b.parquet", {"input_ids": pa.array([], pa.list_(pa.int32()))})
    c = data_file(tmp_path / "data/c.parquet", first=60)
    manifest = pack_ok(tmp_path / "out", tmp_path / "data", sources=[a, empty, c])
    assert [i["rows"] for i in manifest["inputs"]] == [3, 0, 3]


def test_hidden_files_and_directories_are_read(tmp_path):
    """Names starting with `.` or `_` are input like any other (and listed in the manifest)."""
    a = data_file(tmp_path / "data/a.parquet")
    hidden = data_file(tmp_path / "data/.hidden.parquet", first=70)
    under = data_file(tmp_path / "data/_staging/u.parquet", first=80)
    manifest = pack_ok(tmp_path / "out", tmp_path / "data", sources=[hidden, under, a])
    assert len(manifest["inputs"]) == 3
    pattern = pack_ok(tmp_path / "out2", tmp_path / "data/*.parquet", sources=[hidden, a])
    assert len(pattern["inputs"]) == 2


def _as_nobody() -> list[str] | None:
    """A launcher running packctl as user nobody, where root can become it (root ignores modes)."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    probe = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "packctl"]


@pytest.fixture
def shared_tmp():
    """A folder every user can enter (pytest's tmp_path is root's own), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="packctl-inputs-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _world_readable(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.mark.parametrize("what", ["file", "directory"])
def test_unreadable_input_as_another_user(shared_tmp, what):
    launcher = _as_nobody()
    if launcher is None:
        pytest.skip("needs root and setpriv to run packctl as another user")
    data_file(shared_tmp / "data/a.parquet")
    data_file(shared_tmp / "data/sub/b.parquet", first=9)
    _world_readable(shared_tmp / "data")
    locked = shared_tmp / ("data/sub/b.parquet" if what == "file" else "data/sub")
    locked.chmod(0)
    out = shared_tmp / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(shared_tmp / "numba")}
    result = packctl_process("pack", str(shared_tmp / "data"), "-o", str(out), *PACK, launcher=launcher, env=env)
    assert_clean_error(result, 2, str(locked), "Permission denied", "make it readable")
    assert_nothing_left(out)


@pytest.mark.parametrize("what", ["file", "directory"])
def test_unreadable_input_simulated(tmp_path, monkeypatch, what):
    """The same refusal where the tests cannot run as another user: open / scandir fail as they
    would for one."""
    data_file(tmp_path / "data/a.parquet")
    data_file(tmp_path / "data/sub/b.parquet", first=9)
    locked = str(tmp_path / ("data/sub/b.parquet" if what == "file" else "data/sub"))
    real_open, real_scandir = os.open, os.scandir

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "open", lambda path, *a, **k: denied(path) if str(path) == locked
                        else real_open(path, *a, **k))
    monkeypatch.setattr(os, "scandir", lambda path=".": denied(path) if str(path) == locked else real_scandir(path))
    line = refused(tmp_path, tmp_path / "data", mentions=[locked, "Permission denied", "make it readable"])
    assert ("cannot list the directory" if what == "directory" else "cannot be read") in line


# --- patterns -----------------------------------------------------------------------------------

def test_a_pattern_matching_a_directory_walks_it(tmp_path):
    a = data_file(tmp_path / "data/2024/a.parquet")
    b = data_file(tmp_path / "data/2025/deep/b.parquet", first=11)
    (tmp_path / "data/notes.txt").write_text("not matched")
    manifest = pack_ok(tmp_path / "out", tmp_path / "data/20*", sources=[a, b])
    assert manifest["config"]["inputs"] == [str(tmp_path / "data/20*")]


def test_a_recursive_pattern_follows_symlinked_directories(tmp_path):
    a = data_file(tmp_path / "data/x/a.parquet")
    b = data_file(tmp_path / "real/b.parquet", first=21)
    (tmp_path / "data/y").symlink_to(tmp_path / "real", target_is_directory=True)
    pack_ok(tmp_path / "out", tmp_path / "data/**/*.parquet", sources=[a, b])


def test_a_recursive_pattern_over_an_earlier_output(tmp_path):
    """`pack 'data/**/*.parquet'` after `-o data/packed`: the packs of the first run must not become
    samples of the second."""
    data_file(tmp_path / "data/raw/a.parquet")
    data_file(tmp_path / "data/raw/b.parquet", first=5)
    pack_ok(tmp_path / "data/packed", tmp_path / "data/raw")
    out = tmp_path / "packed_8k"
    result = packctl("pack", str(tmp_path / "data/**/*.parquet"), "-o", str(out), *PACK)
    assert_clean_error(result, 2, f"{tmp_path}/data/packed/data/train-00000.parquet: part of the packctl output "
                       f"{tmp_path}/data/packed (it holds _manifest.json)", "never read as input", "narrow INPUT")
    assert_nothing_left(out)


@pytest.mark.parametrize("pattern, out", [("data/**/*.parquet", "data/packed_8k"), ("data/*", "data/packed"),
                                          ("data/*", "data/more.parquet"), ("*/", "packed")])
def test_an_output_that_the_input_pattern_matches(tmp_path, monkeypatch, pattern, out):
    """As an OUT inside an input directory: the next run of the same command would read its
    shards (and `--resume`, its partial directory)."""
    monkeypatch.chdir(tmp_path)
    data_file(tmp_path / "data/raw/a.parquet")
    result = packctl("pack", pattern, "-o", out, *PACK)
    assert_clean_error(result, 2, f"{out}: INPUT {os.path.normpath(pattern)} matches its shards",
                       "choose an -o that INPUT does not match")
    assert_nothing_left(tmp_path / out)


def test_a_pattern_that_does_not_reach_an_output_beside_it(tmp_path):
    a = data_file(tmp_path / "data/raw1/a.parquet")
    pack_ok(tmp_path / "data/packed", a)
    pack_ok(tmp_path / "out", tmp_path / "data/raw*/*.parquet", sources=[a])


def test_a_directory_holding_an_earlier_epochs_output(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    data_file(tmp_path / "data/b.parquet", first=5)
    result = packctl("pack", str(tmp_path / "data"), "-o", str(tmp_path / "epochs"), *PACK, "--epochs", "2",
                     "--order", "shuffle")
    assert result.code == 0, result.stderr
    shutil.move(tmp_path / "epochs", tmp_path / "data/epochs")
    refused(tmp_path, tmp_path / "data", mentions=[str(tmp_path / "data/epochs"), "_epochs.json"])


def test_the_partial_directory_of_a_crashed_run_inside_the_input(tmp_path):
    data_file(tmp_path / "data/a.parquet", rows=12)
    crashed_out = tmp_path / "data/packed"
    with pytest.raises(PackctlError):  # the run writing data/packed failed after its first shard
        pack(PackConfig(inputs=[str(tmp_path / "data/a.parquet")], output=str(crashed_out), capacity=4,
                        shard_rows=1), faults=Faults(fail_write_after_shards=1))
    assert (tmp_path / "data/.packed.packctl-partial").is_dir()
    refused(tmp_path, tmp_path / "data", mentions=[".packed.packctl-partial", str(crashed_out), "unfinished output"])


def test_a_packctl_shard_copied_into_the_input(tmp_path):
    data_file(tmp_path / "data/a.parquet")
    pack_ok(tmp_path / "packed", tmp_path / "data")
    shutil.copy(tmp_path / "packed/data/train-00000.parquet", tmp_path / "data/more.parquet")
    refused(tmp_path, tmp_path / "data", mentions=["data/more.parquet", "shard written by packctl", "'packctl' key"])


def test_a_foreign_manifest_does_not_make_an_output(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    (tmp_path / "data/_manifest.json").write_text(json.dumps({"files": ["a.parquet"]}))
    pack_ok(tmp_path / "out", tmp_path / "data", sources=[a])


@pytest.mark.slow  # imports the what-if (polars) and verify: a few seconds
def test_stats_and_verify_resolve_inputs_the_same_way(tmp_path):
    a = data_file(tmp_path / "data/a.parquet")
    os.link(a, tmp_path / "data/b.parquet")
    result = packctl("stats", str(tmp_path / "data"), "--capacity", "16", "--json")
    assert_clean_error(result, 2, "data/b.parquet", "the same file as", "data/a.parquet")
    pack_ok(tmp_path / "out", a)
    result = packctl("verify", str(tmp_path / "out"), "--source", str(tmp_path / "data"))
    assert_clean_error(result, 2, "data/b.parquet", "the same file as")


# --- spelling and --resume ----------------------------------------------------------------------

def crashed_run(data: str, out: str) -> None:
    """A run of `data` that failed (disk full) after finishing its first shard: the partial
    directory holds it, for `--resume`."""
    with pytest.raises(PackctlError, match="write failed"):
        pack(PackConfig(inputs=[data], output=out, capacity=4, shard_rows=1), faults=Faults(fail_write_after_shards=1))
    assert (Path(out).parent / f".{Path(out).name}.packctl-partial/journal.jsonl").read_text().strip()


@pytest.fixture
def resumable(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding DIR with three small files."""
    monkeypatch.chdir(tmp_path)
    for k, name in enumerate("abc"):
        fixed_width_file(tmp_path / "DIR" / f"{name}.parquet", 10 * k + 1, rows=6)
    return tmp_path


@pytest.mark.parametrize("first, again", [("DIR", "DIR/"), ("DIR", "./DIR"), ("DIR", "absolute"),
                                          ("absolute", "DIR"), ("./DIR/", "DIR"), ("DIR", "DIR/*.parquet")])
def test_one_input_spelled_differently_on_resume(resumable, first, again):
    spell = (lambda s: str(resumable / "DIR") if s == "absolute" else s)
    pack(PackConfig(inputs=[spell(first)], output="reference", capacity=4, shard_rows=1))
    crashed_run(spell(first), "out")
    result = packctl("pack", spell(again), "-o", "out", "--capacity", "4", "--shard-rows", "1", "--resume", "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["metrics"]["throughput"]["resumed_shards"] == 1
    assert shard_digests(Path("out")) == shard_digests(Path("reference"))
    assert_every_sample_once(Path("out"), [resumable / "DIR"])


def test_spellings_of_one_directory_write_the_same_bytes(resumable):
    for k, spec in enumerate(["DIR", "DIR/", "./DIR", "./DIR//"]):
        pack(PackConfig(inputs=[spec], output=f"out{k}", capacity=4, shard_rows=1))
        manifest = json.loads(Path(f"out{k}/_manifest.json").read_text())
        assert manifest["config"]["inputs"] == ["DIR"]
        assert [i["path"] for i in manifest["inputs"]] == ["DIR/a.parquet", "DIR/b.parquet", "DIR/c.parquet"]
    assert len({tuple(shard_digests(Path(f"out{k}"))) for k in range(4)}) == 1


def test_a_file_rewritten_with_the_same_size_and_mtime_before_resume(resumable):
    crashed_run("DIR", "out")
    rewrite_keeping_size_and_mtime(resumable / "DIR/b.parquet", 500)
    result = packctl("pack", "DIR", "-o", "out", "--capacity", "4", "--shard-rows", "1", "--resume")
    line = assert_clean_error(result, 2, "--resume refused", "DIR/b.parquet", "Parquet footer")
    assert "modification time" not in line and "size" not in line.split("DIR/b.parquet")[1].split(")")[0]
    assert Path(".out.packctl-partial").is_dir() and not Path("out").exists()  # kept for a resume that fits


def test_a_file_appended_to_before_resume(resumable):
    """Rows added to a file (rewritten longer, its mtime put back) after the crash."""
    crashed_run("DIR", "out")
    path = resumable / "DIR/c.parquet"
    before = path.stat()
    fixed_width_file(path, 21, rows=9)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    result = packctl("pack", "DIR", "-o", "out", "--capacity", "4", "--shard-rows", "1", "--resume")
    assert_clean_error(result, 2, "--resume refused", "DIR/c.parquet changed since that run read it",
                       "rows, size, Parquet footer")
    assert not Path("out").exists()


def test_garbage_appended_before_resume(resumable):
    crashed_run("DIR", "out")
    with open(resumable / "DIR/c.parquet", "ab") as fh:
        fh.write(b"\0" * 16)
    result = packctl("pack", "DIR", "-o", "out", "--capacity", "4", "--shard-rows", "1", "--resume")
    assert_clean_error(result, 2, "DIR/c.parquet", "not a readable Parquet file")
    assert not Path("out").exists()


def test_a_file_added_before_resume(resumable):
    crashed_run("DIR", "out")
    fixed_width_file(resumable / "DIR/d.parquet", 99, rows=2)
    result = packctl("pack", "DIR", "-o", "out", "--capacity", "4", "--shard-rows", "1", "--resume")
    assert_clean_error(result, 2, "--resume refused", "DIR/d.parquet is new")


def test_other_files_under_the_same_spelling_are_not_the_same_input(resumable):
    crashed_run("DIR", "out")
    shutil.move(resumable / "DIR", resumable / "OLD")
    for k, name in enumerate("abc"):
        fixed_width_file(resumable / "DIR" / f"{name}.parquet", 10 * k + 1, rows=6)  # same bytes, new files
    os.utime(resumable / "DIR/a.parquet", ns=(0, 10**18))
    result = packctl("pack", str(resumable / "DIR"), "-o", "out", "--capacity", "4", "--shard-rows", "1", "--resume")
    assert_clean_error(result, 2, "--resume refused", "DIR/a.parquet")


# --- inputs that change during the run ------------------------------------------------------------

def change_before_materialize(monkeypatch, change) -> None:
    """Run `change()` once, between scan and materialize (every rank waits for it)."""
    import packctl.pipeline.run as run_module

    original = run_module.materialize

    def materialize(ctx, *args, **kwargs):
        if ctx.comm.rank == 0:
            change()
        ctx.comm.barrier()
        return original(ctx, *args, **kwargs)

    monkeypatch.setattr(run_module, "materialize", materialize)


def test_a_file_rewritten_between_scan_and_materialize(tmp_path, monkeypatch):
    a = fixed_width_file(tmp_path / "data/a.parquet", 1)
    fixed_width_file(tmp_path / "data/b.parquet", 100)
    change_before_materialize(monkeypatch, lambda: rewrite_keeping_size_and_mtime(a, 7))
    out = tmp_path / "out"
    result = packctl("pack", str(tmp_path / "data"), "-o", str(out), *REREAD)
    assert_clean_error(result, 2, f"{a}: changed while packctl was reading it", "Parquet footer",
                       "rerun when the input is stable")
    assert_nothing_left(out)


def test_a_file_appended_to_during_the_run(tmp_path, monkeypatch):
    fixed_width_file(tmp_path / "data/a.parquet", 1)
    b = fixed_width_file(tmp_path / "data/b.parquet", 100)
    size = b.stat().st_size

    def append():
        with open(b, "ab") as fh:
            fh.write(b"more rows")

    change_before_materialize(monkeypatch, append)
    out = tmp_path / "out"
    result = packctl("pack", str(tmp_path / "data"), "-o", str(out), *REREAD)
    assert_clean_error(result, 2, f"{b}: changed while packctl was reading it",
                       f"size went from {size} to {size + 9} bytes")
    assert_nothing_left(out)


def test_a_file_replaced_by_rename_during_the_run(tmp_path, monkeypatch):
    """How most tools rewrite a file: write beside it, rename over it (a new inode, same path)."""
    a = fixed_width_file(tmp_path / "data/a.parquet", 1)

    def replace():
        fixed_width_file(tmp_path / "new.parquet", 3)
        os.replace(tmp_path / "new.parquet", a)

    change_before_materialize(monkeypatch, replace)
    out = tmp_path / "out"
    result = packctl("pack", str(tmp_path / "data"), "-o", str(out), *REREAD)
    assert_clean_error(result, 2, f"{a}: changed while packctl was reading it")
    assert_nothing_left(out)


def test_a_file_removed_during_the_run(tmp_path, monkeypatch):
    fixed_width_file(tmp_path / "data/a.parquet", 1)
    b = fixed_width_file(tmp_path / "data/b.parquet", 100)
    change_before_materialize(monkeypatch, b.unlink)
    out = tmp_path / "out"
    result = packctl("pack", str(tmp_path / "data"), "-o", str(out), *REREAD)
    assert_clean_error(result, 2, f"{b}: changed while packctl was reading it", "removed")
    assert_nothing_left(out)


def test_kept_columns_are_read_from_the_file_scan_read(tmp_path, monkeypatch):
    """--keep-columns reads input row groups in materialize, even when every block is cached."""
    a = write_table(tmp_path / "data/a.parquet", {**tokens(4), "doc": pa.array([1, 2, 3, 4])})

    def rewrite():
        before = a.stat()
        write_table(a, {**tokens(4), "doc": pa.array([5, 6, 7, 8])})
        os.utime(a, ns=(before.st_atime_ns, before.st_mtime_ns))

    change_before_materialize(monkeypatch, rewrite)
    out = tmp_path / "out"
    result = packctl("pack", str(tmp_path / "data"), "-o", str(out), *PACK, "--keep-columns", "doc")
    assert_clean_error(result, 2, f"{a}: changed while packctl was reading it")
    assert_nothing_left(out)


def test_every_rank_checks_the_files_it_reads(tmp_path, monkeypatch):
    """Two ranks (in-process): the fingerprints taken on rank 0 reach the rank that re-reads the file."""
    fixed_width_file(tmp_path / "data/a.parquet", 1, rows=40)
    b = fixed_width_file(tmp_path / "data/b.parquet", 1000, rows=40)
    change_before_materialize(monkeypatch, lambda: rewrite_keeping_size_and_mtime(b, 5000))
    config = PackConfig(inputs=[str(tmp_path / "data")], output=str(tmp_path / "out"), capacity=2, memory_budget=24,
                        token_transfer="exchange")
    with pytest.raises(PackctlError, match="b.parquet: changed while packctl was reading it"):
        run_ranks(2, lambda comm: pack(config, comm=comm))


def test_an_unchanged_input_read_twice_packs_normally(tmp_path, monkeypatch):
    """The control of the cases above: blocks read again in materialize pass the check."""
    import packctl.pipeline.run as run_module

    a = fixed_width_file(tmp_path / "data/a.parquet", 1)
    b = fixed_width_file(tmp_path / "data/b.parquet", 100)
    original, reread = run_module.materialize, []
    monkeypatch.setattr(run_module, "materialize",
                        lambda *args, **kw: reread.append(original(*args, **kw)) or reread[-1])
    result = packctl("pack", str(tmp_path / "data"), "-o", str(tmp_path / "out"), *REREAD)
    assert result.code == 0, result.stderr
    assert reread[0].blocks_reread == 6  # every block of both files, read again
    assert_every_sample_once(tmp_path / "out", [a, b])


def test_a_file_rewritten_while_stats_reads_it(tmp_path, monkeypatch):
    """The what-if reads lengths with polars, by path: what it read is checked against the footers."""
    import packctl.stats.whatif as whatif

    fixed_width_file(tmp_path / "data/a.parquet", 1)
    b = fixed_width_file(tmp_path / "data/b.parquet", 100)
    original = whatif.collect_streaming

    def collect(frame):
        rewrite_keeping_size_and_mtime(b, 900)
        return original(frame)

    monkeypatch.setattr(whatif, "collect_streaming", collect)
    with pytest.raises(PackctlError, match="b.parquet: changed while packctl was reading it"):
        whatif.read_lengths([str(tmp_path / "data")])


def test_a_file_that_changes_while_it_is_listed(tmp_path, monkeypatch):
    """Replaced between the listing and the first read: the file read is not the one listed."""
    import packctl.source.resolve as resolve_module

    a = data_file(tmp_path / "data/a.parquet")
    original = resolve_module.read_fingerprint

    def swapped(path):
        if path.endswith("a.parquet"):
            data_file(tmp_path / "new.parquet", first=3)
            os.replace(tmp_path / "new.parquet", a)
        return original(path)

    monkeypatch.setattr(resolve_module, "read_fingerprint", swapped)
    refused(tmp_path, tmp_path / "data", mentions=[f"{a}: changed while packctl was reading it", "replaced"])


def test_fifo_check_does_not_block(tmp_path):
    """A FIFO is refused from its stat: opening one would wait for a writer forever."""
    os.mkfifo(tmp_path / "x.parquet")
    assert stat.S_ISFIFO(os.stat(tmp_path / "x.parquet").st_mode)
    result = packctl_process("pack", str(tmp_path / "x.parquet"), "-o", str(tmp_path / "out"), *PACK, timeout=120)
    assert_clean_error(result, 2, "x.parquet", "FIFO")


# --- Megatron indexed datasets (.bin + .idx) ------------------------------------------------------

MEGATRON_DOCUMENTS = [[[5, 6, 7], [8, 9]], [[1, 2, 3, 4]], [[10], [11], [12]], [[13, 14]]]


def megatron_pair(prefix: Path, documents=MEGATRON_DOCUMENTS, dtype=np.int32) -> Path:
    return write_pair(prefix, documents, dtype)


def megatron_ok(tmp_path: Path, *inputs, documents=MEGATRON_DOCUMENTS) -> Path:
    """Packs INPUT; every document once (verify --source), the output's data columns those of the
    same documents as Parquet, which the independent checker sees once each."""
    out = tmp_path / "out"
    result = packctl("pack", *map(str, inputs), "-o", str(out), *PACK)
    assert result.code == 0, result.stderr
    assert_complete(out)
    report = verify(out, VerifyOptions(source=[str(i) for i in inputs], attention=False))
    assert report.checks["conservation"].status == "ok" and report.ok, report.violations
    twin = write_twin(tmp_path / "twin/t.parquet", documents)
    assert packctl("pack", str(twin), "-o", str(tmp_path / "twin-out"), *PACK).code == 0
    assert_every_sample_once(tmp_path / "twin-out", [twin])
    assert data_columns(out) == data_columns(tmp_path / "twin-out")
    return out


def patched(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


# offsets in the .idx of MEGATRON_DOCUMENTS: 7 sequences, 5 document index entries
_POINTERS, _DOCUMENT_INDEX = 34 + 4 * 7, 34 + 12 * 7
MEGATRON_DAMAGE = {
    "truncated .idx": (lambda idx: idx.write_bytes(idx.read_bytes()[:-3]), "c.idx", "truncated or corrupt"),
    "truncated .bin": (lambda idx: idx.with_suffix(".bin").write_bytes(idx.with_suffix(".bin").read_bytes()[:-2]),
                       "c.bin: 54 bytes", "truncated"),
    "wrong magic": (lambda idx: patched(idx, 0, b"PAR1"), "c.idx: not a Megatron index", "MMIDIDX"),
    "unknown version": (lambda idx: patched(idx, 9, struct.pack("<Q", 3)), "c.idx: Megatron index version 3",
                        "reads version 1"),
    "unknown dtype": (lambda idx: patched(idx, 17, b"\x00"), "c.idx: unknown token dtype code 0", "write it again"),
    "float tokens": (lambda idx: patched(idx, 17, b"\x06"), "c.idx: tokens are float64", "integer"),
    "pointer past the end": (lambda idx: patched(idx, _POINTERS + 8 * 6, struct.pack("<q", 10**6)), "c.bin",
                             "tokens end at byte 1000008"),
    "pointers overlapping": (lambda idx: patched(idx, _POINTERS + 8 * 2, struct.pack("<q", 4)),
                             "c.idx document 1: sequence 2 has length 4 at byte 4", "back to back"),
    "document index past the sequences": (lambda idx: patched(idx, _DOCUMENT_INDEX + 8 * 2, struct.pack("<q", 99)),
                                          "c.idx document 1: the document index goes from sequence 2 to 99",
                                          "corrupt"),
    "a token id above int32": (None, "c.bin document 1: token id 4294967296 at position 2", "outside"),
}


@pytest.mark.parametrize("case", MEGATRON_DAMAGE)
def test_a_damaged_megatron_pair(tmp_path, case):
    change, *mentions = MEGATRON_DAMAGE[case]
    if change is None:
        idx = megatron_pair(tmp_path / "data/c", [[[1]], [[2, 3, 2**32]]], np.int64)
    else:
        idx = megatron_pair(tmp_path / "data/c")
        change(idx)
    refused(tmp_path, idx, mentions=mentions)
    refused(tmp_path, tmp_path / "data/c", mentions=mentions)
    if change is not None:  # a plan reads the .idx alone, and refuses what the .idx and the sizes show
        refused(tmp_path, idx, mentions=mentions, options=["--plan-only"])
        return
    # token ids are in the .bin: a plan does not read them; its readers refuse them, with the same line
    plan, out = tmp_path / "plan", tmp_path / "out"
    assert packctl("pack", str(idx), "-o", str(plan), *PACK, "--plan-only").code == 0
    assert_clean_error(packctl("materialize", str(plan), "-o", str(out), "-q"), 2, *mentions)
    assert_nothing_left(out)
    assert_clean_error(packctl("verify", str(plan), "--no-attention"), 2, *mentions)
    if importlib.util.find_spec("torch") is not None:
        from packctl.torch import PackedDataset

        dataset = PackedDataset(plan)
        with pytest.raises(PackctlError) as raised:
            [dataset[i] for i in range(len(dataset))]
        assert "\n" not in str(raised.value) and all(m in str(raised.value) for m in mentions)


def test_a_megatron_pair_changed_before_a_plan_scans_it(tmp_path, monkeypatch):
    """A plan scans the .idx alone, each block's pair checked against the fingerprint taken when
    INPUT was resolved: a .bin cut short in between is found though no token is read."""
    from packctl.source import megatron

    idx = megatron_pair(tmp_path / "data/c")
    bin_ = idx.with_suffix(".bin")
    scan_lengths = megatron.scan_lengths

    def truncated_first(*args, **kwargs):
        os.truncate(bin_, 8)
        return scan_lengths(*args, **kwargs)
    monkeypatch.setattr(megatron, "scan_lengths", truncated_first)
    refused(tmp_path, idx, mentions=[f"{bin_}: changed while packctl was reading it", "size went from 56 to 8"],
            options=["--plan-only"])


@pytest.mark.parametrize("present, missing", [("c.bin", "c.idx"), ("c.idx", "c.bin")])
def test_a_lone_half_of_a_megatron_pair(tmp_path, present, missing):
    megatron_pair(tmp_path / "data/c")
    (tmp_path / "data" / missing).unlink()
    for spec in (tmp_path / "data" / present, tmp_path / "data"):
        refused(tmp_path, spec, mentions=[f"data/{present}: a Megatron", "without its", f"data/{missing}",
                                          "restore"])


def test_a_hard_linked_megatron_pair(tmp_path):
    megatron_pair(tmp_path / "data/c")
    for suffix in (".bin", ".idx"):
        os.link(tmp_path / f"data/c{suffix}", tmp_path / f"data/copy{suffix}")
    refused(tmp_path, tmp_path / "data", mentions=["data/copy.bin: the same file as", "data/c.bin", "hard links"])


def test_a_symlinked_megatron_prefix_is_read(tmp_path):
    megatron_pair(tmp_path / "real/c")
    (tmp_path / "data").mkdir()
    for suffix in (".bin", ".idx"):
        os.symlink(tmp_path / f"real/c{suffix}", tmp_path / f"data/alias{suffix}")
    megatron_ok(tmp_path, tmp_path / "data/alias")
    shutil.rmtree(tmp_path / "out")
    refused(tmp_path, tmp_path / "data", tmp_path / "real", mentions=["the same file as", "symbolic links"])


def test_a_megatron_pair_and_parquet_in_one_run(tmp_path):
    megatron_pair(tmp_path / "data/c")
    data_file(tmp_path / "data/a.parquet")
    refused(tmp_path, tmp_path / "data", mentions=["data/a.parquet: a Parquet input beside the Megatron input",
                                                   "two runs"])


def test_a_megatron_pair_of_uint8_every_spelling(tmp_path):
    idx = megatron_pair(tmp_path / "data/c", dtype=np.uint8)
    for spec in (idx, idx.with_suffix(".bin"), tmp_path / "data/c", tmp_path / "data"):
        out = megatron_ok(tmp_path, spec)
        shutil.rmtree(out)
        shutil.rmtree(tmp_path / "twin-out")


def test_empty_megatron_documents(tmp_path):
    documents = [[[1, 2]], [], [[3]], [[]]]
    idx = megatron_pair(tmp_path / "data/c", documents)
    refused(tmp_path, idx, mentions=["c.idx document 1: empty document", "--skip-empty"])
    refused(tmp_path, idx, mentions=["c.idx document 1: empty document", "--skip-empty"], options=["--plan-only"])
    out = tmp_path / "out"
    assert packctl("pack", str(idx), "-o", str(out), *PACK, "--skip-empty").code == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["counts"]["sequences_skipped_empty"] == 2
    assert verify(out, VerifyOptions(source=[str(idx)], attention=False)).ok


def test_a_megatron_bin_rewritten_between_scan_and_materialize(tmp_path, monkeypatch):
    idx = megatron_pair(tmp_path / "data/c")
    bin_ = idx.with_suffix(".bin")

    def rewrite():  # other tokens, the same size
        raw = bytearray(bin_.read_bytes())
        raw[0] ^= 1
        bin_.write_bytes(bytes(raw))
    change_before_materialize(monkeypatch, rewrite)
    out = tmp_path / "out"
    result = packctl("pack", str(idx), "-o", str(out), *REREAD, "--too-long", "split")
    assert_clean_error(result, 2, f"{bin_}: changed while packctl was reading it", "modification time",
                       "rerun when the input is stable")
    assert_nothing_left(out)


def test_a_megatron_bin_truncated_between_scan_and_materialize(tmp_path, monkeypatch):
    idx = megatron_pair(tmp_path / "data/c")
    bin_ = idx.with_suffix(".bin")
    change_before_materialize(monkeypatch, lambda: os.truncate(bin_, 8))
    out = tmp_path / "out"
    result = packctl("pack", str(idx), "-o", str(out), *REREAD, "--too-long", "split")
    assert_clean_error(result, 2, f"{bin_}: changed while packctl was reading it", "size went from 56 to 8")
    assert_nothing_left(out)


def test_a_megatron_idx_removed_between_scan_and_materialize(tmp_path, monkeypatch):
    idx = megatron_pair(tmp_path / "data/c")
    change_before_materialize(monkeypatch, idx.unlink)
    out = tmp_path / "out"
    result = packctl("pack", str(idx), "-o", str(out), *REREAD, "--too-long", "split")
    assert_clean_error(result, 2, f"{idx}: changed while packctl was reading it", "removed")
    assert_nothing_left(out)


def test_a_megatron_pair_named_by_an_unreadable_idx(tmp_path, monkeypatch):
    """Simulated (root reads everything): opening the .idx fails with EACCES."""
    import packctl.source.megatron as megatron_module

    idx = megatron_pair(tmp_path / "data/c")
    original = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith("c.idx"):
            raise PermissionError(13, "Permission denied")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(megatron_module.os, "open", denied)
    refused(tmp_path, idx, mentions=[f"{idx}: cannot be read (Permission denied)", "make it readable"])


def test_a_megatron_bin_that_is_a_fifo(tmp_path):
    idx = megatron_pair(tmp_path / "data/c")
    idx.with_suffix(".bin").unlink()
    os.mkfifo(idx.with_suffix(".bin"))
    result = packctl_process("pack", str(idx), "-o", str(tmp_path / "out"), *PACK, timeout=120)
    assert_clean_error(result, 2, "c.bin", "not a regular file (a FIFO)")


@pytest.mark.parametrize("half", [".bin", ".idx"])
def test_an_output_over_a_half_of_the_megatron_input(tmp_path, half):
    idx = megatron_pair(tmp_path / "data/c")
    before = idx.with_suffix(half).read_bytes()
    result = packctl("pack", str(idx), "-o", str(idx.with_suffix(half)), *PACK, "--overwrite")
    assert_clean_error(result, 2, f"the output would replace the input {idx.with_suffix(half)}")
    assert idx.with_suffix(half).read_bytes() == before


@pytest.mark.parametrize("half", [".bin", ".idx"])
def test_an_unreadable_megatron_half_as_another_user(shared_tmp, half):
    launcher = _as_nobody()
    if launcher is None:
        pytest.skip("needs root and setpriv to run packctl as another user")
    idx = megatron_pair(shared_tmp / "data/c")
    _world_readable(shared_tmp / "data")
    idx.with_suffix(half).chmod(0)
    out = shared_tmp / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(shared_tmp / "numba")}
    result = packctl_process("pack", str(shared_tmp / "data"), "-o", str(out), *PACK, launcher=launcher, env=env)
    assert_clean_error(result, 2, str(idx.with_suffix(half)), "Permission denied", "make it readable")
    assert_nothing_left(out)


# `packctl stats INPUT --limit COL=N`: the what-if reads the limited columns as pack does and
# refuses what pack refuses, with the same line: exit 2, one line naming file, row and column.
def _limit_input(tmp_path: Path, images) -> Path:
    path = tmp_path / "in" / "a.parquet"
    write_table(path, {"input_ids": pa.array([[1, 2, 3]] * len(images), pa.list_(pa.int32())), "images": images})
    return path.parent


@pytest.mark.parametrize("images, mentions", [
    (pa.array([1, None, 2], pa.int32()), ["row 1 column 'images'", "null"]),
    (pa.array([1, 2, -3], pa.int64()), ["row 2 column 'images'", "-3 is negative"]),
    (pa.array([1, 2, 2**63 + 5], pa.uint64()), ["row 2 column 'images'", "above 2^63-1"]),
    (pa.array([1.0, 2.0, 3.0], pa.float32()), ["column 'images'", "not whole numbers"]),
    (pa.array([[1], [2], [3]], pa.list_(pa.int32())), ["column 'images'", "a list"]),
], ids=["null", "negative", "uint64-huge", "float", "list"])
def test_what_if_refuses_a_bad_limit_column_as_pack_does(tmp_path, images, mentions):
    source = _limit_input(tmp_path, images)
    args = ["--capacity", "8", "--limit", "images=4"]
    stats_line = assert_clean_error(packctl("stats", source, *args), 2, *mentions)
    out = tmp_path / "out"
    pack_line = assert_clean_error(packctl("pack", source, "-o", out, "-q", *args), 2, *mentions)
    assert_nothing_left(out)
    assert stats_line == pack_line  # one message for one mistake


def test_what_if_of_a_missing_limit_column(tmp_path):
    source = _limit_input(tmp_path, pa.array([1, 2, 3], pa.int8()))
    assert_clean_error(packctl("stats", source, "--capacity", "8", "--limit", "frames=2"), 2,
                       "no column 'frames' for --limit frames=N")


def test_what_if_of_a_sample_over_a_limit(tmp_path):
    source = _limit_input(tmp_path, pa.array([1, 9, 3], pa.uint8()))
    # --too-long error: the sample is named, as pack names it
    line = assert_clean_error(packctl("stats", source, "--capacity", "8", "--limit", "images=4"), 2,
                              "row 1 column 'images'", "costs 9", "--limit images=4")
    assert line == assert_clean_error(packctl("pack", source, "-o", tmp_path / "out", "-q", "--capacity", "8",
                                              "--limit", "images=4"), 2)
    assert_nothing_left(tmp_path / "out")
    # --too-long drop: left out and counted, as pack does
    result = packctl("stats", source, "--capacity", "8", "--limit", "images=4", "--too-long", "drop", "--json")
    assert result.code == 0, result.stderr
    rows = json.loads(result.stdout)["what_if"]
    assert all(r["counts"]["over_limit"] == 1 and r["counts"]["sequences_dropped"] == 1 for r in rows)


def test_what_if_refuses_limit_on_megatron_input(tmp_path):
    prefix = write_pair(tmp_path / "corpus", [[[1, 2, 3]], [[4, 5]]])
    assert_clean_error(packctl("stats", prefix.with_suffix(".bin"), "--capacity", "8", "--limit", "images=4"), 2,
                       "--limit", "Megatron")


# --- --limit columns -----------------------------------------------------------------------------

def _limited(path: Path, images, typ=pa.int32()) -> Path:
    """Four rows of 2..5 tokens with an `images` column of `images` (of Arrow type `typ`)."""
    tokens = pa.array([list(range(1, n + 1)) for n in (2, 3, 4, 5)], pa.list_(pa.int32()))
    return write_table(path, {"input_ids": tokens, "images": pa.array(images, typ)})


@pytest.mark.parametrize("images, typ, mentions", [
    ([1, None, 0, 2], pa.int32(), ["a.parquet row 1 column 'images'", "null", "0 where it has none"]),
    ([1, 0, -2, 2], pa.int64(), ["a.parquet row 2 column 'images'", "-2 is negative"]),
    ([1, 0, 0, 2**64 - 1], pa.uint64(), ["a.parquet row 3 column 'images'", "above 2^63-1"]),
    ([1.0, 0.5, 0.0, 2.0], pa.float32(), ["a.parquet: column 'images' is float", "whole number"]),
    ([[1], [0], [], [2]], pa.list_(pa.int32()), ["a.parquet: column 'images' is list<int32>", "a list"]),
    (["1", "0", "0", "2"], pa.string(), ["a.parquet: column 'images' is string", "whole number"]),
])
def test_bad_values_of_a_limited_column(tmp_path, images, typ, mentions):
    _limited(tmp_path / "data/a.parquet", images, typ)
    line = assert_clean_error(packctl("pack", str(tmp_path / "data"), "-o", str(tmp_path / "out"), *PACK,
                                      "--limit", "images=4"), 2, *mentions)
    assert "--limit images" in line
    assert_nothing_left(tmp_path / "out")


def test_a_limited_column_missing_from_one_file(tmp_path):
    _limited(tmp_path / "data/a.parquet", [1, 0, 0, 2])
    write_table(tmp_path / "data/b.parquet", {"input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))})
    refused(tmp_path, tmp_path / "data", "--limit", "images=4", mentions=["data/b.parquet", "no column 'images'"])


def test_limited_columns_of_any_integer_type_across_files(tmp_path):
    """uint8 in one file, int64 in the other: both are counts, read as int64."""
    _limited(tmp_path / "data/a.parquet", [1, 0, 0, 2], pa.uint8())
    _limited(tmp_path / "data/b.parquet", [3, 0, 1, 0], pa.int64())
    out = tmp_path / "out"
    assert packctl("pack", str(tmp_path / "data"), "-o", str(out), *PACK, "--limit", "images=3").code == 0
    assert_every_sample_once(out, [tmp_path / "data"])
    table = pq.read_table(out / "data/train-00000.parquet")
    assert table.column("images").type == pa.list_(pa.int64()) and max(table.column("images_sum").to_pylist()) <= 3
    report = verify(out, VerifyOptions(source=[str(tmp_path / "data")], attention=False))
    assert report.ok, report.violations


def test_a_megatron_input_refuses_limit(tmp_path):
    pair = megatron_pair(tmp_path / "m/c")
    refused(tmp_path, pair, "--limit", "images=4", mentions=["--limit", "Megatron indexed dataset"])


def test_a_changed_limited_value_fails_verify(tmp_path):
    """An output whose COL or COL_sum was altered after packing fails verify: limit-sums, over-limit,
    and with --source limit-values."""
    _limited(tmp_path / "data/a.parquet", [1, 0, 0, 2])
    out = tmp_path / "out"
    assert packctl("pack", str(tmp_path / "data"), "-o", str(out), *PACK, "--limit", "images=3").code == 0
    shard = out / "data/train-00000.parquet"
    table = pq.read_table(shard)
    sums = pc_add(table.column("images_sum"), 5)
    altered = table.set_column(table.column_names.index("images_sum"), "images_sum", sums)
    pq.write_table(altered.replace_schema_metadata(table.schema.metadata), shard)
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (out / "_manifest.json").write_text(json.dumps(manifest))
    report = verify(out, VerifyOptions(source=[str(tmp_path / "data")], attention=False))
    assert {"limit-sums", "over-limit"} <= {v.rule for v in report.violations}


def pc_add(column, value):
    import pyarrow.compute as pc

    return pc.add(column, pa.scalar(value, pa.int64()))


# ---- a block rewritten with the same size, mtime and footer ------------------------------------

def footerless_file(path: Path, rows: int = 12) -> Path:
    """Uncompressed, plain, no statistics: one token changed in place leaves size and footer as they were."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"input_ids": pa.array([[1000 + r, 5000 + r] for r in range(rows)], pa.list_(pa.int32()))}),
                   path, compression="none", use_dictionary=False, write_statistics=False, row_group_size=4)
    return path


def change_one_token_in_place(path: Path, old: int, new: int) -> None:
    """Token `old` becomes `new` in the data pages: the same size, modification time and footer."""
    from packctl.source.files import read_fingerprint
    before, st = read_fingerprint(str(path))[0], path.stat()
    data = path.read_bytes()
    assert data.count(struct.pack("<i", old)) == 1
    path.write_bytes(data.replace(struct.pack("<i", old), struct.pack("<i", new)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert read_fingerprint(str(path))[0] == before


def test_resume_refuses_a_row_group_rewritten_with_the_same_size_mtime_and_footer(tmp_path):
    from support.faulty_pack import run_forked
    data = footerless_file(tmp_path / "data/a.parquet")
    argv = ["pack", str(data), "-o", str(tmp_path / "out"), "--capacity", "4", "-q", "--shard-rows", "1"]
    code, _, err = run_forked(argv, Faults(kill_at="shard:journaled", kill_count=1))
    assert code == -9, err
    change_one_token_in_place(data, 1005, 1905)
    result = packctl(*argv, "--resume")
    assert_clean_error(result, 2, f"{data}: --resume refused: row group 1, rows 4..7 holds other tokens than the "
                                  "interrupted run")


def test_a_row_group_rewritten_between_scan_and_its_second_read_is_refused(tmp_path, monkeypatch):
    """No decoded block fits the budget: materialize decodes each again and finds the change."""
    monkeypatch.chdir(tmp_path)
    data = footerless_file(tmp_path / "data/a.parquet")

    def on_step(step: str) -> None:
        if step == "open:created":
            change_one_token_in_place(data, 1009, 1909)
    with pytest.raises(PackctlError, match=r"^data/a.parquet: changed while packctl was reading it \(row group 2, "
                                           r"rows 8..11 holds other tokens than scan read"):
        pack(PackConfig(inputs=["data"], output="out", capacity=2, memory_budget=24), faults=Faults(on_step=on_step))


def test_materialize_refuses_a_row_group_rewritten_since_the_plan_read_it(tmp_path):
    data = footerless_file(tmp_path / "data/a.parquet")
    plan = tmp_path / "plan"
    assert packctl("pack", str(data), "-o", str(plan), "--capacity", "4", "-q", "--plan-only").code == 0
    change_one_token_in_place(data, 1002, 1902)
    result = packctl("materialize", str(plan), "-o", str(tmp_path / "out"), "-q")
    assert_clean_error(result, 2, f"{data}: changed while packctl was reading it (row group 0, rows 0..3 holds "
                                  f"other tokens than the plan {plan}")

"""Resource exhaustion (docs/errors.md "Resource exhaustion").

A disk that fills while spilling, a stdout on a full device or closed by its reader, memory that
runs out: one line (or, for a closed pipe, a quiet exit 141), never a traceback, and at most a
partial directory that holds finished shards for --resume. ENOSPC is simulated where the write
happens (a tiny filesystem cannot be mounted here); stdout is the real /dev/full and a real
closed pipe where the executable matters.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.adversary import (
    Result,
    assert_clean_error,
    assert_every_sample_once,
    assert_nothing_left,
    packctl,
)

from support.data import write_table
from packctl.output.journal import partial_dir
from packctl.sample import SampleSpec, write_sample

# Shuffled order and a budget of a few packs: most tokens wait on disk (141 spills of 100 shards).
SPILLING = ["--capacity", "64", "--order", "shuffle", "--memory-budget", "8k", "--shard-rows", "4",
            "--too-long", "split", "-q"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "c"
    write_sample(path, SampleSpec(sequences=400, max_length=64, shards=4, seed=1))
    return path


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "out"
    assert packctl("pack", corpus, "-o", out, "--capacity", "64", "--too-long", "split", "-q").code == 0
    return out


def _failing_after(real, calls: int, error: BaseException):
    """`real`, failing with `error` from its (calls+1)-th call on."""
    count = {"n": 0}

    def fn(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise error
        return real(*args, **kwargs)

    return fn


# ---------------------------------------------------------------------------------------------
# The disk fills while spilling

@pytest.mark.parametrize("code, advice", [
    (errno.ENOSPC, "No space left on device, on the filesystem mounted at"),
    (errno.EDQUOT, "free space within your quota, raise --memory-budget (less is spilled)"),
    (errno.EROFS, "the filesystem is read-only: choose another -o"),
])
def test_a_spill_that_fails_before_any_shard_is_finished(corpus, tmp_path, monkeypatch, code, advice):
    monkeypatch.setattr(np, "save", _failing_after(np.save, 0, OSError(code, os.strerror(code))))
    out = tmp_path / "out"
    line = assert_clean_error(packctl("pack", corpus, "-o", out, *SPILLING), 2,
                              f"{partial_dir(out)}/.spill-00000/", f"write failed ({os.strerror(code)}", advice)
    assert "--resume" not in line
    assert_nothing_left(out)


def _resume_finishes(corpus: Path, out: Path) -> None:
    """The failed run left its finished shards (and no OUT); --resume writes the rest."""
    assert not out.exists() and partial_dir(out).is_dir()
    result = packctl("pack", corpus, "-o", out, *SPILLING, "--resume")
    assert result.code == 0, result.stderr
    assert_every_sample_once(out, [corpus])


def test_a_spill_that_fails_later_keeps_the_finished_shards_for_resume(corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(np, "save", _failing_after(np.save, 300, OSError(errno.ENOSPC, "No space left on device")))
        assert_clean_error(packctl("pack", corpus, "-o", out, *SPILLING), 2,
                           "write failed (No space left on device", "raise --memory-budget (less is spilled)",
                           "finished shard(s) are kept in", "--resume")
    _resume_finishes(corpus, out)


def test_a_failed_spill_leaves_no_partial_file(corpus, tmp_path, monkeypatch):
    """The half-written spill is removed at once: a full disk gets its space back."""
    written = []

    def half_then_full(fh, *args, **kwargs):
        written.append(Path(fh.name))
        fh.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", half_then_full)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", corpus, "-o", out, *SPILLING), 2, "write failed (No space left on device")
    assert written and not written[0].exists()


def test_spilled_tokens_that_cannot_be_read_back(corpus, tmp_path, monkeypatch):
    """The first read-back fails after shards that needed no spill were finished (the packs are
    written in a shuffled order): those are kept, and --resume finishes the output."""
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(np, "load", _failing_after(np.load, 0, OSError(errno.EIO, "Input/output error")))
        assert_clean_error(packctl("pack", corpus, "-o", out, *SPILLING), 2, ".spill-00000/",
                           "cannot read back tokens spilled by this run (Input/output error)",
                           "finished shard(s) are kept in", "--resume")
    _resume_finishes(corpus, out)


def test_spilled_tokens_that_cannot_be_read_back_before_any_shard_is_finished(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(np, "load", _failing_after(np.load, 0, OSError(errno.EIO, "Input/output error")))
    out = tmp_path / "out"
    line = assert_clean_error(packctl("pack", corpus, "-o", out, *SPILLING[:-1], "--pack-order", "planner", "-q"),
                              2, ".spill-00000/", "cannot read back tokens spilled by this run (Input/output error)")
    assert "--resume" not in line
    assert_nothing_left(out)


# ---------------------------------------------------------------------------------------------
# stdout on a full device, or closed by its reader: in this process, for every command

class _BrokenStdout(io.StringIO):
    """A stdout whose writes fail with `code` (ENOSPC: a full device; EPIPE: its reader is gone)."""

    def __init__(self, code: int):
        super().__init__()
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))


def _run_with_stdout(code: int, *args) -> Result:
    from packctl.cli.app import run

    err = io.StringIO()
    with contextlib.redirect_stdout(_BrokenStdout(code)), contextlib.redirect_stderr(err):
        exit_code = run([str(a) for a in args])
    return Result(exit_code, "", err.getvalue())


COMMANDS = {
    "pack --json": lambda c, p, t: ["pack", c, "-o", t / "out", "--capacity", "64", "--too-long", "split", "--json"],
    "pack": lambda c, p, t: ["pack", c, "-o", t / "out", "--capacity", "64", "--too-long", "split"],
    "stats INPUT": lambda c, p, t: ["stats", c, "--capacity", "64"],
    "stats OUT --json": lambda c, p, t: ["stats", p, "--json"],
    "verify": lambda c, p, t: ["verify", p, "--no-attention"],
    "verify --json": lambda c, p, t: ["verify", p, "--no-attention", "--json"],
    "export --json": lambda c, p, t: ["export", p, "-o", t / "nemo", "--format", "nemo", "--json"],
    "sample --json": lambda c, p, t: ["sample", "-o", t / "s", "--sequences", "10", "--json"],
    "--version": lambda c, p, t: ["--version"],
    "pack --help": lambda c, p, t: ["pack", "--help"],
}


def _without_progress(result: Result) -> Result:
    """The run's stderr less the stage lines `pack` logs when stderr is not a terminal."""
    kept = [line for line in result.stderr.splitlines() if not line.startswith("packctl: ")]
    return Result(result.code, result.stdout, "\n".join(kept))


@pytest.mark.parametrize("command", COMMANDS)
def test_stdout_on_a_full_device(corpus, packed, tmp_path, command):
    result = _without_progress(_run_with_stdout(errno.ENOSPC, *COMMANDS[command](corpus, packed, tmp_path)))
    line = assert_clean_error(result, 2, "cannot write the result to stdout (No space left on device)")
    if command in ("pack", "pack --json"):  # the packing itself is done: the line says so
        assert f"{tmp_path / 'out'} is complete" in line
        assert_every_sample_once(tmp_path / "out", [corpus])


@pytest.mark.parametrize("command", COMMANDS)
def test_stdout_closed_by_its_reader(corpus, packed, tmp_path, command):
    result = _without_progress(_run_with_stdout(errno.EPIPE, *COMMANDS[command](corpus, packed, tmp_path)))
    assert (result.code, result.stderr.strip()) == (141, ""), result.stderr
    if command in ("pack", "pack --json"):
        assert_every_sample_once(tmp_path / "out", [corpus])


def _dev_full() -> bool:
    try:
        return stat.S_ISCHR(os.stat("/dev/full").st_mode)
    except OSError:
        return False


@pytest.mark.slow  # the real executable, twice: the in-process cases above cover every command quickly
@pytest.mark.skipif(not _dev_full(), reason="no /dev/full here")
@pytest.mark.parametrize("json_output", [True, False])
def test_the_executable_with_stdout_on_dev_full(corpus, packed, tmp_path, json_output):
    """`packctl pack ... --json > /dev/full`, `packctl stats OUT > /dev/full`: the result is
    buffered and written at the end, where the device refuses it."""
    out = tmp_path / "out"
    commands = [["stats", packed], ["verify", packed, "--no-attention"]]
    if json_output:  # (-q: no stage lines on stderr)
        commands.append(["pack", corpus, "-o", out, "--capacity", "64", "--too-long", "split", "-q"])
    for args in commands:
        args = [str(a) for a in args] + (["--json"] if json_output else [])
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, "-m", "packctl", *args], stdout=full, stderr=subprocess.PIPE,
                                  text=True, timeout=300, check=False)
        assert_clean_error(Result(proc.returncode, "", proc.stderr), 2,
                           "cannot write the result to stdout (No space left on device)")
        if args[0] == "pack":
            assert_every_sample_once(out, [corpus])


@pytest.mark.parametrize("args", [["stats", "{packed}"], ["stats", "{packed}", "--json"],
                                  ["pack", "{corpus}", "-o", "{out}", "--capacity", "64", "--too-long", "split",
                                   "--json"], ["--help"]])
def test_the_executable_with_a_closed_pipe(corpus, packed, tmp_path, args):
    """`packctl stats OUT | head -1`: the reader is gone before the result is written; the
    command ends quietly with 141, what a shell reports for SIGPIPE."""
    args = [a.format(packed=packed, corpus=corpus, out=tmp_path / "out") for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "packctl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader left: the first write fails with EPIPE
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, stderr
    assert stderr == "", stderr
    if args[0] == "pack":
        assert_every_sample_once(tmp_path / "out", [corpus])


# ---------------------------------------------------------------------------------------------
# Memory runs out

def _boom(*args, **kwargs):
    raise MemoryError


@pytest.mark.parametrize("where, extra, mention", [
    ("scan_blocks", [], "out of memory while reading the input; lower --memory-budget"),
    ("plan_stage", [], "out of memory while planning the packs; lower --window"),
    ("plan_stage", ["--epochs", "2", "--order", "shuffle"], "fewer --epochs hold less"),
    ("plan_stage", ["--dp-size", "2", "--micro-batches", "1"], "a lower --dp-size or --micro-batches holds less"),
    ("materialize.write_run", [], "out of memory while writing the packs; lower --memory-budget or --capacity"),
])
def test_pack_out_of_memory_names_the_stage_and_the_option(corpus, tmp_path, monkeypatch, where, extra, mention):
    """`where`: a name in pipeline/run.py, or `module.name` in another module of pipeline/ (the
    first thing materialize does once its stage has begun)."""
    import importlib

    module, _, name = where.rpartition(".")
    monkeypatch.setattr(importlib.import_module(f"packctl.pipeline.{module or 'run'}"), name, _boom)
    out = tmp_path / "out"
    line = assert_clean_error(packctl("pack", corpus, "-o", out, "--capacity", "64", "--too-long", "split", "-q",
                                      *extra), 2, mention)
    assert "--resume" not in line
    assert_nothing_left(out)


def test_pack_out_of_memory_after_finished_shards(corpus, tmp_path, monkeypatch):
    """Memory runs out while a writer thread encodes a later shard: the finished ones are kept,
    the line says where, and --resume completes the run."""
    from packctl.pipeline import materialize

    out = tmp_path / "out"
    options = ["--capacity", "64", "--too-long", "split", "--shard-rows", "4", "-q"]
    with monkeypatch.context() as patch:
        patch.setattr(materialize, "encode_table", _failing_after(materialize.encode_table, 6, MemoryError()))
        assert_clean_error(packctl("pack", corpus, "-o", out, *options), 2, "out of memory while writing the packs",
                           f"the finished shards are kept in {partial_dir(out)}", "--resume")
    result = packctl("pack", corpus, "-o", out, *options, "--resume")
    assert result.code == 0, result.stderr
    assert_every_sample_once(out, [corpus])


@pytest.mark.parametrize("command, target, mention", [
    ("stats", ("packctl.stats", "input_stats"), "out of memory while running packctl stats; lower --window"),
    ("verify", ("packctl.verify", "verify"), "out of memory while running packctl verify"),
    ("export", ("packctl.export", "export"), "out of memory while running packctl export"),
    ("sample", ("packctl.sample", "generate"), "out of memory while running packctl sample; lower --sequences"),
])
def test_other_commands_out_of_memory(corpus, packed, tmp_path, monkeypatch, command, target, mention):
    import importlib

    monkeypatch.setattr(importlib.import_module(target[0]), target[1], _boom)
    args = {"stats": ["stats", corpus], "verify": ["verify", packed, "--no-attention"],
            "export": ["export", packed, "-o", tmp_path / "x", "--format", "nemo"],
            "sample": ["sample", "-o", tmp_path / "s", "--sequences", "10"]}[command]
    assert_clean_error(packctl(*args), 2, mention)
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------
# packctl sample -o and stats --plot on a full or read-only place

def test_sample_on_a_full_disk_leaves_nothing(tmp_path, monkeypatch):
    from packctl import sample

    full = OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
    monkeypatch.setattr(sample.pq, "write_table", _failing_after(sample.pq.write_table, 1, full))
    out = tmp_path / "corpus"
    assert_clean_error(packctl("sample", "-o", out, "--sequences", "20", "--shards", "3"), 2,
                       f"{out}/shard-00001.parquet: write failed (No space left on device, on the filesystem mounted at",
                       "free space there or choose another -o")
    assert not out.exists()


@pytest.mark.parametrize("where, mention", [
    ("file", "cannot be created (Not a directory); choose another -o"),
    ("read-only", "cannot be created (Read-only file system); choose another -o"),
])
def test_sample_where_a_directory_cannot_be_made(tmp_path, monkeypatch, where, mention):
    parent = tmp_path / "parent"
    if where == "file":
        parent.write_text("a regular file")
    else:  # root writes anywhere: the refusal is simulated where it happens
        def read_only(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "mkdir", read_only)
    out = parent / "corpus"
    assert_clean_error(packctl("sample", "-o", out, "--sequences", "10"), 2, str(out), mention)
    assert not out.exists()


def test_stats_plot_on_a_full_disk(corpus, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from PIL import Image

    # the first save is matplotlib's own, into memory; the second writes the file
    monkeypatch.setattr(Image.Image, "save", _failing_after(Image.Image.save, 1,
                                                            OSError(errno.ENOSPC, "No space left on device")))
    plot = tmp_path / "report.png"
    assert_clean_error(packctl("stats", corpus, "--capacity", "64", "--plot", plot), 2,
                       f"{plot}: cannot write the plot (No space left on device); choose another --plot path")


def test_a_tiny_corpus_on_the_spill_path_is_exact(tmp_path):
    """Spilled and read back, the tokens are the input's: a budget of one pack, shuffled order."""
    rows = [[k] * (1 + k % 7) for k in range(1, 60)]
    source = tmp_path / "in" / "a.parquet"
    source.parent.mkdir()
    # blocks of 8 rows: a shuffled pack waits for pieces of many blocks, and waits on disk
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), source, row_group_size=8)
    out = tmp_path / "out"
    result = packctl("pack", source, "-o", out, "--capacity", "16", "--order", "shuffle", "--memory-budget", "192",
                     "--shard-rows", "2", "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["metrics"]["throughput"]["spill_files"] > 0
    assert_every_sample_once(out, [source])


class _FillingDisk:
    """Files opened for writing on a disk with `budget["left"]` bytes free: a write that does not fit
    fails with ENOSPC, as on a full disk (reads pass)."""

    def __init__(self, fh, budget: dict):
        self._fh, self._budget = fh, budget

    def write(self, data):
        size = memoryview(data).nbytes
        if "w" in self._fh.mode or "a" in self._fh.mode:
            if size > self._budget["left"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            self._budget["left"] -= size
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


@pytest.mark.parametrize("free", [0, 64, "half", "all but 1"])
def test_megatron_export_on_a_disk_that_fills_leaves_nothing(tmp_path, monkeypatch, free):
    """The disk fills at the first .bin write, part-way through the .bin files, or while the last
    .idx is written from its side files: one line, neither -o nor its staging directory is left,
    and with --overwrite the previous export stays as it was."""
    from packctl.export import megatron

    write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[5, 6, 2], [7, 2], [8, 9, 4, 2]] * 8})
    packed = tmp_path / "packed"
    assert packctl("pack", tmp_path / "in", "-o", packed, "--capacity", "8", "--shard-rows", "3", "-q").code == 0
    args = ["export", packed, "-o", tmp_path / "export", "--format", "megatron"]
    budget = {"left": 1 << 40}
    monkeypatch.setattr(megatron, "open", lambda *a, **k: _FillingDisk(open(*a, **k), budget), raising=False)
    assert packctl(*args).code == 0
    written = (1 << 40) - budget["left"]  # the bytes the export writes through its files
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "export").iterdir())
    assert written > sum(len(b) for n, b in before if n != "megatron.json")  # side files and .idx copies too
    for target, extra in ((tmp_path / "new", []), (tmp_path / "export", ["--overwrite"])):
        budget["left"] = {"half": written // 2, "all but 1": written - 1}.get(free, free)
        args[3] = target
        assert_clean_error(packctl(*args, *extra), 2, f"{target}: write failed (No space left on device",
                           "nothing was written")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "in", "packed"]
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "export").iterdir()) == before


@pytest.mark.parametrize("fmt", ["olmo", "nemo"])
def test_export_on_a_full_disk_leaves_nothing(tmp_path, monkeypatch, fmt):
    """A write that fails part-way (the second file of the export): one line, and neither -o nor
    its staging directory is left; with --overwrite the previous export stays as it was."""
    from packctl.export import nemo, olmo

    write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[5, 6, 2], [7, 2], [8, 9, 4, 2]] * 8})
    packed = tmp_path / "packed"
    assert packctl("pack", tmp_path / "in", "-o", packed, "--capacity", "8", "--shard-rows", "3", "-q").code == 0
    args = ["export", packed, "-o", tmp_path / "export", "--format", fmt, "--eos-token-id", "2"]
    args += ["--vocab-size", "16"] if fmt == "olmo" else []
    assert packctl(*args).code == 0
    before = sorted((p.relative_to(tmp_path), p.read_bytes()) for p in (tmp_path / "export").rglob("*") if p.is_file())
    full = OSError(errno.ENOSPC, "No space left on device")
    if fmt == "olmo":
        monkeypatch.setattr(olmo, "gzip", SimpleNamespace(open=_failing_after(olmo.gzip.open, 1, full)))
    else:
        monkeypatch.setattr(nemo.pq, "write_table", _failing_after(nemo.pq.write_table, 1, full))
    for target, extra in ((tmp_path / "new", []), (tmp_path / "export", ["--overwrite"])):
        args[3] = target
        assert_clean_error(packctl(*args, *extra), 2, f"{target}: write failed (No space left on device",
                           "nothing was written")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "in", "packed"]
    assert sorted((p.relative_to(tmp_path), p.read_bytes()) for p in (tmp_path / "export").rglob("*")
                  if p.is_file()) == before

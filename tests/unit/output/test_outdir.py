"""The output directory's parts on their own: the lock, the journal, what --resume keeps, staging and
committing shards, simulated failures (output/lock.py, output/journal.py, output/outdir.py)."""
from __future__ import annotations

import json
import os
import socket

import pytest

from packctl.errors import PackctlError
from packctl.contract.manifest import ShardEntry, sha256_file
from packctl.output.journal import (JOURNAL, RUN_FILE, inspect_partial, journal_line, partial_dir,
                                    read_journal)
from packctl.output.lock import OutputLock, lock_path
from packctl.output.outdir import Faults, OutputDir


def test_a_second_run_on_the_same_output_is_refused_until_the_first_releases(tmp_path):
    out = tmp_path / "out"
    first = OutputLock(out).acquire()
    assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    with pytest.raises(PackctlError, match=r"another packctl run \(pid \d+ on .*\) is writing it"):
        OutputLock(out).acquire()
    first.release()
    assert not lock_path(out).exists()
    OutputLock(out).acquire().release()


def test_a_stale_lock_of_this_host_is_taken_over_and_another_hosts_never(tmp_path):
    out = tmp_path / "out"
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)  # a pid that no longer runs
    lock_path(out).write_text(json.dumps({"pid": gone, "host": socket.gethostname()}))
    lock = OutputLock(out).acquire()
    assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    lock.release()
    lock_path(out).write_text(json.dumps({"pid": gone, "host": "another-host"}))
    with pytest.raises(PackctlError, match="another-host"):
        OutputLock(out).acquire()


def test_release_leaves_a_lock_that_another_process_took(tmp_path):
    out = tmp_path / "out"
    lock = OutputLock(out).acquire()
    lock_path(out).write_text(json.dumps({"pid": os.getpid() + 1, "host": socket.gethostname()}))
    lock.release()
    assert lock_path(out).exists()


def _info(name: str, sha: str = "x") -> ShardEntry:
    return ShardEntry(path=name, rows=3, tokens=30, sha256=sha)


def test_journals_of_every_rank_are_read_and_a_torn_last_line_is_ignored(tmp_path):
    (tmp_path / JOURNAL).write_text(journal_line(_info("part-00001.parquet")) + '{"shard": "part-00002.par')
    (tmp_path / "journal.rank-00001.jsonl").write_text(journal_line(_info("part-00000.parquet")))
    assert [i.path for i in read_journal(tmp_path)] == ["part-00000.parquet", "part-00001.parquet"]
    assert read_journal(tmp_path)[0] == _info("part-00000.parquet")


def _interrupted(tmp_path, fingerprint: dict) -> tuple:
    out = tmp_path / "out"
    output = OutputDir.create(out, overwrite=False, fingerprint=fingerprint)
    for k in range(3):
        staged = output.stage_bytes(f"part-{k:05d}.parquet", f"shard {k}".encode(), rows=k + 1, tokens=10 * k)
        output.commit_shard(staged)
    return out, output


def test_resume_keeps_the_journaled_shards_whose_bytes_are_intact(tmp_path):
    fingerprint = {"config": {"capacity": 8}, "inputs": [], "format_version": 1, "packctl_version": "0"}
    out, output = _interrupted(tmp_path, fingerprint)
    assert output.journaled == 3 and output.finished_shards() == 3
    (output.tmp / "part-00001.parquet").write_bytes(b"damaged")
    (output.tmp / "part-00003.parquet.tmp").write_bytes(b"half")  # a shard being written when it stopped
    assert inspect_partial(tmp_path / "elsewhere", fingerprint, resume=True) is None
    with pytest.raises(PackctlError, match="left 3 finished shard.*pass --resume"):
        inspect_partial(out, fingerprint, resume=False)
    with pytest.raises(PackctlError, match="used different capacity"):
        inspect_partial(out, {**fingerprint, "config": {"capacity": 16}}, resume=True)
    kept = inspect_partial(out, fingerprint, resume=True)
    assert sorted(kept) == ["part-00000.parquet", "part-00002.parquet"]
    again = OutputDir.create(out, overwrite=False, fingerprint=fingerprint, done=kept)
    assert sorted(p.name for p in again.tmp.iterdir()) == sorted([*kept, RUN_FILE, JOURNAL, "data"])
    assert [i.path for i in read_journal(again.tmp)] == sorted(kept)


def test_a_committed_shard_is_renamed_fsynced_and_journaled_with_its_sha256(tmp_path):
    output = OutputDir.create(tmp_path / "out", overwrite=False)
    staged = output.stage_bytes("part-00000.parquet", b"bytes", rows=2, tokens=7)
    assert (output.tmp / "part-00000.parquet.tmp").exists()
    info = output.commit_shard(staged)
    assert not (output.tmp / "part-00000.parquet.tmp").exists()
    assert info == ShardEntry("part-00000.parquet", 2, 7, sha256_file(output.tmp / "part-00000.parquet"))
    assert read_journal(output.tmp) == [info]
    assert output.tmp == partial_dir(tmp_path / "out")


def test_a_simulated_full_disk_fails_the_next_write_with_a_clear_error(tmp_path):
    output = OutputDir.create(tmp_path / "out", overwrite=False, faults=Faults(fail_write_after_shards=1))
    output.commit_shard(output.stage_bytes("part-00000.parquet", b"a", rows=1, tokens=1))
    with pytest.raises(PackctlError, match=r"part-00001.parquet: write failed \(No space left on device, on the filesystem mounted at "):
        output.stage_bytes("part-00001.parquet", b"b", rows=1, tokens=1)
    assert not (output.tmp / "part-00001.parquet.tmp").exists()


def test_ranks_other_than_0_write_into_the_directory_rank_0_made(tmp_path):
    made = OutputDir.create(tmp_path / "out", overwrite=False)
    other = OutputDir(tmp_path / "out", made.tmp, rank=3)
    info = other.commit_shard(other.stage_bytes("part-00004.parquet", b"r3", rows=1, tokens=1))
    assert (made.tmp / "journal.rank-00003.jsonl").exists()
    assert read_journal(made.tmp) == [info] and made.finished_shards() == 1

"""The commit protocol on its own (output/commit.py): `publish` step by step, `recover` from every
state a crash can leave, the decision of output/resume.py, the fingerprint comparison, and the
named steps of `Faults`."""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from packctl.errors import PackctlError
from packctl.output.commit import (COMMIT_STEPS, STEPS, is_complete, legacy_old_dirs, listed_shards, old_dir,
                                   publish, recover)
from packctl.output.journal import JOURNAL, RUN_FILE, differences, journal_line, partial_dir
from packctl.output.outdir import Faults
from packctl.output.resume import inspect_output
from packctl.contract.manifest import ShardEntry

FINGERPRINT = {"format_version": 2, "packctl_version": "1.0", "config": {"seed": 0, "capacity": 8, "resume": False},
               "layout": {"capacity": 8}, "inputs": [{"path": "a.parquet", "rows": 3, "bytes": 10, "mtime_ns": 1}]}


def _manifest(shards: list[dict], **config) -> dict:
    return {"format_version": 2, "packctl_version": "1.0",
            "config": {"seed": 0, "capacity": 8, "output": "out", "overwrite": True, "resume": True, **config},
            "layout": {"capacity": 8}, "inputs": [{"path": "a.parquet", "rows": 3, "bytes": 10}],
            "shards": shards, "counts": {}}


def _write_output(directory, content: bytes = b"new", *, complete: bool = True, run_files: bool = True,
                  **config) -> None:
    """A directory as packctl writes it: one shard, and (complete) its manifest, (run_files) run.json
    and the journal."""
    (directory / "data").mkdir(parents=True)
    (directory / "data/train-00000.parquet").write_bytes(content)
    entry = ShardEntry("data/train-00000.parquet", 1, 1, hashlib.sha256(content).hexdigest())
    if run_files:
        (directory / RUN_FILE).write_text(json.dumps({"fingerprint": FINGERPRINT}))
        (directory / JOURNAL).write_text(journal_line(entry))
    if complete:
        (directory / "_metrics.json").write_text("{}")
        (directory / "_manifest.json").write_text(json.dumps(_manifest([entry.__dict__], **config)))


def _files(directory) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _beside(out) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_publish_makes_the_complete_directory_out_and_passes_each_step_in_order(tmp_path):
    out = tmp_path / "out"
    _write_output(partial_dir(out))
    passed = []
    publish(out, overwrite=False, reached=passed.append)
    assert passed == list(COMMIT_STEPS[2:])
    assert sorted(_files(out)) == ["_manifest.json", "_metrics.json", "data/train-00000.parquet"]
    assert _beside(out) == ["out"]


def test_publish_replaces_an_existing_out_only_with_overwrite(tmp_path):
    out = tmp_path / "out"
    _write_output(out, b"old")
    _write_output(partial_dir(out))
    with pytest.raises(PackctlError, match="appeared while this run wrote it.*--resume --overwrite"):
        publish(out, overwrite=False)
    assert _files(out)["data/train-00000.parquet"] == b"old" and is_complete(partial_dir(out))
    publish(out, overwrite=True)
    assert _files(out)["data/train-00000.parquet"] == b"new" and _beside(out) == ["out"]


def test_recover_with_nothing_interrupted_touches_nothing(tmp_path):
    out = tmp_path / "out"
    _write_output(partial_dir(out), complete=False)
    assert recover(out) is None
    assert _beside(out) == [".out.packctl-partial"]


def test_recover_finishes_a_swap_whose_new_output_is_complete(tmp_path):
    out = tmp_path / "out"
    _write_output(old_dir(out), b"old")
    _write_output(partial_dir(out))
    passed = []
    assert recover(out, passed.append) == "finished"
    assert passed == ["commit:journal-removed", "commit:renamed", "commit:old-removed"]
    assert _files(out)["data/train-00000.parquet"] == b"new" and RUN_FILE not in _files(out)
    assert _beside(out) == ["out"]


@pytest.mark.parametrize("partial", ["missing", "incomplete", "damaged"])
def test_recover_restores_the_old_output_when_the_new_one_is_not_complete(tmp_path, partial):
    out = tmp_path / "out"
    _write_output(old_dir(out), b"old")
    if partial != "missing":
        _write_output(partial_dir(out), complete=partial == "damaged")
    if partial == "damaged":
        (partial_dir(out) / "data/train-00000.parquet").write_bytes(b"changed")
    assert recover(out) == "restored"
    assert _files(out)["data/train-00000.parquet"] == b"old"
    assert _beside(out) == (["out"] if partial == "missing" else [".out.packctl-partial", "out"])


def test_recover_removes_the_old_output_once_the_new_one_is_in_place(tmp_path):
    out = tmp_path / "out"
    _write_output(old_dir(out), b"old")
    _write_output(out, b"new", run_files=False)
    _write_output(partial_dir(out), b"other", complete=False)  # a later run's work: not this recovery's
    assert recover(out) == "removed"
    assert _files(out)["data/train-00000.parquet"] == b"new"
    assert _beside(out) == [".out.packctl-partial", "out"]


def test_recover_handles_the_pid_named_old_outputs_of_earlier_versions(tmp_path):
    out = tmp_path / "out"
    _write_output(tmp_path / ".out.packctl-old-4242", b"older")
    time.sleep(0.01)
    _write_output(tmp_path / ".out.packctl-old-77", b"old")  # set aside last: the one OUT held
    (tmp_path / ".out.packctl-old-notapid").mkdir()  # not packctl's
    assert [p.name for p in legacy_old_dirs(out)] == [".out.packctl-old-77", ".out.packctl-old-4242"]
    assert recover(out) == "restored"
    assert _files(out)["data/train-00000.parquet"] == b"old"
    assert _beside(out) == [".out.packctl-old-notapid", "out"]


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_recover_restores_an_old_out_that_was_a_file_or_a_link_and_never_follows_the_link(tmp_path, kind):
    out, target = tmp_path / "out", tmp_path / "target"
    _write_output(target, b"kept")
    if kind == "file":
        old_dir(out).write_text("a file")
    else:
        old_dir(out).symlink_to(target)
    assert recover(out) == "restored"
    assert (out.read_text() == "a file") if kind == "file" else (out.is_symlink() and out.resolve() == target)
    _write_output(partial_dir(out))
    publish(out, overwrite=True)  # replaced: the link goes, what it pointed to stays
    assert out.is_dir() and not out.is_symlink()
    assert _files(target)["data/train-00000.parquet"] == b"kept" and _beside(out) == ["out", "target"]


def test_listed_shards_of_an_epochs_output_are_inside_their_epoch_folder(tmp_path):
    out = tmp_path / "out"
    for e in range(2):
        _write_output(out / f"epoch-0000{e}", run_files=False)
    (out / "_epochs.json").write_text(json.dumps({"epochs": 2}))
    assert [s.path for s in listed_shards(out)] == ["epoch-00000/data/train-00000.parquet",
                                                   "epoch-00001/data/train-00000.parquet"]
    (out / "_epochs.json").write_text("{")
    assert listed_shards(out) is None


def test_differences_name_what_changed_and_ignore_how_a_run_executes():
    assert differences(FINGERPRINT, FINGERPRINT) == []
    assert differences({**FINGERPRINT, "config": {**FINGERPRINT["config"], "seed": 1}}, FINGERPRINT) == ["seed"]
    assert differences({**FINGERPRINT, "packctl_version": "0.9"}, FINGERPRINT) == ["packctl_version"]
    moved = {**FINGERPRINT, "inputs": [{**FINGERPRINT["inputs"][0], "mtime_ns": 2}]}
    assert differences(moved, FINGERPRINT) == ["inputs (a.parquet changed since that run read it (modification time))"]
    manifest = _manifest([])  # output, overwrite, resume recorded; input modification times not
    assert differences(manifest, FINGERPRINT, written_ns=1) == []
    assert differences(manifest, FINGERPRINT, written_ns=0) == ["inputs (modified after it was written)"]
    assert differences(_manifest([], seed=3), FINGERPRINT, written_ns=1) == ["seed"]
    other = {**manifest, "inputs": [{"path": "b.parquet", "rows": 3, "bytes": 10}]}
    assert differences(other, FINGERPRINT, written_ns=1) == ["inputs (paths, rows or sizes)"]


def _complete_out(tmp_path, **config):
    out = tmp_path / "out"
    _write_output(out, run_files=False, **config)
    for path in out.rglob("*"):  # written after the inputs (mtime_ns 1)
        os.utime(path, ns=(10**18, 10**18))
    return out


def test_inspect_output_on_an_existing_out(tmp_path):
    out = _complete_out(tmp_path)
    assert inspect_output(out, FINGERPRINT, resume=False, overwrite=False).complete  # the same command again
    assert inspect_output(out, FINGERPRINT, resume=True, overwrite=False).complete
    assert inspect_output(out, FINGERPRINT, resume=True, overwrite=True).complete  # kept as it is
    assert not inspect_output(out, FINGERPRINT, resume=False, overwrite=True).complete
    changed = {**FINGERPRINT, "config": {**FINGERPRINT["config"], "seed": 5}}
    with pytest.raises(PackctlError, match=r"already exists and is not the output of this command: it differs in "
                                           r"seed; pass --overwrite"):
        inspect_output(out, changed, resume=True, overwrite=False)
    assert not inspect_output(out, changed, resume=True, overwrite=True).complete  # replaced
    with pytest.raises(PackctlError, match=r"out: already exists; pass --overwrite"):
        inspect_output(out, changed, resume=False, overwrite=False)
    (out / "data/train-00000.parquet").unlink()
    with pytest.raises(PackctlError, match="its shard data/train-00000.parquet is missing"):
        inspect_output(out, FINGERPRINT, resume=True, overwrite=False)
    (out / "_manifest.json").write_text(json.dumps({"shards": [], "made_by": "another packer"}))
    with pytest.raises(PackctlError, match="its _manifest.json is not one packctl pack writes"):
        inspect_output(out, FINGERPRINT, resume=True, overwrite=False)


def test_inspect_output_on_a_complete_partial_directory(tmp_path):
    out = tmp_path / "out"
    tmp = partial_dir(out)
    _write_output(tmp)
    with pytest.raises(PackctlError, match=r"left its complete output \(1 shards\).*pass --resume to finish it"):
        inspect_output(out, FINGERPRINT, resume=False, overwrite=False)
    assert inspect_output(out, FINGERPRINT, resume=True, overwrite=False).publish
    (tmp / RUN_FILE).unlink()  # removed by commit step 5: compared by its manifest instead
    os.utime(tmp / "_manifest.json", ns=(10**18, 10**18))
    assert inspect_output(out, FINGERPRINT, resume=True, overwrite=False).publish
    changed = {**FINGERPRINT, "config": {**FINGERPRINT["config"], "capacity": 16}}
    with pytest.raises(PackctlError, match="--resume refused: .* used different capacity"):
        inspect_output(out, changed, resume=True, overwrite=False)
    (tmp / "data/train-00000.parquet").write_bytes(b"damaged")
    found = inspect_output(out, FINGERPRINT, resume=True, overwrite=False)
    assert not found.publish and found.done == {}  # its shards are written again


def test_faults_name_steps_and_count_passes():
    assert len(set(STEPS)) == len(STEPS)
    with pytest.raises(ValueError, match="not a step"):
        Faults(kill_at="commit:no-such-step")
    alias = Faults(kill_after_shards=3)
    assert (alias.kill_at, alias.kill_count) == ("shard:journaled", 3)
    seen = []
    faults = Faults(kill_at="shard:renamed", kill_count=2, kill_rank=1, on_step=seen.append)
    assert [faults.due("shard:renamed", rank=1) for _ in range(3)] == [False, True, False]
    assert not faults.due("shard:renamed", rank=0)
    assert seen == ["shard:renamed"] * 4
    with pytest.raises(AssertionError, match="unnamed step"):
        faults.due("commit:something-new")

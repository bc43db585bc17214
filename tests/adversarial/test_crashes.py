"""Crashes at any moment, the output lock, and a run that already completed (docs/errors.md:
"Crashes at any moment", "The output lock", "Interrupted runs and --resume").

The harness stops a real `packctl pack` process with SIGKILL at every named step of the commit
protocol, of `--resume` and of writing a shard (packctl/output/commit.py `STEPS`), in one process
(forked from this one: `support.faulty_pack.run_forked`) and under `mpiexec -n 3`, writing a new
OUT or replacing one with --overwrite. Then, from a copy of what the kill left:

- the same command with `--resume` (what a scheduler's retry loop runs) completes at once, with
  every shard's sha256 and the manifest (but timings, resume, output, overwrite) of an
  uninterrupted run, nothing left beside OUT, and no finished shard written again;
- the same command without `--resume` either completes the same way or stops in one line that
  says what to do (PLAIN_RERUN), and loses nothing;
- between the kill and the rerun, OUT holds the old output or the complete new one, never
  nothing (for the moment of the swap: the old one beside a complete new one).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from packctl.output.commit import (COMMIT_STEPS, OPEN_STEPS, RESUME_STEPS, SHARD_STEPS, STEPS,
                                   is_complete, old_dir)
from packctl.output.journal import partial_dir, read_journal
from packctl.output.lock import lock_path
from packctl.output.outdir import Faults
from support.data import sample_corpus
from support.adversary import (assert_clean_error, assert_complete, assert_every_sample_once, assert_nothing_left,
                               leftovers, packctl, packctl_process)
from support.faulty_pack import fork_pack, run_forked
from support.paths import FAULTY_PACK, MPIEXEC

# 4 shards of up to 150 packs (2 row groups each), so that under 3 ranks writers share shards
OPTIONS = ["--capacity", "256", "--too-long", "split", "--shard-rows", "150", "--order", "shuffle", "-q"]
SHARDS = 4

# Where a kill leaves finished shards: the k-th pass of the step (the committer journals one shard
# at a time, so at the 3rd rename two are journaled; at the 1st staging none is).
KILL_COUNT = {"shard:staged": 1, "shard:renamed": 3, "shard:journal-torn": 3, "shard:journaled": 3}

# The same command run again WITHOUT --resume after a kill at each step: "ok" completes; "resume"
# refuses in one line saying to pass --resume (finished work waits: nothing is thrown away
# without being asked); "complete": OUT is this command's complete output already: exit 0,
# "already complete with these inputs and options; nothing to do".
_PLAIN = {"lock:taken": "ok", "open:created": "ok", "shard:staged": "ok", "shard:renamed": "resume",
          "shard:journal-torn": "resume", "shard:journaled": "resume", "commit:metrics-written": "resume",
          "commit:manifest-written": "resume", "commit:old-set-aside": "resume", "commit:journal-removed": "resume",
          "commit:renamed": "complete", "commit:old-removed": "complete",
          **{step: "resume" for step in RESUME_STEPS}}  # the journal of the kept shards is there
PLAIN_RERUN = {
    False: _PLAIN,
    # replacing OUT: once OUT was set aside, the next run finishes the swap, then --overwrite packs again
    True: {**_PLAIN, "commit:old-set-aside": "ok", "commit:journal-removed": "ok", "commit:renamed": "ok",
           "commit:old-removed": "ok"},
}

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install 'packctl[mpi]')")


def snapshot(out: Path) -> tuple[dict[str, str], dict]:
    """sha256 of every file of OUT but the reports, and the manifest without timings and the options
    that say how and where a run executes."""
    out = Path(out)
    files = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(out.rglob("*")) if p.is_file() and p.name not in ("_manifest.json", "_metrics.json")}
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest.pop("timings")
    for key in ("resume", "output", "overwrite", "memory_budget"):
        manifest["config"].pop(key)
    return files, manifest


@dataclass
class Output:
    path: Path
    snapshot: tuple


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return sample_corpus(tmp_path_factory.mktemp("corpus") / "corpus", sequences=300, distribution="lognormal",
                         shards=2, seed=0, max_length=1000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Output:
    """What an uninterrupted run writes."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert packctl("pack", corpus, "-o", out, *OPTIONS).code == 0
    assert_every_sample_once(out, [corpus])
    assert len(json.loads((out / "_manifest.json").read_text())["shards"]) == SHARDS
    return Output(out, snapshot(out))


@pytest.fixture(scope="module")
def old_output(tmp_path_factory, corpus, reference) -> Output:
    """An OUT that --overwrite replaces: other options, other bytes."""
    out = tmp_path_factory.mktemp("old") / "out"
    assert packctl("pack", corpus, "-o", out, *OPTIONS, "--seed", "7").code == 0
    assert snapshot(out)[0] != reference.snapshot[0]
    return Output(out, snapshot(out))


def command(corpus: Path, out: Path, overwrite: bool = False) -> list[str]:
    return ["pack", str(corpus), "-o", str(out), *OPTIONS, *(["--overwrite"] if overwrite else [])]


def killed(argv: list[str], step: str, count: int = 1) -> None:
    """Run `packctl ARGV` in a process of its own that SIGKILLs itself at the count-th pass of `step`."""
    code, _, err = run_forked(argv, Faults(kill_at=step, kill_count=count))
    assert code == -signal.SIGKILL, f"not killed at {step} (exit {code}): {err}"


def killed_under_mpi(argv: list[str], step: str, rank: int | None = None) -> None:
    faults = ["--kill-at", step, *(["--kill-rank", str(rank)] if rank is not None else [])]
    result = packctl_process(*argv, launcher=[MPIEXEC, "-n", "3", sys.executable, str(FAULTY_PACK), *faults])
    assert result.code != 0, f"not killed at {step}: {result.stderr}"


def assert_never_lost(out: Path, old: Output | None, new: Output) -> None:
    """OUT holds the old output or the complete new one; only while the swap is under way is OUT
    missing, with the old output beside it (-old) and the new one complete in the partial directory."""
    if os.path.lexists(out):
        assert snapshot(out) in ([old.snapshot] if old else []) + [new.snapshot]
    elif old is not None:
        assert snapshot(old_dir(out)) == old.snapshot and is_complete(partial_dir(out))


def finished(out: Path) -> int | None:
    """Journaled shards an interrupted run left (None: no partial directory short of complete)."""
    tmp = partial_dir(out)
    return len(read_journal(tmp)) if tmp.is_dir() and not is_complete(tmp) else None


def assert_resume_completes(out: Path, argv: list[str], new: Output, kept: int | None) -> None:
    """One rerun with --resume ends with the uninterrupted run's output, nothing left beside it, and
    the `kept` finished shards not written again."""
    result = packctl(*argv, "--resume", "--json")
    assert result.code == 0, result.stderr
    assert snapshot(out) == new.snapshot
    assert_complete(out)
    if result.lines:  # OUT was complete, or the partial directory was: nothing packed again
        assert len(result.lines) == 1 and "already complete" in result.lines[0], result.stderr
    else:
        assert json.loads(result.stdout)["metrics"]["throughput"]["resumed_shards"] == (kept or 0)


def save(where: Path) -> Path:
    saved = where.parent / f"{where.name}-saved"
    shutil.copytree(where, saved, symlinks=True)
    return saved


def restore(saved: Path, where: Path) -> None:
    shutil.rmtree(where)
    shutil.copytree(saved, where, symlinks=True)


def assert_both_reruns(tmp_path: Path, out: Path, argv: list[str], step: str, overwrite: bool, old: Output | None,
                       new: Output) -> None:
    """From what a kill left: the retry with --resume, and (from the same state) the plain rerun."""
    assert_never_lost(out, old, new)
    kept = finished(out)
    saved = save(tmp_path)
    assert_resume_completes(out, argv, new, kept)
    restore(saved, tmp_path)
    plain = packctl(*argv)
    expected = PLAIN_RERUN[overwrite][step]
    if expected in ("ok", "complete"):
        assert plain.code == 0, plain.stderr
        assert snapshot(out) == new.snapshot
        assert_complete(out)
        if expected == "complete":
            assert plain.lines == [f"{out}: already complete with these inputs and options; nothing to do"]
        return
    assert_clean_error(plain, 2, "pass --resume")
    assert_never_lost(out, old, new)
    assert_resume_completes(out, argv, new, kept)


# ---- the harness: one process ---------------------------------------------------------------------

@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("step", OPEN_STEPS + SHARD_STEPS + COMMIT_STEPS)
def test_killed_at_every_step(tmp_path, corpus, reference, old_output, step, overwrite):
    out = tmp_path / "out"
    if overwrite:
        shutil.copytree(old_output.path, out)
    argv = command(corpus, out, overwrite)
    killed(argv, step, KILL_COUNT.get(step, 1))
    assert_both_reruns(tmp_path, out, argv, step, overwrite, old_output if overwrite else None, reference)


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("step", RESUME_STEPS)
def test_killed_at_every_step_of_resume(tmp_path, corpus, reference, old_output, step, overwrite):
    """A resume that cleans the partial directory is killed in the middle: the journal of the kept
    shards is written before anything is removed, so the next --resume keeps the same two."""
    out = tmp_path / "out"
    if overwrite:
        shutil.copytree(old_output.path, out)
    argv = command(corpus, out, overwrite)
    killed(argv, "shard:renamed", 3)  # two shards journaled, a third renamed but not journaled
    killed([*argv, "--resume"], step)
    assert finished(out) == 2
    assert_both_reruns(tmp_path, out, argv, step, overwrite, old_output if overwrite else None, reference)


@pytest.mark.parametrize("overwrite, first, second", [
    (True, "commit:old-set-aside", "commit:journal-removed"),   # killed again while recovery finishes the swap
    (True, "commit:old-set-aside", "commit:renamed"),
    (True, "commit:journal-removed", "commit:old-removed"),
    (False, "commit:manifest-written", "commit:old-set-aside"),  # killed again while --resume publishes
    (False, "commit:manifest-written", "commit:renamed"),
    (False, "commit:journal-removed", "commit:journal-removed"),
])
def test_killed_again_while_the_rerun_finishes_the_commit(tmp_path, corpus, reference, old_output, overwrite, first,
                                                          second):
    out = tmp_path / "out"
    if overwrite:
        shutil.copytree(old_output.path, out)
    argv = command(corpus, out, overwrite)
    killed(argv, first)
    killed([*argv, "--resume"], second)
    assert_never_lost(out, old_output if overwrite else None, reference)
    assert_resume_completes(out, argv, reference, None)


def test_every_named_step_is_reached(tmp_path, corpus):
    """The harness iterates STEPS: each is a point real runs pass (join steps: under several
    writers, tests/integration of materialize), so no step is named and never tested."""
    from support.threadcomm import run_ranks

    from packctl import PackConfig, pack

    passed: list[str] = []
    argv = command(corpus, tmp_path / "out")
    killed(argv, "shard:renamed", 3)
    config = dict(inputs=[str(corpus)], capacity=256, too_long="split", shard_rows=150, order="shuffle")
    pack(PackConfig(output=str(tmp_path / "out"), resume=True, **config), faults=Faults(on_step=passed.append))
    pack(PackConfig(output=str(tmp_path / "out"), overwrite=True, **config), faults=Faults(on_step=passed.append))
    run_ranks(3, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **config), comm=comm,
                                   faults=Faults(on_step=passed.append)))
    assert set(STEPS) - set(passed) == set()
    commit = [step for step in passed if step.startswith("commit:")]
    assert commit[:len(COMMIT_STEPS)] == list(COMMIT_STEPS)  # in the documented order


# ---- the harness: mpiexec -n 3 ---------------------------------------------------------------------

def _mpi_cases():
    for step in STEPS:
        if step in RESUME_STEPS:
            continue
        yield pytest.param(step, False, id=f"{step}-new")
        if step in COMMIT_STEPS:
            yield pytest.param(step, True, id=f"{step}-overwrite")


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("step, overwrite", list(_mpi_cases()))
def test_killed_at_every_step_under_mpi(tmp_path, corpus, reference, old_output, step, overwrite):
    """Rank 1 dies while writing shards; whichever rank gets there first dies joining a shared
    shard; rank 0 dies at the steps only it takes (the lock, the partial directory, the commit).
    mpiexec then ends the others, and rank 0's lock stays (stale: taken over)."""
    out = tmp_path / "out"
    if overwrite:
        shutil.copytree(old_output.path, out)
    argv = command(corpus, out, overwrite)
    killed_under_mpi(argv, step, rank=1 if step in SHARD_STEPS else None)
    old = old_output if overwrite else None
    assert_never_lost(out, old, reference)
    assert_resume_completes(out, argv, reference, finished(out))


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize("first, second", [
    ("shard:renamed", "resume:journal-compacted"),
    ("shard:renamed", "resume:cleaning"),
    ("shard:renamed", "resume:cleaned"),
    ("commit:old-set-aside", "commit:renamed"),
])
def test_resumed_under_mpi_and_killed_again(tmp_path, corpus, reference, old_output, first, second):
    """The reruns under mpiexec too: a resume killed while it cleans (or, replacing OUT, while it
    finishes the swap), then a resume of 3 ranks that completes, the outcome shared by every rank."""
    out = tmp_path / "out"
    shutil.copytree(old_output.path, out)
    argv = command(corpus, out, overwrite=True)
    killed(argv, first, KILL_COUNT.get(first, 1))
    killed_under_mpi([*argv, "--resume"], second)
    assert_never_lost(out, old_output, reference)
    result = packctl_process(*argv, "--resume", launcher=[MPIEXEC, "-n", "3", sys.executable, "-m", "packctl"])
    assert result.code == 0, result.stderr
    assert snapshot(out) == reference.snapshot
    assert_complete(out)


# ---- the output lock ----------------------------------------------------------------------------------

def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, corpus):
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    assert packctl(*command(corpus, out)).code == 0
    assert_every_sample_once(out, [corpus])


def test_an_empty_lock_left_by_an_older_packctl_is_taken_over_once_old(tmp_path, corpus):
    out = tmp_path / "out"
    lock_path(out).write_text("")
    result = packctl(*command(corpus, out))
    assert_clean_error(result, 2, str(lock_path(out)), "empty or unreadable", "delete it if no packctl run")
    assert leftovers(out) == [lock_path(out)] and not out.exists()
    an_hour_ago = time.time() - 3600
    os.utime(lock_path(out), (an_hour_ago, an_hour_ago))
    assert packctl(*command(corpus, out)).code == 0
    assert_every_sample_once(out, [corpus])


def test_a_lock_of_another_host_is_refused(tmp_path, corpus):
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": 4242, "host": "node-elsewhere"}))
    result = packctl(*command(corpus, out))
    assert_clean_error(result, 2, "another packctl run (pid 4242 on node-elsewhere)",
                       "delete the lock file if that run is gone")
    assert leftovers(out) == [lock_path(out)] and not out.exists()


def test_a_second_run_waits_for_the_one_writing_out(tmp_path, corpus):
    """The first run is frozen (SIGSTOP) after its first shard, holding the lock: the second is
    refused, naming it; the first, continued, completes."""
    out = tmp_path / "out"
    first = fork_pack(command(corpus, out), Faults(kill_at="shard:journaled", kill_signal=signal.SIGSTOP))
    try:
        assert first.stopped()
        second = packctl(*command(corpus, out))
        assert_clean_error(second, 2, f"another packctl run (pid {first.pid} on {socket.gethostname()})",
                           "is writing it", "wait for it to finish")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    code, _, err = first.wait()
    assert code == 0, err
    assert_every_sample_once(out, [corpus])


def test_two_runs_started_together_write_out_once(tmp_path, corpus):
    out = tmp_path / "out"
    runs = [fork_pack(command(corpus, out), Faults()) for _ in range(2)]
    results = sorted((run.wait() for run in runs), key=lambda r: r[0])
    # the second either meets the first's lock (refused, exit 2), or starts once the first has
    # committed and finds its output complete (exit 0, nothing written): out is written once
    codes = [code for code, _, _ in results]
    assert codes in ([0, 2], [0, 0]), results
    said = (results[1][2] if codes == [0, 2] else "".join(r[2] for r in results)).strip()
    assert "Traceback" not in said and len(said.splitlines()) == 1, said
    if codes == [0, 2]:
        assert "another packctl run" in said or "already exists" in said, said
    else:
        assert "already complete with these inputs and options; nothing to do" in said, said
    assert_every_sample_once(out, [corpus])


@pytest.fixture
def full_disk(tmp_path):
    """A real filesystem with no space left (a 2 MiB tmpfs, filled), where it can be mounted."""
    mount = tmp_path / "full"
    mount.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        made = None
    if made is None or made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        with open(mount / "filler", "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 4096)
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_a_disk_full_before_the_run_starts_fails_in_one_line_and_leaves_no_lock(full_disk, corpus):
    out = full_disk / "out"
    result = packctl(*command(corpus, out))
    assert_clean_error(result, 2, f"{lock_path(out)}: write failed (No space left on device, on the filesystem "
                                  f"mounted at {full_disk})", "free space there")
    assert_nothing_left(out)
    (full_disk / "filler").unlink()  # space again: the next run is not blocked by anything
    assert packctl(*command(corpus, out)).code == 0
    assert_every_sample_once(out, [corpus])


# ---- a run that already completed --------------------------------------------------------------------

def test_a_retry_loop_after_success_exits_0_and_changes_nothing(tmp_path, corpus, reference):
    out = tmp_path / "out"
    argv = [*command(corpus, out), "--resume"]
    assert packctl(*argv).code == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    for _ in range(2):
        again = packctl(*argv, "--json")
        assert again.code == 0 and again.lines == [f"{out}: already complete with these inputs and options; "
                                                   "nothing to do"], again.stderr
        assert json.loads(again.stdout)["shards"] == SHARDS
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert snapshot(out) == reference.snapshot
    assert_every_sample_once(out, [corpus])
    summary = packctl(*command(corpus, out)[:-1], "--resume")  # without -q: the summary as usual
    assert summary.code == 0 and "packctl pack ->" in summary.stdout and "already complete" in summary.stderr


def test_the_same_command_again_exits_0_and_changes_nothing(tmp_path, corpus, reference):
    """Running the command that made OUT again (a README run twice, a notebook cell) is not an
    error: OUT holds its result already. Other options, or inputs changed since, still need
    --overwrite."""
    out = tmp_path / "out"
    assert packctl(*command(corpus, out)).code == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = packctl(*command(corpus, out))
    assert again.code == 0 and again.lines == [f"{out}: already complete with these inputs and options; nothing "
                                               "to do"], again.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert_complete(out)
    other = packctl(*command(corpus, out), "--seed", "3")
    assert_clean_error(other, 2, f"{out}: already exists; pass --overwrite")
    assert snapshot(out) == reference.snapshot


def test_the_python_api_advises_keyword_arguments(tmp_path, corpus):
    from packctl import PackConfig, PackctlError, pack

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PackctlError) as refused:
        pack(PackConfig(inputs=[str(corpus)], output=str(out), capacity=256, too_long="split"))
    assert str(refused.value) == f"{out}: already exists; pass overwrite=True to replace it or choose another -o"


def test_resume_on_a_complete_out_of_other_options_is_refused_naming_what_differs(tmp_path, corpus, reference):
    out = tmp_path / "out"
    assert packctl(*command(corpus, out)).code == 0
    result = packctl(*command(corpus, out), "--resume", "--seed", "3", "--capacity", "512")
    assert_clean_error(result, 2, f"{out}: already exists and is not the output of this command",
                       "it differs in capacity, seed", "pass --overwrite")
    assert snapshot(out) == reference.snapshot
    replaced = packctl(*command(corpus, out, overwrite=True), "--resume", "--seed", "3")  # defined: replaced
    assert replaced.code == 0 and not replaced.lines
    assert snapshot(out) != reference.snapshot
    assert_every_sample_once(out, [corpus])


def test_resume_on_an_out_another_tool_wrote_is_refused(tmp_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_manifest.json").write_text(json.dumps({"shards": ["a"], "tool": "other-packer"}))
    result = packctl(*command(corpus, out), "--resume")
    assert_clean_error(result, 2, "already exists and is not the output of this command",
                       "its _manifest.json is not one packctl pack writes")
    assert sorted(p.name for p in out.iterdir()) == ["_manifest.json"] and leftovers(out) == []


def test_resume_after_inputs_changed_since_out_was_written_is_refused(tmp_path, corpus):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    out = tmp_path / "out"
    assert packctl(*command(data, out)).code == 0
    first = sorted(data.glob("*.parquet"))[0]
    os.utime(first, ns=(first.stat().st_atime_ns, time.time_ns() + 10**9))
    result = packctl(*command(data, out), "--resume")
    assert_clean_error(result, 2, "it differs in inputs (modified after it was written)")


# ---- a partial directory changed or damaged between runs ---------------------------------------------

def test_a_partial_directory_whose_run_file_is_garbage_is_never_resumed_nor_thrown_away(tmp_path, corpus, reference):
    out = tmp_path / "out"
    argv = command(corpus, out)
    killed(argv, "shard:journaled", 2)
    (partial_dir(out) / "run.json").write_text("{not json")
    for extra in ([], ["--resume"]):
        result = packctl(*argv, *extra)
        assert_clean_error(result, 2, str(partial_dir(out)), "no readable run.json", "delete that directory")
        assert finished(out) == 2 and not out.exists()
    shutil.rmtree(partial_dir(out))
    assert packctl(*argv).code == 0 and snapshot(out) == reference.snapshot
    assert_every_sample_once(out, [corpus])


@pytest.mark.parametrize("damage", ["deleted", "modified"])
@pytest.mark.parametrize("complete", [False, True], ids=["journaled", "complete"])
def test_a_finished_shard_deleted_or_modified_before_resume_is_written_again(tmp_path, corpus, reference, damage,
                                                                              complete):
    out = tmp_path / "out"
    argv = command(corpus, out)
    killed(argv, "commit:journal-removed" if complete else "shard:journaled", 1 if complete else 3)
    victim = partial_dir(out) / "data/train-00001.parquet"
    victim.unlink() if damage == "deleted" else victim.write_bytes(victim.read_bytes()[:-8] + b"tampered")
    result = packctl(*argv, "--resume", "--json")
    assert result.code == 0 and not result.lines, result.stderr
    assert json.loads(result.stdout)["metrics"]["throughput"]["resumed_shards"] == (SHARDS if complete else 3) - 1
    assert snapshot(out) == reference.snapshot
    assert_every_sample_once(out, [corpus])


@pytest.mark.parametrize("kind", ["file", "symlink", "dangling symlink"])
@pytest.mark.parametrize("step", ["commit:metrics-written", "commit:old-set-aside", "commit:renamed"])
def test_killed_while_overwriting_an_out_that_is_a_file_or_a_link(tmp_path, corpus, reference, kind, step):
    """--overwrite replaces the file or the link itself, never what a link points to; a kill before
    the new output is complete leaves the file or the link where it was."""
    out, target = tmp_path / "out", tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    if kind == "file":
        out.write_text("a file")
    else:
        out.symlink_to(target if kind == "symlink" else tmp_path / "nowhere")
    if kind == "dangling symlink":  # it exists as a name: replacing it needs --overwrite too
        assert_clean_error(packctl(*command(corpus, out)), 2, "already exists")
    argv = command(corpus, out, overwrite=True)
    killed(argv, step)
    if step == "commit:metrics-written":  # the new output is not complete: OUT is what it was
        assert out.is_symlink() if kind != "file" else out.read_text() == "a file"
    result = packctl(*argv, "--resume")
    assert result.code == 0, result.stderr
    assert out.is_dir() and not out.is_symlink() and snapshot(out) == reference.snapshot
    assert (target / "keep.txt").read_text() == "precious"
    assert_every_sample_once(out, [corpus])


@pytest.mark.parametrize("legacy", ["old output, no new one", "old output beside a complete new one",
                                    "old output beside OUT"])
def test_old_outputs_left_by_earlier_versions_are_restored_or_removed(tmp_path, corpus, reference, old_output,
                                                                      legacy):
    """Earlier versions set OUT aside as `.OUT.packctl-old-<PID>` and leaked it when killed."""
    out = tmp_path / "out"
    if legacy == "old output beside a complete new one":
        killed(command(corpus, out), "commit:journal-removed")
    elif legacy == "old output beside OUT":
        shutil.copytree(reference.path, out)
    shutil.copytree(old_output.path, tmp_path / ".out.packctl-old-31337")
    result = packctl(*command(corpus, out), "--resume")
    if legacy == "old output, no new one":  # it comes back as OUT, and is not this command's output
        assert_clean_error(result, 2, "already exists and is not the output of this command", "seed")
        assert snapshot(out) == old_output.snapshot and leftovers(out) == []
        return
    assert result.code == 0 and "already complete" in result.stderr, result.stderr
    assert snapshot(out) == reference.snapshot
    assert_every_sample_once(out, [corpus])


@pytest.mark.parametrize("step", ["shard:journaled", "commit:manifest-written"])
def test_outs_parent_removed_during_the_run(tmp_path, corpus, step):
    """Somebody removes the directory OUT is written in: the run stops in one line, and never
    starts over in a directory of its own making (shards finished before would be missing)."""
    parent = tmp_path / "work"
    parent.mkdir()
    out = parent / "out"

    def remove_parent(passed: str) -> None:
        if passed == step and parent.exists():
            shutil.rmtree(parent)

    from packctl import pipeline

    original = pipeline.pack
    pipeline.pack = lambda *a, **k: original(*a, **{**k, "faults": Faults(on_step=remove_parent)})
    try:
        result = packctl(*command(corpus, out))
    finally:
        pipeline.pack = original
    assert_clean_error(result, 2, "was removed while this run wrote it", "run again")
    assert not parent.exists()


# ---- signals while a commit is finished --------------------------------------------------------------

def test_sigterm_during_the_commit_waits_for_it_and_the_run_completes(tmp_path, corpus, reference):
    out = tmp_path / "out"
    code, _, err = run_forked(command(corpus, out), Faults(kill_at="commit:manifest-written",
                                                          kill_signal=signal.SIGTERM))
    assert code == 0, err
    assert snapshot(out) == reference.snapshot
    assert_every_sample_once(out, [corpus])


def test_sigterm_while_a_run_finishes_an_interrupted_commit_stops_it_after(tmp_path, corpus, reference, old_output):
    """The swap an earlier run left half done is finished first (the signal waits), then the run
    stops as interrupted runs do (143), before it packs anything."""
    out = tmp_path / "out"
    shutil.copytree(old_output.path, out)
    argv = command(corpus, out, overwrite=True)
    killed(argv, "commit:old-set-aside")
    code, _, err = run_forked(argv, Faults(kill_at="commit:journal-removed", kill_signal=signal.SIGTERM))
    assert code == 143, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert snapshot(out) == reference.snapshot
    assert_complete(out)


# ---- signals during an export ------------------------------------------------------------------

@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_an_export_leaves_nothing(tmp_path, monkeypatch, signum, code):
    """SIGINT or SIGTERM after the first file of an olmo export is written: exit 130 / 143, one
    line, and no -o, no staging directory beside it (a real signal, delivered to this process)."""
    from support.data import write_table
    from packctl.export import olmo

    write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[5, 6, 2], [7, 2], [8, 9, 4, 2]] * 8})
    packed = tmp_path / "packed"
    assert packctl("pack", tmp_path / "in", "-o", packed, "--capacity", "8", "--shard-rows", "3", "-q").code == 0
    real, calls = olmo.document_ends, {"n": 0}

    def signalled(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(olmo, "document_ends", signalled)
    target = tmp_path / "olmo"
    assert_clean_error(packctl("export", packed, "-o", target, "--format", "olmo", "--eos-token-id", "2",
                               "--vocab-size", "16"), code, f"export interrupted by {signal.Signals(signum).name}",
                       "nothing was written")
    assert calls["n"] == 2
    assert_nothing_left(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "packed"]


@pytest.mark.parametrize("step, count", [("add", 4), ("finalize", 2)])
def test_a_kill_during_a_megatron_export_leaves_nothing_that_looks_complete(tmp_path, step, count):
    """SIGKILL (nothing can clean up) when shard 1 arrives, or after tokens.bin/.idx are complete:
    there is no -o, so nothing a reader given DIR could open; what is left is the partial directory,
    named as packctl's (.DIR.packctl-export-partial) and without megatron.json, and the lock; the
    same export run again removes both and completes with the bytes of an export never interrupted."""
    from support.data import write_table

    write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[5, 6, 2], [7, 2], [8, 9, 4, 2]] * 8})
    packed = tmp_path / "packed"
    assert packctl("pack", tmp_path / "in", "-o", packed, "--capacity", "8", "--shard-rows", "3", "-q").code == 0
    target = tmp_path / "megatron"
    argv = ["export", str(packed), "-o", str(target), "--format", "megatron"]
    pid = os.fork()
    if pid == 0:  # the child: the export, killed at the count-th call of IndexedWriter.<step>
        try:
            from packctl.cli.app import run
            from packctl.export import megatron

            real, calls = getattr(megatron.IndexedWriter, step), {"n": 0}

            def killed(writer, *args, **kwargs):
                calls["n"] += 1
                if calls["n"] == count:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(writer, *args, **kwargs)

            setattr(megatron.IndexedWriter, step, killed)
            run(argv)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert not os.path.lexists(target)
    left = leftovers(target)
    assert [p.name for p in left] == [".megatron.packctl-export-partial", ".megatron.packctl-lock"], left
    assert (left[0] / "tokens.bin").exists() and not (left[0] / "megatron.json").exists()
    assert (left[0] / "tokens.idx").exists() == (step == "finalize")
    assert packctl(*argv).code == 0  # the killed export's lock is stale and its partial directory removed
    assert leftovers(target) == []
    assert packctl("export", packed, "-o", tmp_path / "clean", "--format", "megatron").code == 0
    assert ({p.name: p.read_bytes() for p in target.iterdir()} ==
            {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()})

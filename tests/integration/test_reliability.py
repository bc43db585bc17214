"""Crashes lose nothing: journaled shards, `--resume` to byte-identical output, the output lock,
SIGINT / SIGTERM, a full disk (docs/errors.md).

Crashes are made by running the real CLI through tests/support/faulty_pack.py, which hands `pack` a
`Faults` object: `--kill-after k` (SIGKILL, or `k:SIGTERM`, right after the k-th shard is
journaled) and `--fail-write-after k` (the next shard write fails with ENOSPC).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.data import sample_corpus
from support.contract import check_contract
from support.adversary import packctl
from support.paths import FAULTY_PACK, MPIEXEC
from packctl import PackConfig, PackctlError, pack

OPTIONS = ["--capacity", "2048", "--too-long", "split", "--shard-rows", "6", "--order", "shuffle", "-q"]
SHARDS = 19  # what OPTIONS make of the corpus below (checked by the reference fixture)


def run_pack(corpus: Path, out: Path, *extra: str, faults: list[str] | None = None,
             mpi: int = 0, own_process: bool = False) -> subprocess.CompletedProcess:
    """`packctl pack`: in a process of its own with `faults` (tests/support/faulty_pack.py options, a
    kill or a failed write) or `mpi` ranks; otherwise (the reruns) in this process, with the same
    exit codes and messages."""
    args = ["pack", str(corpus), "-o", str(out), *OPTIONS, *extra]
    if not faults and not mpi and not own_process:
        result = packctl(*args)
        return subprocess.CompletedProcess(["packctl", *args], result.code, result.stdout, result.stderr)
    launcher = [sys.executable, str(FAULTY_PACK), *faults] if faults else [sys.executable, "-m", "packctl"]
    cmd = [*launcher, *args]
    if mpi:
        cmd = [MPIEXEC, "-n", str(mpi), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def snapshot(out: Path) -> tuple[dict[str, str], dict]:
    """sha256 of every file of OUT but the reports, and the manifest without timings and the options
    that say how and where a run executes (`resume`, `output`, `memory_budget`)."""
    files = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(out.rglob("*")) if p.is_file() and p.name not in ("_manifest.json", "_metrics.json")}
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest.pop("timings")
    for key in ("resume", "output", "memory_budget"):
        manifest["config"].pop(key)
    return files, manifest


def journal_lines(out: Path) -> list[dict]:
    partial = out.parent / f".{out.name}.packctl-partial"
    return [json.loads(line) for line in (partial / "journal.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return sample_corpus(tmp_path_factory.mktemp("corpus") / "corpus", sequences=400, distribution="lognormal",
                         shards=3, seed=0, max_length=3000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, contract):
    out = tmp_path_factory.mktemp("ref") / "out"
    proc = run_pack(corpus, out)
    assert proc.returncode == 0, proc.stderr
    files, manifest = snapshot(out)
    assert len(files) == SHARDS and set(files) == {s["path"] for s in manifest["shards"]}
    assert check_contract(contract, out, [corpus]) == []
    return files, manifest


def assert_interrupted_and_consistent(out: Path, proc: subprocess.CompletedProcess, finished: int) -> None:
    """No OUT, a partial directory whose journal lists `finished` shards, each matching its sha256."""
    assert not out.exists()
    partial = out.parent / f".{out.name}.packctl-partial"
    lines = journal_lines(out)
    assert len(lines) == finished, proc.stderr
    for entry in lines:
        assert hashlib.sha256((partial / entry["shard"]).read_bytes()).hexdigest() == entry["sha256"]
    assert not (partial / "_manifest.json").exists()


# SHARDS: every shard done, killed before the manifest. The quick loop kills once; every step of the
# commit and of --resume is killed in tests/adversarial/test_crashes.py.
@pytest.mark.parametrize("kill_after", [pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow),
                                        7, pytest.param(12, marks=pytest.mark.slow),
                                        pytest.param(SHARDS, marks=pytest.mark.slow)])
def test_sigkill_then_resume_is_byte_identical(tmp_path, corpus, reference, contract, kill_after):
    out = tmp_path / "out"
    killed = run_pack(corpus, out, faults=["--kill-after", str(kill_after)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert_interrupted_and_consistent(out, killed, kill_after)
    assert (tmp_path / ".out.packctl-lock").exists()  # left by the killed run: stale, taken over below

    resumed = run_pack(corpus, out, "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["metrics"]["throughput"]["resumed_shards"] == kill_after
    assert snapshot(out) == reference
    assert check_contract(contract, out, [corpus]) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial directory, no lock


@pytest.mark.slow
def test_killed_twice(tmp_path, corpus, reference):
    out = tmp_path / "out"
    assert run_pack(corpus, out, faults=["--kill-after", "4"]).returncode == -signal.SIGKILL
    again = run_pack(corpus, out, "--resume", faults=["--kill-after", "5"])
    assert again.returncode == -signal.SIGKILL
    assert_interrupted_and_consistent(out, again, 9)
    assert run_pack(corpus, out, "--resume").returncode == 0
    assert snapshot(out) == reference


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), pytest.param("SIGINT", 130, marks=pytest.mark.slow)])
def test_signal_stops_cleanly_and_says_how_to_resume(tmp_path, corpus, reference, signame, code):
    out = tmp_path / "out"
    proc = run_pack(corpus, out, faults=["--kill-after", f"2:{signame}"])
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    text = " ".join(proc.stderr.split())
    assert f"interrupted by {signame}" in text and "rerun the same command with --resume" in text
    finished = len(journal_lines(out))
    assert finished >= 2  # shards being written when the signal came are finished and journaled
    assert_interrupted_and_consistent(out, proc, finished)
    assert not (tmp_path / ".out.packctl-lock").exists()
    assert run_pack(corpus, out, "--resume").returncode == 0
    assert snapshot(out) == reference


def test_external_sigterm(tmp_path, corpus):
    """A real SIGTERM from outside, at whatever point the run has reached."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out), *OPTIONS]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / ".out.packctl-partial"
    import time

    deadline = time.monotonic() + 60
    while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert "Traceback" not in stderr
    if proc.returncode == 0:  # it finished first: a complete output
        assert (out / "_manifest.json").exists()
    else:
        assert proc.returncode == 143, stderr
        assert "interrupted by SIGTERM" in stderr and not out.exists()
        assert not (tmp_path / ".out.packctl-lock").exists()


def test_disk_full_keeps_finished_shards_for_resume(tmp_path, corpus, reference):
    out = tmp_path / "out"
    proc = run_pack(corpus, out, faults=["--fail-write-after", "5"])
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert "write failed (No space left on device, on the filesystem mounted at" in text and "--resume" in text
    assert "Traceback" not in proc.stderr
    finished = len(journal_lines(out))
    assert 3 <= finished <= 5
    assert_interrupted_and_consistent(out, proc, finished)
    assert not list((tmp_path / ".out.packctl-partial").rglob("*.tmp"))
    assert run_pack(corpus, out, "--resume").returncode == 0
    assert snapshot(out) == reference


def test_resume_rewrites_a_shard_that_no_longer_matches(tmp_path, corpus, reference):
    out = tmp_path / "out"
    run_pack(corpus, out, faults=["--kill-after", "6"])
    victim = tmp_path / ".out.packctl-partial" / journal_lines(out)[0]["shard"]
    victim.write_bytes(victim.read_bytes()[:-10])
    proc = run_pack(corpus, out, "--resume", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["metrics"]["throughput"]["resumed_shards"] == 5
    assert snapshot(out) == reference


def test_partial_run_without_resume_is_refused(tmp_path, corpus):
    out = tmp_path / "out"
    run_pack(corpus, out, faults=["--kill-after", "2"])
    proc = run_pack(corpus, out)
    assert proc.returncode == 2
    assert "an interrupted run left 2 finished shard(s)" in " ".join(proc.stderr.split())
    assert "pass --resume" in proc.stderr
    assert len(journal_lines(out)) == 2  # untouched


@pytest.mark.parametrize("change", ["config", "input"])
def test_resume_refuses_other_config_or_changed_inputs(tmp_path, corpus, change):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    out = tmp_path / "out"
    run_pack(data, out, faults=["--kill-after", "2"])
    if change == "config":
        proc = run_pack(data, out, "--resume", "--seed", "3")
        expected = "used different seed"
    else:
        first = sorted(data.glob("*.parquet"))[0]
        os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
        proc = run_pack(data, out, "--resume")
        expected = "used different inputs"
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert "--resume refused" in text and expected in text
    assert len(journal_lines(out)) == 2 and not out.exists()


def test_memory_budget_may_change_on_resume(tmp_path, corpus, reference):
    out = tmp_path / "out"
    run_pack(corpus, out, faults=["--kill-after", "3"])
    proc = run_pack(corpus, out, "--resume", "--memory-budget", "300k")
    assert proc.returncode == 0, proc.stderr
    files, manifest = snapshot(out)
    assert files == reference[0]


def test_resume_without_an_interrupted_run_is_a_plain_run(tmp_path, corpus, reference):
    result = pack(PackConfig(inputs=[str(corpus)], output=str(tmp_path / "out"), capacity=2048, too_long="split",
                             shard_rows=6, order="shuffle", resume=True))
    assert result.metrics["throughput"]["resumed_shards"] == 0
    assert snapshot(tmp_path / "out")[0] == reference[0]


def test_a_live_lock_stops_a_second_run(tmp_path, corpus):
    import socket

    lock = tmp_path / ".out.packctl-lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))  # this process is alive
    proc = run_pack(corpus, tmp_path / "out", own_process=True)
    assert proc.returncode == 2
    assert f"another packctl run (pid {os.getpid()}" in " ".join(proc.stderr.split())
    assert lock.exists() and not (tmp_path / "out").exists() and not (tmp_path / ".out.packctl-partial").exists()


def test_a_stale_lock_is_taken_over(tmp_path, corpus):
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / ".out.packctl-lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    proc = run_pack(corpus, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / ".out.packctl-lock").exists()


def test_bad_input_releases_the_lock_and_writes_nothing(tmp_path):
    import pyarrow as pa

    from support.data import write_table

    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2], [-1]], pa.list_(pa.int64()))})
    with pytest.raises(PackctlError, match="value -1"):
        pack(PackConfig(inputs=[str(f)], output=str(tmp_path / "out"), capacity=8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install 'packctl[mpi]')")
def test_resume_across_rank_counts(tmp_path, corpus, reference):
    out = tmp_path / "out"
    killed = run_pack(corpus, out, faults=["--kill-after", "2"], mpi=2)
    assert killed.returncode != 0
    assert not out.exists()
    proc = run_pack(corpus, out, "--resume", mpi=3)
    assert proc.returncode == 0, proc.stderr
    assert snapshot(out) == reference
    killed = run_pack(corpus, tmp_path / "out2", faults=["--kill-after", "4"])
    assert killed.returncode == -signal.SIGKILL
    proc = run_pack(corpus, tmp_path / "out2", "--resume", mpi=2)
    assert proc.returncode == 0, proc.stderr
    assert snapshot(tmp_path / "out2") == reference

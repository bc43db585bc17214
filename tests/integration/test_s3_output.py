"""OUT on S3 (`pack -o s3://bucket/out`), against a real S3 server (moto's, on 127.0.0.1;
tests/support/s3.py): the shards of a local pack byte for byte, the manifest PUT last as the one
commit point, a kill at every step continued by --resume to the same bytes, --overwrite leaving
only the new run, and one-line errors. Skipped where moto[server] is not installed."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packctl import PackConfig, pack
from packctl.contract.manifest import manifest_problems
from packctl.errors import PackctlError
from support.faulty_pack import run_forked
from support.paths import CHECKER
from support.runs import run_cli

boto3 = pytest.importorskip("boto3")
from support.s3 import (BUCKET, OPTIONS, SAMPLE, SECRET_KEY, authentication, local, s3,  # noqa: E402,F401
                        s3_server, use_scratch)  # (fixtures)
ARGS = ["--too-long", "split", "--shard-rows", "100", "-q"]


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch) -> Path:
    return use_scratch(tmp_path, monkeypatch)


def _keys(s3, prefix: str) -> list[str]:
    """Every key below `prefix`, but the empty "folder" objects a store may hold."""
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/"))


def _get(s3, key: str) -> bytes:
    return s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _manifest(s3, prefix: str) -> dict:
    return json.loads(_get(s3, f"{prefix}/_manifest.json"))


def _download(s3, prefix: str, into: Path) -> Path:
    """A reader's copy of the output at `prefix`: its manifest, its report and exactly the shards
    the manifest lists (no listing of the prefix)."""
    manifest = _manifest(s3, prefix)
    for name in ["_manifest.json", "_metrics.json", *(s["path"] for s in manifest["shards"])]:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(_get(s3, f"{prefix}/{name}"))
    return into


def _comparable(manifest: dict) -> dict:
    """The manifest without what says where and how the run executed: timings, the options of
    execution, the inputs' recorded names, and the directory part of each shard's path."""
    manifest = json.loads(json.dumps(manifest))
    manifest.pop("timings")
    for key in ("resume", "output", "overwrite", "memory_budget", "inputs"):
        manifest["config"].pop(key, None)
    for entry in manifest["inputs"]:
        entry["path"] = Path(entry["path"]).name
    for shard in manifest["shards"]:
        shard["path"] = shard["path"].rsplit("/", 2)[-2:]
    return manifest


def _same_as_local(s3, prefix: str, local: Path) -> None:
    manifest = _manifest(s3, prefix)
    expected = json.loads((local / "_manifest.json").read_text())
    assert _comparable(manifest) == _comparable(expected)
    run = manifest["shards"][0]["path"].split("/")[1]
    assert [s["path"] for s in manifest["shards"]] == [f"runs/{run}/{s['path']}" for s in expected["shards"]]
    for ours, theirs in zip(manifest["shards"], expected["shards"]):
        data = _get(s3, f"{prefix}/{ours['path']}")
        assert hashlib.sha256(data).hexdigest() == ours["sha256"] == theirs["sha256"]
        assert data == (local / theirs["path"]).read_bytes()
    assert not manifest_problems(Path("/nonexistent"), manifest)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_local_and_s3_input_to_s3_equal_a_local_pack(s3, local, tmp_path):
    """Local INPUT to S3 against the same to a local OUT, and S3 INPUT to S3 against the same S3
    INPUT to a local OUT (the shards record their inputs' names: test_s3.py)."""
    s3.upload_dir(SAMPLE, "corpus")
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("from-local"), **OPTIONS))
    pack(PackConfig(inputs=[s3.url("corpus")], output=s3.url("from-s3"), **OPTIONS))
    pack(PackConfig(inputs=[s3.url("corpus")], output=str(tmp_path / "s3-to-local"), **OPTIONS))
    for prefix, expected in (("from-local", local), ("from-s3", tmp_path / "s3-to-local")):
        _same_as_local(s3, prefix, expected)
        run = _manifest(s3, prefix)["shards"][0]["path"].rsplit("/", 2)[0]
        assert _keys(s3, prefix) == sorted([f"{prefix}/_manifest.json", f"{prefix}/_metrics.json",
                                            *(f"{prefix}/{run}/{name}" for name in
                                              ("_metrics.json", "journal.jsonl", "run.json", "run.json.blocks")),
                                            *(f"{prefix}/{s['path']}" for s in _manifest(s3, prefix)["shards"])])
    inputs = [f["path"] for f in _manifest(s3, "from-s3")["inputs"]]
    assert inputs == [s3.url(f"corpus/{p.name}") for p in sorted(SAMPLE.glob("*.parquet"))]
    assert SECRET_KEY not in _get(s3, "from-s3/_manifest.json").decode()


def test_a_downloaded_copy_passes_the_contract_checker(s3, tmp_path):
    if not CHECKER.exists():
        pytest.skip("the contract checker is not beside the repository")
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS))
    copy = _download(s3, "out", tmp_path / "copy")
    result = subprocess.run([sys.executable, str(CHECKER), str(copy), "--source", str(SAMPLE)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("VERDICT: ok"), result.stdout


@pytest.mark.slow  # verify checks every pack, attention included (about 4 s)
def test_a_downloaded_copy_passes_verify(s3, tmp_path):
    """packctl's own reader takes shard paths under a run prefix (contract/manifest.py
    `store_run_prefix`): `verify --source` of a copy of the manifest and what it lists is ok."""
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS))
    copy = _download(s3, "out", tmp_path / "copy")
    result = run_cli("verify", str(copy), "--source", str(SAMPLE), env=_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: ok" in result.stdout + result.stderr


def test_a_rerun_is_complete_and_an_existing_output_is_refused(s3):
    first = pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS))
    keys = _keys(s3, "out")
    again = pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS))
    assert again.note == f"{s3.url('out')}: already complete with these inputs and options; nothing to do"
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in first.shards]
    assert again.metrics["counts"] == first.metrics["counts"]
    with pytest.raises(PackctlError, match=r"^s3://packctl-test/out: already exists; pass overwrite=True to replace it"):
        pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), too_long="drop"))
    result = run_cli("pack", str(SAMPLE), "-o", s3.url("out"), "--too-long", "drop", env=_env())
    assert result.returncode == 2 and result.stderr == (f"error: {s3.url('out')}: already exists; pass --overwrite to "
                                                        "replace it or choose another -o\n"), result.stderr
    assert _keys(s3, "out") == keys


def test_overwrite_leaves_only_the_new_run(s3, local):
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), too_long="drop"))
    old_run = _manifest(s3, "out")["shards"][0]["path"].rsplit("/", 2)[0]
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), overwrite=True, **OPTIONS))
    _same_as_local(s3, "out", local)
    new_run = _manifest(s3, "out")["shards"][0]["path"].rsplit("/", 2)[0]
    assert new_run != old_run
    assert not _keys(s3, f"out/{old_run}")
    assert all(k.startswith(f"out/{new_run}/") or k in ("out/_manifest.json", "out/_metrics.json")
               for k in _keys(s3, "out"))
    assert json.loads(_get(s3, f"out/{new_run}/run.json"))["replaces"] == f"{old_run}/"


@pytest.mark.parametrize("killed_at", [None, "commit:manifest-written"])
def test_overwrite_of_a_copied_local_output_removes_what_it_listed(s3, local, killed_at):
    """An OUT copied to the store from a local pack (`aws s3 sync`) lists `data/...`: an overwrite
    deletes those objects once its manifest is PUT (after a crash there, the next run does)."""
    from packctl.output.outdir import Faults

    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.put(f"out/{path.relative_to(local).as_posix()}", path.read_bytes())
    argv = ["pack", str(SAMPLE), "-o", s3.url("out"), "--too-long", "drop", "--overwrite", "-q"]
    if killed_at is not None:
        code, _, err = run_forked(argv, Faults(kill_at=killed_at))
        assert code == -9 and _keys(s3, "out/data"), err
        argv.append("--resume")
    code, _, err = run_forked(argv, None)
    assert code == 0, err
    assert not _keys(s3, "out/data")
    assert _manifest(s3, "out")["shards"][0]["path"].startswith("runs/")


# A kill at each step (the store's and those a store run shares with a local one), then the same
# command again: without --resume ("ok": it packs; "resume": refused, pass --resume; "complete":
# nothing to do), then with --resume, which ends with the bytes of an uninterrupted run.
KILLS = {"open:created": (1, "ok"), "shard:staged": (1, "ok"), "store:shard-put": (2, "resume"),
         "shard:journaled": (2, "resume"), "commit:metrics-written": (1, "resume"),
         "store:replaces-noted": (1, "resume"), "commit:manifest-written": (1, "complete"),
         "store:old-removed": (1, "complete")}


@pytest.mark.slow  # two runs (a forked one killed, and the rerun) per step
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("step", list(KILLS))
def test_killed_at_every_step_then_rerun(s3, local, step, overwrite):
    from packctl.output.outdir import Faults

    out = s3.url("out")
    old_run = None
    if overwrite:
        pack(PackConfig(inputs=[str(SAMPLE)], output=out, too_long="drop"))
        old_run = _manifest(s3, "out")["shards"][0]["path"].rsplit("/", 2)[0]
    argv = ["pack", str(SAMPLE), "-o", out, *ARGS, *(["--overwrite"] if overwrite else [])]
    count, plain = KILLS[step]
    code, _, err = run_forked(argv, Faults(kill_at=step, kill_count=count))
    assert code == -9, err
    before = _keys(s3, "out")
    if overwrite and plain == "complete":
        plain = "ok"  # --overwrite without --resume packs again over the new output
    if plain != "ok":
        code, _, err = run_forked(argv, None)
        if plain == "resume":
            assert code == 2 and "pass --resume to continue it" in err, err
            assert len(err.strip().splitlines()) == 1 and _keys(s3, "out") == before
        else:
            assert code == 0 and "already complete" in err, err
    code, _, err = run_forked([*argv, "--resume"], None)
    assert code == 0, err
    _same_as_local(s3, "out", local)
    if old_run is not None:  # the replaced run is gone
        assert not _keys(s3, f"out/{old_run}")


def test_resume_keeps_the_journaled_shards_and_writes_only_the_others(s3, local):
    from packctl.output.outdir import Faults

    out = s3.url("out")
    argv = ["pack", str(SAMPLE), "-o", out, *ARGS]
    code, _, err = run_forked(argv, Faults(kill_at="shard:journaled", kill_count=2))
    assert code == -9, err
    run = [k for k in _keys(s3, "out/runs") if k.endswith("journal.jsonl")][0].rsplit("/", 1)[0]
    journaled = [json.loads(line)["shard"] for line in _get(s3, f"{run}/journal.jsonl").decode().splitlines()]
    assert len(journaled) == 2  # the writers finish shards in any order
    put: list[str] = []
    result = pack(PackConfig(inputs=[str(SAMPLE)], output=out, resume=True, **OPTIONS),
                  faults=Faults(on_step=lambda step: put.append(step) if step == "store:shard-put" else None))
    assert put == ["store:shard-put"]  # the third shard only
    assert result.metrics["throughput"]["resumed_shards"] == 2
    _same_as_local(s3, "out", local)
    assert _manifest(s3, "out")["shards"][0]["path"].startswith(run[len("out/"):] + "/")


def test_resume_rewrites_a_journaled_shard_whose_object_changed(s3, local):
    from packctl.output.outdir import Faults

    out = s3.url("out")
    code, _, err = run_forked(["pack", str(SAMPLE), "-o", out, *ARGS], Faults(kill_at="shard:journaled", kill_count=2))
    assert code == -9, err
    run = [k for k in _keys(s3, "out/runs") if k.endswith("journal.jsonl")][0].rsplit("/", 1)[0]
    s3.put(f"{run}/data/train-00001.parquet", b"not the shard")
    pack(PackConfig(inputs=[str(SAMPLE)], output=out, resume=True, **OPTIONS))
    _same_as_local(s3, "out", local)


def test_missing_bucket_one_line(s3):
    result = run_cli("pack", str(SAMPLE), "-o", "s3://no-such-bucket-here/out", *ARGS, env=_env())
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: s3://no-such-bucket-here/out: cannot write: the bucket no-such-bucket-here does "
                             "not exist; check the bucket name in the URL\n")
    assert SECRET_KEY not in result.stdout + result.stderr


def test_denied_write_one_line(s3):
    """A key that may read the bucket but not write it (moto's authentication on): one line naming
    the object and the permission, no secret, nothing written."""
    iam = boto3.client("iam", endpoint_url=s3.endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                       region_name="us-east-1")
    user = f"reader-{os.getpid()}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"],
                                               "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    env = _env()
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = key["AccessKeyId"], key["SecretAccessKey"]
    with authentication(s3):
        result = run_cli("pack", str(SAMPLE), "-o", s3.url("out"), *ARGS, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {s3.url('out')}/runs/"), result.stderr
    assert ": cannot write: access denied; grant these credentials s3:PutObject" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert key["SecretAccessKey"] not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert not _keys(s3, "out")


@pytest.mark.parametrize("options, expected", [
    (dict(epochs=2), "--epochs 2 writes one output per epoch"),
])
def test_what_a_store_output_does_not_take_is_refused(s3, options, expected):
    with pytest.raises(PackctlError, match=f"^{s3.url('out')}: {expected}"):
        pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS, **options))


def test_an_output_that_appears_while_a_run_writes_is_not_replaced(s3):
    """Two runs at once without --overwrite: the one that finds the other's manifest just before its
    own PUT stops in one line and leaves that output as it is; its shards wait for --resume."""
    from packctl.output.outdir import Faults

    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("other"), too_long="drop"))
    theirs = _get(s3, "other/_manifest.json")

    def meanwhile(step: str) -> None:
        if step == "store:replaces-noted":
            s3.put("out/_manifest.json", theirs)

    expected = (r"^s3://packctl-test/out: appeared while this run wrote it \(another run committed it\); pass "
                r"overwrite=True to replace it with this run's output; 3 finished shard\(s\) are kept in "
                r"s3://packctl-test/out/runs/\S+: rerun the same command with resume=True")
    with pytest.raises(PackctlError, match=expected):
        pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS), faults=Faults(on_step=meanwhile))
    assert _get(s3, "out/_manifest.json") == theirs


def test_a_failed_run_names_its_run_prefix_and_leaves_no_scratch(s3, scratch):
    """Shards are encoded in a local scratch directory before their PUT: a run that fails removes
    it, and its message says where the finished shards wait for --resume."""
    from packctl.output.outdir import Faults

    with pytest.raises(PackctlError, match=r"write failed \(No space left on device.*; 1 finished shard\(s\) are kept "
                                           r"in s3://packctl-test/out/runs/\d{8}T\d{6}Z-[0-9a-f]{8}: rerun"):
        pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS),
             faults=Faults(fail_write_after_shards=1))
    assert not list(scratch.iterdir())
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), resume=True, **OPTIONS))
    assert not list(scratch.iterdir())


def test_materialize_a_local_plan_to_s3(s3, local, tmp_path):
    """`materialize PLAN -o s3://...` shares pack's store commit: the shards of a pack, byte for
    byte, and a rerun finds it complete."""
    from packctl.pipeline.from_plan import materialize_plan

    plan = tmp_path / "plan"
    pack(PackConfig(inputs=[str(SAMPLE)], output=str(plan), plan_only=True, **OPTIONS))
    materialize_plan(plan, s3.url("out"))
    _same_as_local(s3, "out", local)
    again = materialize_plan(plan, s3.url("out"))
    assert again.note == f"{s3.url('out')}: already complete: it holds the output of this plan"


def test_an_output_inside_its_input_prefix_is_refused(s3):
    s3.upload_dir(SAMPLE, "corpus")
    with pytest.raises(PackctlError, match=r"^s3://packctl-test/corpus/packed: inside the input "
                                           r"s3://packctl-test/corpus \(or holding it\)"):
        pack(PackConfig(inputs=[s3.url("corpus")], output=s3.url("corpus/packed"), **OPTIONS))
    assert not _keys(s3, "corpus/packed")


def test_an_epochs_output_on_the_store_is_neither_replaced_nor_resumed(s3):
    """An --epochs OUT copied to the store has K manifests and `_epochs.json`, which one PUT cannot
    replace: refused in one line, with or without --overwrite, and left as it is."""
    s3.put("out/_epochs.json", b'{"epochs": 2}')
    for overwrite in (False, True):
        with pytest.raises(PackctlError, match=r"^s3://packctl-test/out: holds an output of --epochs \(_epochs.json\)"):
            pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), overwrite=overwrite, **OPTIONS))
    assert _keys(s3, "out") == ["out/_epochs.json"]


def test_a_plan_to_s3_equals_a_local_plan(s3, tmp_path):
    """`pack --plan-only -o s3://...`: the plan's shards and manifest (kind "plan") as a local plan's."""
    pack(PackConfig(inputs=[str(SAMPLE)], output=str(tmp_path / "plan"), plan_only=True, **OPTIONS))
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("plan"), plan_only=True, **OPTIONS))
    assert _manifest(s3, "plan")["kind"] == "plan"
    _same_as_local(s3, "plan", tmp_path / "plan")


def test_resume_takes_the_input_spelled_another_way(s3, local, monkeypatch):
    """`data` after `/abs/data`: the same files, so --resume continues the store run with the INPUT
    it recorded (as for a local OUT) and writes the bytes of an uninterrupted run."""
    from packctl.output.outdir import Faults

    monkeypatch.chdir(SAMPLE.parent)
    out = s3.url("out")
    code, _, err = run_forked(["pack", str(SAMPLE), "-o", out, *ARGS], Faults(kill_at="shard:journaled"))
    assert code == -9, err
    pack(PackConfig(inputs=[SAMPLE.name], output=out, resume=True, **OPTIONS))
    _same_as_local(s3, "out", local)
    assert [e["path"] for e in _manifest(s3, "out")["inputs"]] == [str(p) for p in sorted(SAMPLE.glob("*.parquet"))]


def test_several_ranks_to_a_store_are_refused_before_anything_is_read(s3):
    """Under MPI (here two in-process ranks) every rank refuses a store OUT in the same line."""
    from support.threadcomm import run_ranks

    with pytest.raises(PackctlError, match=r"^s3://packctl-test/out: an output on an object store is written by one "
                                           r"process, not under mpiexec"):
        run_ranks(2, lambda comm: pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS), comm=comm))
    assert not _keys(s3, "out")


def test_the_manifest_is_one_put_and_the_last_write(s3):
    """Every request of a run, as the server logs it: the manifest is written by one PutObject (no
    multipart upload), after every other write of the run."""
    import logging

    seen: list[tuple[str, str]] = []

    class Requests(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            line = record.getMessage()  # '127.0.0.1 - - [date] "PUT /bucket/key?query HTTP/1.1" 200 -'
            if '"' in line:
                method, path = line.split('"')[1].split(" ")[:2]
                seen.append((method, path))

    server_log = logging.getLogger("werkzeug")
    handler, level = Requests(), server_log.level
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    try:
        pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url("out"), **OPTIONS))
    finally:
        server_log.removeHandler(handler)
        server_log.setLevel(level)
    writes = [(method, path) for method, path in seen if method in ("PUT", "POST", "DELETE")]
    manifest = f"/{BUCKET}/out/_manifest.json"
    assert [w for w in writes if w[1].split("?")[0] == manifest] == [("PUT", manifest)]
    assert writes[-1] == ("PUT", manifest) and len(writes) > 5
    assert not [w for w in writes if w[0] == "DELETE"]  # nothing replaced

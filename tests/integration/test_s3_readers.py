"""Packed outputs and plans read from S3 (`stats`, `verify`, `export`, `materialize`, the reader
under the loader), against a real S3 server (moto's, on 127.0.0.1; tests/support/s3.py): each
gives what it gives for the same output on disk, reads only what the manifest lists, and names
the URL in its one-line errors. Both layouts a store holds are read: a store run's
(`runs/<run>/data/...`, written by `pack -o s3://`) and a local output copied up as it is
(`data/...`). Skipped where moto[server] is not installed."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from packctl import PackConfig, pack
from packctl.contract.mirror import mirror_output
from packctl.contract.reader import open_output
from packctl.errors import PackctlError
from packctl.export import export
from packctl.pipeline import materialize_plan
from packctl.stats import stats
from packctl.verify import VerifyOptions, verify

boto3 = pytest.importorskip("boto3")
from support.s3 import (BUCKET, OPTIONS, SAMPLE, SECRET_KEY, local, s3, s3_server,  # noqa: E402,F401  (fixtures)
                        use_scratch)


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch) -> Path:
    """The run's scratch and the cache of outputs read from a store, inside the test's folder."""
    monkeypatch.setenv("PACKCTL_OUTPUT_CACHE", str(tmp_path / "cache"))
    return use_scratch(tmp_path, monkeypatch)


def _upload(s3, directory: Path, prefix: str) -> None:
    """Every file below `directory` put under `prefix`, at its relative path (a local output
    copied up as it is, `aws s3 sync`)."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            s3.put(f"{prefix}/{path.relative_to(directory).as_posix()}", path.read_bytes())


def _store_run(s3, prefix: str) -> str:
    pack(PackConfig(inputs=[str(SAMPLE)], output=s3.url(prefix), **OPTIONS))
    return s3.url(prefix)


def _shard_keys(s3, prefix: str) -> list[str]:
    manifest = json.loads(s3.client.get_object(Bucket=BUCKET, Key=f"{prefix}/_manifest.json")["Body"].read())
    return [f"{prefix}/{entry['path']}" for entry in manifest["shards"]]


def _without_location(report: dict) -> dict:
    report = json.loads(json.dumps(report))
    report.pop("path")
    report.pop("timings", None)
    report.pop("stats_seconds", None)
    return report


@pytest.mark.parametrize("layout", ["store run", "copied local output"])
def test_stats_of_an_output_on_s3_equals_stats_of_it_on_disk(s3, local, layout):
    url = _store_run(s3, "out") if layout == "store run" else s3.url("copy")
    if layout != "store run":
        _upload(s3, local, "copy")
    ours, theirs = stats([url]), stats([str(local)])
    assert ours["kind"] == "packed" and ours["path"] == url
    assert _without_location(ours) == _without_location(theirs)


def test_only_the_listed_objects_are_read(s3, local):
    """A store prefix may hold an unfinished run's or a replaced run's objects: they are never read,
    where a local OUT holding an unlisted shard is refused."""
    url = _store_run(s3, "out")
    s3.put("out/runs/20990101T000000Z-0badc0de/data/train-00000.parquet", b"an unfinished run's shard")
    s3.put("out/data/train-00000.parquet", (local / "data/train-00000.parquet").read_bytes())
    output = open_output(url)
    assert [output.read_shard(k).num_rows for k in range(len(output.shards))] == [s.rows for s in output.shards]
    fetched = sorted(p.relative_to(output.root).as_posix() for p in output.root.rglob("*.parquet"))
    assert fetched == sorted(s.path for s in output.shards)


def test_verify_of_an_output_on_s3_passes_and_names_the_url(s3):
    url = _store_run(s3, "out")
    report = verify(url, VerifyOptions(source=[str(SAMPLE)], attention=False))
    assert report.ok, [str(v) for v in report.violations]
    assert report.output == url
    assert report.checks["conservation"].status == "ok"


def test_verify_reports_a_changed_and_a_missing_object_as_broken_rules(s3):
    url = _store_run(s3, "out")
    first, second = _shard_keys(s3, "out")[:2]
    data = bytearray(s3.client.get_object(Bucket=BUCKET, Key=first)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put(first, bytes(data))
    s3.client.delete_object(Bucket=BUCKET, Key=second)
    report = verify(url, VerifyOptions(attention=False))
    rules = {v.rule for v in report.violations}
    assert not report.ok and {"checksum", "shard-missing"} <= rules, [str(v) for v in report.violations]
    assert all("/scratch/" not in str(v) and "packctl-verify-" not in str(v) for v in report.violations)


def test_a_changed_object_is_refused_naming_its_url_and_never_cached(s3, tmp_path):
    url = _store_run(s3, "out")
    key = _shard_keys(s3, "out")[0]
    s3.put(key, s3.client.get_object(Bucket=BUCKET, Key=_shard_keys(s3, "out")[1])["Body"].read())
    output = open_output(url)
    with pytest.raises(PackctlError) as caught:
        output.read_shard(0)
    message = str(caught.value)
    assert message.startswith(f"s3://{BUCKET}/{key}: sha256 differs from the manifest's") and "\n" not in message
    assert not (output.root / output.shards[0].path).exists()
    assert not [p for p in output.root.rglob(".fetch-*")]


def test_a_shard_is_fetched_once_and_a_new_manifest_gets_a_new_mirror(s3):
    url = _store_run(s3, "out")
    first = open_output(url)
    first.read_shard(0)
    key = _shard_keys(s3, "out")[0]
    s3.client.delete_object(Bucket=BUCKET, Key=key)  # read from the mirror from now on
    again = open_output(url)
    assert again.root == first.root and again.read_shard(0).num_rows == first.shards[0].rows
    pack(PackConfig(inputs=[str(SAMPLE)], output=url, overwrite=True, too_long="split", shard_rows=50))
    replaced = open_output(url)
    assert replaced.root != first.root and len(replaced.shards) > len(first.shards)
    assert sum(replaced.read_shard(k).num_rows for k in range(len(replaced.shards))) == replaced.num_packs


@pytest.mark.parametrize("fmt", ["megatron", "nemo"])
def test_export_of_an_output_on_s3_equals_export_of_it_on_disk(s3, local, tmp_path, fmt):
    url = _store_run(s3, "out")
    export(url, tmp_path / "from_s3", fmt)
    export(local, tmp_path / "from_disk", fmt)
    names = sorted(p.relative_to(tmp_path / "from_disk").as_posix() for p in (tmp_path / "from_disk").rglob("*")
                   if p.is_file())
    assert names == sorted(p.relative_to(tmp_path / "from_s3").as_posix()
                           for p in (tmp_path / "from_s3").rglob("*") if p.is_file())
    differ = [n for n in names if (tmp_path / "from_s3" / n).read_bytes() != (tmp_path / "from_disk" / n).read_bytes()]
    # only what names the source output (its URL, its manifest's digest) differs
    assert set(differ) <= {"_packctl_export.json", "megatron.json"}, differ
    assert json.loads((tmp_path / "from_s3" / "_packctl_export.json").read_text())["source"] == url


def test_materialize_of_a_plan_on_s3_equals_the_pack(s3, local, tmp_path):
    plan = s3.url("plan")
    pack(PackConfig(inputs=[str(SAMPLE)], output=plan, plan_only=True, **OPTIONS))
    materialize_plan(plan, tmp_path / "out")
    for entry in json.loads((local / "_manifest.json").read_text())["shards"]:
        data = (tmp_path / "out" / entry["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_no_manifest_missing_bucket_and_bad_credentials_give_one_line(s3, monkeypatch):
    _store_run(s3, "out")
    s3.put("unfinished/runs/20990101T000000Z-0badc0de/data/train-00000.parquet", b"x")
    cases = {s3.url("unfinished"): "no _manifest.json", "s3://packctl-no-such-bucket/out": "does not exist"}
    for url, expected in cases.items():
        with pytest.raises(PackctlError) as caught:
            open_output(url)
        assert expected in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    from support.s3 import ACCESS_KEY  # noqa: F401  (moto accepts any key unless authentication is on)
    with pytest.raises(PackctlError) as caught:
        open_output("s3://packctl-no-such-bucket/out")
    assert SECRET_KEY not in str(caught.value) and "not-the-secret" not in str(caught.value)


def test_an_epochs_index_on_a_store_is_refused_in_one_line(s3):
    s3.put("epochs/_epochs.json", b'{"epochs": 2, "outputs": []}')
    with pytest.raises(PackctlError, match="--epochs"):
        open_output(s3.url("epochs"))


def test_the_mirror_takes_the_runs_own_report(s3):
    """OUT/_metrics.json is PUT just before the manifest, so for a moment it may be a newer run's;
    the mirror reads the report beside the manifest's shards."""
    url = _store_run(s3, "out")
    run = _shard_keys(s3, "out")[0].split("/data/")[0]
    s3.put("out/_metrics.json", b'{"from": "a newer run"}')
    mirror = mirror_output(url)
    expected = s3.client.get_object(Bucket=BUCKET, Key=f"{run}/_metrics.json")["Body"].read()
    assert (mirror.root / "_metrics.json").read_bytes() == expected

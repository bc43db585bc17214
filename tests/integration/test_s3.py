"""Parquet INPUT on S3, read from a real S3 server (moto's, on 127.0.0.1; tests/support/s3.py):
the same packs as from local files, one-line errors naming the URL, changed objects refused,
transient server errors retried. Skipped where moto[server] is not installed."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack
from packctl.errors import PackctlError
from packctl.source.files import open_parquet
from packctl.source.resolve import resolve
from support.runs import run_cli
boto3 = pytest.importorskip("boto3")
from support.s3 import SECRET_KEY, FlakyProxy, authentication, s3, s3_server  # noqa: F401  (fixtures)

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data"
SHARDS = sorted(p.name for p in SAMPLE.glob("*.parquet"))


def _pack(inputs: list[str], out: Path, **options) -> Path:
    pack(PackConfig(inputs=inputs, output=str(out), too_long="split", overwrite=True, **options))
    return out


def _shards(out: Path) -> list[Path]:
    return sorted(out.rglob("*.parquet"))


def test_pack_from_s3_equals_pack_from_disk(s3, tmp_path):
    s3.upload_dir(SAMPLE, "sample")
    remote = _pack([s3.url("sample")], tmp_path / "remote")
    local = _pack([str(SAMPLE)], tmp_path / "local")
    remote_shards, local_shards = _shards(remote), _shards(local)
    assert [p.name for p in remote_shards] == [p.name for p in local_shards] and local_shards
    for r, l in zip(remote_shards, local_shards):
        rt, lt = pq.read_table(r), pq.read_table(l)
        assert rt.column_names == lt.column_names
        assert rt.equals(lt)  # every column, every value
        recorded = rt.schema.metadata[b"packctl"].decode()
        assert recorded.replace(s3.url("sample"), str(SAMPLE)) == lt.schema.metadata[b"packctl"].decode()
    manifest = json.loads((remote / "_manifest.json").read_text())
    assert [f["path"] for f in manifest["inputs"]] == [s3.url(f"sample/{name}") for name in SHARDS]
    assert SECRET_KEY not in (remote / "_manifest.json").read_text()


def test_resolve_prefix_glob_and_object(s3):
    s3.upload_dir(SAMPLE, "corpus/a")
    s3.put("corpus/b/notes.txt", b"not input")
    whole = [f.path for f in resolve([s3.url("corpus") + "/"]).files]
    assert whole == [s3.url(f"corpus/a/{name}") for name in SHARDS]
    assert [f.path for f in resolve([s3.url("**/shard-0000[12].parquet")]).files] == whole[1:3]
    one = resolve([s3.url("corpus/a/shard-00000.parquet")])
    assert [f.path for f in one.files] == whole[:1]
    assert one.files[0].fingerprint.size == (SAMPLE / SHARDS[0]).stat().st_size


def test_object_rewritten_after_resolve_is_refused(s3):
    s3.upload_dir(SAMPLE, "corpus")
    first = resolve([s3.url("corpus")]).files[0]
    s3.put("corpus/" + SHARDS[0], (SAMPLE / SHARDS[1]).read_bytes())
    with pytest.raises(PackctlError, match=rf"^{first.path}: changed while packctl was reading it"):
        open_parquet(first.path, first.fingerprint)


def test_object_rewritten_during_a_run_is_refused(s3, tmp_path, monkeypatch):
    """The object is replaced after the run resolved its input, before scan reads its blocks."""
    from packctl.source import stored

    s3.upload_dir(SAMPLE, "corpus")
    real = stored.resolve_objects

    def resolve_then_rewrite(*args, **kwargs):
        resolution = real(*args, **kwargs)
        s3.put("corpus/" + SHARDS[0], (SAMPLE / SHARDS[1]).read_bytes())
        return resolution

    monkeypatch.setattr(stored, "resolve_objects", resolve_then_rewrite)
    with pytest.raises(PackctlError, match=rf"{s3.url('corpus/' + SHARDS[0])}: changed while packctl"):
        _pack([s3.url("corpus")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where, expected", [
    ("s3://no-such-bucket-x/corpus", "s3://no-such-bucket-x/corpus: cannot list: the bucket no-such-bucket-x does "
                                     "not exist"),
    ("{bucket}/missing", "{bucket}/missing: no such object, and no object below that prefix"),
    ("{bucket}/missing-*.parquet", "{bucket}/missing-*.parquet: the pattern matches no object"),
])
def test_missing_bucket_and_key_one_line(s3, tmp_path, where, expected):
    url = where.format(bucket=s3.url())
    result = run_cli("pack", url, "-o", str(tmp_path / "out"), env=_env())
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: " + expected.format(bucket=s3.url()))
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("who, expected", [
    ("unknown", "the store refused the credentials"),
    ("denied", "access denied; grant these credentials"),
])
def test_bad_credentials_and_denied_requests_one_line(s3, who, expected):
    """With moto's authentication on: a key the store does not know, and a known key with no
    permission, each give one line naming the URL, without the secret."""
    s3.upload_dir(SAMPLE, "corpus")
    env = _env()
    if who == "unknown":
        env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = "AKIAWRONGWRONGWRONG", "wrong-secret-do-not-log"
    else:
        iam = boto3.client("iam", endpoint_url=s3.endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                           region_name="us-east-1")
        iam.create_user(UserName=f"nobody-{id(env)}")
        key = iam.create_access_key(UserName=f"nobody-{id(env)}")["AccessKey"]
        env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = key["AccessKeyId"], key["SecretAccessKey"]
    secret = env["AWS_SECRET_ACCESS_KEY"]
    with authentication(s3):
        result = run_cli("stats", s3.url("corpus"), env=env)
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert result.stderr.startswith(f"error: {s3.url('corpus')}: cannot list: {expected}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert secret not in text and "Traceback" not in text


@pytest.mark.slow  # the SDK's backoff between attempts: about a second each
@pytest.mark.parametrize("status", [500, 503])
def test_transient_server_errors_are_retried(s3, monkeypatch, status):
    """Two failed requests, then the server answers: the input resolves as without them (the AWS
    SDK's standard retry strategy, packctl/store.py)."""
    s3.upload_dir(SAMPLE, "corpus")
    with FlakyProxy(s3.endpoint, failures=2, status=status) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        files = resolve([s3.url("corpus")]).files
    assert proxy.failed == 2
    assert [f.path for f in files] == [s3.url(f"corpus/{name}") for name in SHARDS]


def _env() -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow  # verify checks every pack (about 20 s here)
def test_verify_source_on_s3(s3, tmp_path):
    """An output packed from local files, verified against the same files on S3 (conservation:
    every token of the source in the packs), and refused when an object differs."""
    s3.upload_dir(SAMPLE, "corpus")
    out = _pack([str(SAMPLE)], tmp_path / "out")
    ok = run_cli("verify", str(out), "--source", s3.url("corpus"), env=_env())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    s3.put("corpus/" + SHARDS[0], (SAMPLE / SHARDS[1]).read_bytes())
    bad = run_cli("verify", str(out), "--source", s3.url("corpus"), env=_env())
    assert bad.returncode == 1, bad.stdout + bad.stderr  # the other object's rows are not the packs' rows
    assert "[conservation: sample-" in bad.stdout and "Traceback" not in bad.stdout + bad.stderr


def test_materialize_a_plan_of_objects_on_s3(s3, tmp_path):
    """`pack --plan-only` over s3:// INPUT records the URLs; `materialize` reads the objects back
    and writes the shards a pack writes."""
    from packctl.pipeline.from_plan import materialize_plan

    s3.upload_dir(SAMPLE, "corpus")
    plan = _pack([s3.url("corpus")], tmp_path / "plan", plan_only=True)
    manifest = json.loads((plan / "_manifest.json").read_text())
    assert [f["absolute_path"] for f in manifest["inputs"]] == [s3.url(f"corpus/{name}") for name in SHARDS]
    materialize_plan(plan, tmp_path / "out")
    packed = _pack([s3.url("corpus")], tmp_path / "packed")
    assert [p.read_bytes() for p in _shards(tmp_path / "out")] == [p.read_bytes() for p in _shards(packed)]


def test_a_pack_asks_the_store_for_each_object_once_then_once_a_block(s3, tmp_path, monkeypatch):
    """Requests are a small corpus's cost on a store: a listing gives each object's size and time,
    so the first read of an object is its open and one footer GET (no HEAD of its own); indexing
    takes the footers resolve read; each block decoded opens its object once (the check)."""
    from packctl import store
    from packctl.source.files import _FIRST_FOOTERS

    s3.upload_dir(SAMPLE, "corpus")
    opens, heads = [], []
    real_reader, real_object = store.open_reader, store.open_object
    monkeypatch.setattr(store, "open_reader", lambda url: opens.append(url) or real_reader(url))
    monkeypatch.setattr(store, "open_object", lambda url: heads.append(url) or real_object(url))
    out = _pack([s3.url("corpus")], tmp_path / "out")
    blocks = sum(pq.ParquetFile(SAMPLE / name).metadata.num_row_groups for name in SHARDS)
    assert heads == []  # no object asked for its size and time after the listing
    assert len(opens) == len(SHARDS) + blocks  # resolve's first reads, then one open a block
    assert not [key for key in _FIRST_FOOTERS if key[0].startswith(s3.url())]  # all taken by the index
    assert (out / "_manifest.json").is_file()

"""`gs://` and `hf://` INPUT through the store layer that reads `s3://` (packctl/store.py), each
scheme's filesystem replaced by a local stand-in: GCS by a pyarrow filesystem over a folder, the
Hub by an in-memory fsspec filesystem wrapped as huggingface_hub's is. What is tested is packctl's
side (URLs, listing, globs, ranged reads of footers and row groups, identity, outputs refused);
the clients themselves (pyarrow's GCS client, huggingface_hub) are not run: no GCS emulator serves
pyarrow's client here, and the Hub is not reachable."""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyarrow import fs

from packctl import PackConfig, pack, store
from packctl.errors import MissingExtraError, PackctlError
from packctl.source.resolve import resolve
from support.adversary import assert_clean_error, packctl

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data"
SHARDS = sorted(p.name for p in SAMPLE.glob("*.parquet"))


@pytest.fixture
def gcs(tmp_path, monkeypatch) -> Path:
    """gs://bkt/... served from tmp_path/gcs/bkt/..."""
    root = tmp_path / "gcs"
    (root / "bkt" / "corpus").mkdir(parents=True)
    for name in SHARDS:
        shutil.copy(SAMPLE / name, root / "bkt" / "corpus" / name)
    monkeypatch.setitem(store.FILESYSTEMS, "gs", lambda: fs.SubTreeFileSystem(str(root), fs.LocalFileSystem()))
    return root


@pytest.fixture
def hub(monkeypatch):
    """hf://datasets/org/<name>/... served from an in-memory fsspec filesystem."""
    pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    memory = MemoryFileSystem()
    name = f"corpus-{uuid.uuid4().hex[:8]}"
    for shard in SHARDS:
        memory.pipe(f"/datasets/org/{name}/data/{shard}", (SAMPLE / shard).read_bytes())
    monkeypatch.setitem(store.FILESYSTEMS, "hf", lambda: fs.PyFileSystem(fs.FSSpecHandler(memory)))
    yield f"hf://datasets/org/{name}"
    memory.rm(f"/datasets/org/{name}", recursive=True)


def _data(out: Path) -> list:
    tables = [pq.read_table(p) for p in sorted(out.rglob("*.parquet"))]
    return [t.select([c for c in t.column_names]).to_pylist() for t in tables]


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    pack(PackConfig(inputs=[str(SAMPLE)], output=str(out), too_long="split"))
    return out


def test_a_pack_from_gcs_equals_the_pack_of_the_files(gcs, local, tmp_path):
    pack(PackConfig(inputs=["gs://bkt/corpus"], output=str(tmp_path / "out"), too_long="split"))
    assert _data(tmp_path / "out") == _data(local)


def test_a_gcs_glob_and_object(gcs):
    assert [f.path for f in resolve(["gs://bkt/**/shard-0000[12].parquet"]).files] == \
        [f"gs://bkt/corpus/{name}" for name in SHARDS[1:3]]
    one = resolve([f"gs://bkt/corpus/{SHARDS[0]}"]).files
    assert [f.path for f in one] == [f"gs://bkt/corpus/{SHARDS[0]}"]
    assert one[0].fingerprint.size == (SAMPLE / SHARDS[0]).stat().st_size


def test_a_gcs_object_rewritten_during_a_run_is_refused(gcs):
    first = resolve(["gs://bkt/corpus"]).files[0]
    shutil.copy(SAMPLE / SHARDS[1], gcs / "bkt" / "corpus" / SHARDS[0])
    from packctl.source.files import open_parquet

    with pytest.raises(PackctlError, match=rf"^{first.path}: changed while packctl was reading it"):
        open_parquet(first.path, first.fingerprint)


def test_a_pack_from_the_hub_equals_the_pack_of_the_files(hub, local, tmp_path):
    pack(PackConfig(inputs=[hub], output=str(tmp_path / "out"), too_long="split"))
    assert _data(tmp_path / "out") == _data(local)
    import json

    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [e["path"] for e in manifest["inputs"]] == [f"{hub}/data/{name}" for name in SHARDS]


def test_a_missing_hub_path_is_one_line(hub):
    with pytest.raises(PackctlError, match=r"^hf://datasets/org/nothing-here: no such object, and no object below"):
        resolve(["hf://datasets/org/nothing-here"])


def test_the_hub_without_huggingface_hub_names_the_extra(monkeypatch):
    import sys

    store._hf_filesystem.cache_clear()
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # what an install without the extra has
    with pytest.raises(MissingExtraError, match=r"packctl\[hf\]"):
        store.filesystem_of("hf://datasets/org/name/a.parquet")
    store._hf_filesystem.cache_clear()


def test_an_emulator_host_points_the_gcs_client_at_it(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9023")
    store._gcs_filesystem.cache_clear()
    filesystem, path = store.filesystem_of("gs://bkt/corpus/a.parquet")
    assert isinstance(filesystem, fs.GcsFileSystem) and path == "bkt/corpus/a.parquet"
    store._gcs_filesystem.cache_clear()


@pytest.mark.parametrize("url", ["gs://bkt/out", "hf://datasets/org/out"])
def test_outputs_to_gcs_and_the_hub_are_refused_in_one_line(tmp_path, url):
    assert_clean_error(packctl("pack", SAMPLE, "-o", url), 2, f"{url}: object-store and URL outputs are not written yet")


def test_the_errors_of_gcs_and_the_hub_name_the_url_and_what_to_do():
    denied = store.store_error("gs://bkt/a.parquet", OSError("google::cloud::Status(PERMISSION_DENIED: 403 Forbidden)"),
                               "read")
    assert str(denied).startswith("gs://bkt/a.parquet: cannot read: access denied; grant these credentials "
                                  "storage.objects.list")
    gated = store.store_error("hf://datasets/org/gated/a.parquet", OSError("401 Client Error: Unauthorized"), "read")
    assert "HF_TOKEN" in str(gated) and str(gated).startswith("hf://datasets/org/gated/a.parquet: cannot read:")

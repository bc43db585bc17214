"""`packctl tokenize` of raw records on S3 (moto's server on 127.0.0.1; tests/support/s3.py): the
same tokenized corpus as of the same files on disk, for a prefix, a glob, compressed JSONL and
Parquet records; a prefix holding a packctl output refused. Skipped where moto is not installed."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl.errors import PackctlError
from packctl.tokenize.options import TokenizeConfig
from packctl.tokenize.run import tokenize_corpus

pytest.importorskip("boto3")
from support.s3 import s3, s3_server  # noqa: E402,F401  (fixtures)

SAMPLE_CHAT = Path(__file__).resolve().parents[2] / "sample_chat"


def _corpus(folder: Path) -> Path:
    """The sample chats as three files of three formats."""
    folder.mkdir()
    lines = (SAMPLE_CHAT / "chat.jsonl").read_bytes().splitlines(keepends=True)
    third = len(lines) // 3
    (folder / "a.jsonl").write_bytes(b"".join(lines[:third]))
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[third:2 * third])))
    records = [json.loads(line) for line in lines[2 * third:]]
    pq.write_table(pa.Table.from_pylist(records), folder / "c.parquet", row_group_size=7)
    return folder


def _tokenize(inputs: list[str], out: Path) -> Path:
    tokenize_corpus(TokenizeConfig(inputs=inputs, output=str(out), tokenizer=str(SAMPLE_CHAT / "tokenizer")))
    return out


def _tokens(out: Path) -> list:
    return [pq.read_table(p).select(["input_ids", "labels"]).to_pylist() for p in sorted(out.rglob("*.parquet"))]


def test_tokenize_from_s3_equals_tokenize_of_the_files(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    local = _corpus(tmp_path / "corpus")
    s3.upload_dir(str(local), "chats")
    expected = _tokens(_tokenize([str(local)], tmp_path / "local"))
    assert expected and _tokens(_tokenize([s3.url("chats")], tmp_path / "from_prefix")) == expected
    assert _tokens(_tokenize([s3.url("chats/*.json*"), s3.url("chats/c.parquet")], tmp_path / "from_globs")) == \
        expected
    manifest = json.loads((tmp_path / "from_prefix" / "_manifest.json").read_text())
    assert s3.url("chats/a.jsonl") in json.dumps(manifest)


def test_a_prefix_holding_a_packctl_output_is_refused(s3, tmp_path):
    s3.upload_dir(str(SAMPLE_CHAT), "mixed")
    s3.put("mixed/out/_manifest.json", json.dumps({"packctl_version": "0.1.0", "shards": []}).encode())
    with pytest.raises(PackctlError, match=r"mixed/out: a packctl output"):
        _tokenize([s3.url("mixed")], tmp_path / "out")


def test_a_missing_object_and_a_local_input_beside_an_object_are_one_line(s3, tmp_path):
    with pytest.raises(PackctlError, match=r"no such object, and no object below that prefix"):
        _tokenize([s3.url("nothing")], tmp_path / "out")
    s3.put("x/a.jsonl", b'{"messages": []}\n')
    with pytest.raises(PackctlError, match=r"a local INPUT beside the store INPUT"):
        _tokenize([s3.url("x"), str(SAMPLE_CHAT / "chat.jsonl")], tmp_path / "out")

"""packctl/store.py without a server: URL spelling, glob matching of keys, and the store's errors
as one line naming the URL (the server-backed tests: tests/integration/test_s3.py)."""
from __future__ import annotations

import pytest

from packctl import store


@pytest.mark.parametrize("given, recorded", [
    ("s3://corpus/tok", "s3://corpus/tok"), ("S3://corpus//tok/", "s3://corpus/tok"), ("s3://corpus/", "s3://corpus"),
])
def test_normalize_url(given, recorded):
    assert store.normalize_url(given) == recorded


def _matches(pattern: str, key: str) -> bool:
    return store._matches(pattern.split("/"), key.split("/"))


@pytest.mark.parametrize("pattern, key, expected", [
    ("*.parquet", "a.parquet", True),
    ("*.parquet", "sub/a.parquet", False),
    ("**/*.parquet", "sub/deeper/a.parquet", True),
    ("**/*.parquet", "a.parquet", True),
    ("train-*", "train-0/a.parquet", True),  # a matched "directory" takes what is below it
    ("shard-0000[12].parquet", "shard-00003.parquet", False),
    ("shard-0000?.parquet", "shard-00001.parquet", True),
])
def test_glob_matches_keys_name_by_name(pattern, key, expected):
    assert _matches(pattern, key) is expected


@pytest.mark.parametrize("text, says", [
    ("AWS Error NO_SUCH_BUCKET during ListObjectsV2", "the bucket corpus does not exist"),
    ("AWS Error INVALID_ACCESS_KEY_ID during HeadObject", "the store refused the credentials"),
    ("AWS Error SIGNATURE_DOES_NOT_MATCH during ListObjectsV2", "the store refused the credentials"),
    ("AWS Error ACCESS_DENIED during ListObjectsV2", "access denied; grant these credentials s3:ListBucket"),
    ("AWS Error NETWORK_CONNECTION during ListObjectsV2: curlCode: 7\nmore", "AWS Error NETWORK_CONNECTION during"),
])
def test_store_errors_are_one_line_naming_the_url(text, says):
    error = store.store_error("s3://corpus/tok", OSError(text), "list")
    message = str(error)
    assert message.startswith(f"s3://corpus/tok: cannot list: ") and says in message
    assert "\n" not in message and error.exit_code == 2

"""A URL where packctl takes a local path and does not read it (`http(s)://`, any `scheme://` but
a store's; a store's where a command does not write it: docs/object-stores.md) is refused in one
line saying that URLs are not read yet and how to copy the files locally, never mangled into a
missing path (docs/errors.md "Input resolution"). `s3://`, `gs://` and `hf://` INPUT is read:
tests/integration/test_s3.py, tests/integration/test_other_stores.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.adversary import assert_clean_error, packctl
from support.data import write_table
from support.runs import pack_to

SAMPLE_CHAT = Path(__file__).resolve().parents[2] / "sample_chat"
URLS = ["s3://bucket/corpus", "gs://bucket/corpus/", "hf://datasets/org/name", "https://example.com/a.parquet",
        "abfss://container@account.dfs.core.windows.net/corpus"]
STORES = ("s3://", "gs://", "hf://")  # read (tests/integration/test_s3*.py, test_other_stores.py)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("urls")
    return pack_to(root, [write_table(root / "a.parquet", {"input_ids": [[1, 2, 3], [4, 5]] * 4})], capacity=8)[1]


# pack, stats and verify --source read s3:// INPUT (tests/integration/test_s3.py), and every reader of
# outputs an s3:// OUT or PLAN (tests/integration/test_s3_readers.py): other schemes are refused
REFUSED = [(url, command) for url in URLS
           for command in ("pack", "stats", "verify --source", "materialize", "verify", "export")
           if not url.startswith(STORES)]


@pytest.mark.parametrize("url, command", REFUSED)
def test_a_url_input_is_refused_in_one_line(tmp_path, packed, url, command):
    argv = {"pack": ["pack", url, "-o", tmp_path / "out", "--capacity", "64"],
            "stats": ["stats", url],
            "verify --source": ["verify", packed, "--source", url],
            "materialize": ["materialize", url, "-o", tmp_path / "out"],
            "verify": ["verify", url],
            "export": ["export", url, "-o", tmp_path / "out", "--format", "nemo"]}[command]
    line = assert_clean_error(packctl(*argv), 2, f"{url}: object-store and URL inputs are not read yet; copy the "
                              "files locally (e.g. `")
    assert line.endswith("and pass the local directory")
    assert not (tmp_path / "out").exists()


def test_the_copy_command_fits_the_store(tmp_path):
    line = assert_clean_error(packctl("pack", "https://example.com/a.parquet", "-o", tmp_path / "out"), 2)
    assert "(e.g. `curl -O https://example.com/a.parquet`)" in line


# pack and materialize write s3:// OUT (tests/integration/test_s3_output.py); other schemes, and export's s3://,
# are refused
@pytest.mark.parametrize("command, url, copy", [
    ("pack", "gs://bucket/out", "gcloud storage rsync -r DIR gs://bucket/out"),
    ("materialize", "gs://bucket/out", "gcloud storage rsync -r DIR gs://bucket/out"),
    ("export", "s3://bucket/out", "aws s3 sync DIR s3://bucket/out"),
    ("tokenize", "s3://bucket/out", "aws s3 sync DIR s3://bucket/out"),
])
def test_a_url_output_is_refused_in_one_line(tmp_path, sample_data, command, url, copy):
    argv = {"pack": ["pack", sample_data, "-o", url, "--capacity", "64"],
            "materialize": ["materialize", tmp_path / "plan", "-o", url],
            "export": ["export", tmp_path / "packed", "-o", url, "--format", "nemo"],
            "tokenize": ["tokenize", SAMPLE_CHAT / "chat.jsonl", "-o", url, "--tokenizer", SAMPLE_CHAT / "tokenizer"]
            }[command]
    assert_clean_error(packctl(*argv), 2, f"{url}: object-store and URL outputs are not written yet; write to a "
                       f"local directory and copy it there (e.g. `{copy}`)")
    assert not os.path.exists(url.split("//")[0])  # nothing made of the mangled path

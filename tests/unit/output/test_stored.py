"""What a store output's manifest may list (packctl/contract/manifest.py `store_run_prefix`) and
the names of its runs (packctl/output/stored.py), without a store: an output on S3 lists its shards
under one run prefix, `runs/<run-id>/data/train-0000k.parquet`; a manifest that mixes two runs'
shards is never trusted."""
from __future__ import annotations

import re

import pytest

from packctl.contract.manifest import manifest_problems, store_run_prefix
from packctl.errors import PackctlError
from packctl.output.stored import committed_run, new_run_id, read_journal_text, refuse_on_store
from support.outputs import LAYOUT

RUN = "runs/20261128T071800Z-3f9a0c12/"


def _manifest(paths: list[str]) -> dict:
    shards = [{"path": p, "rows": 2, "tokens": 8, "sha256": "ab" * 32} for p in paths]
    counts = {"sequences_in": 2 * len(paths), "sequences_packed": 2 * len(paths), "sequences_dropped": 0,
              "sequences_truncated": 0, "sequences_split": 0, "tokens_in": 8 * len(paths),
              "tokens_packed": 8 * len(paths), "tokens_dropped": 0, "tokens_truncated": 0, "packs": 2 * len(paths)}
    return {"format_version": 2, "config": {"algorithm": "bfd", "tokens_column": "input_ids", "labels_column": None},
            "layout": LAYOUT, "inputs": [], "shards": shards, "counts": counts}


def test_shards_under_one_run_prefix_are_trusted(tmp_path):
    manifest = _manifest([f"{RUN}data/train-{k:05d}.parquet" for k in range(3)])
    assert manifest_problems(tmp_path, manifest) == []
    assert store_run_prefix(manifest["shards"]) == RUN == committed_run(manifest)
    assert committed_run(_manifest(["data/train-00000.parquet"])) is None


def test_a_manifest_that_mixes_two_runs_is_refused(tmp_path):
    other = "runs/20261128T081800Z-00000000/"
    manifest = _manifest([f"{RUN}data/train-00000.parquet", f"{other}data/train-00001.parquet",
                          "data/train-00002.parquet"])
    problems = [(p.rule, p.field) for p in manifest_problems(tmp_path, manifest)]
    assert problems == [("manifest-order", "shards[1].path"), ("manifest-order", "shards[2].path")]


def test_run_ids_sort_by_their_start():
    first, second = new_run_id(), new_run_id()
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", first) and first != second
    assert first[:16] <= second[:16]


def test_a_torn_or_foreign_journal_line_is_left_out():
    text = ('{"shard": "data/train-00001.parquet", "rows": 2, "tokens": 8, "sha256": "' + "a" * 64 + '"}\n'
            '{"shard": "data/train-00000.parquet", "rows": 2, "tokens": 8, "sha256": "' + "b" * 64 + '"}\n'
            '{"shard": "data/train-00002.par')
    assert [e.path for e in read_journal_text(text)] == ["data/train-00000.parquet", "data/train-00001.parquet"]


@pytest.mark.parametrize("epochs, ranks, expected", [
    (1, 4, "an output on an object store is written by one process, not under mpiexec"),
    (3, 1, "--epochs 3 writes one output per epoch"),
])
def test_what_a_store_output_does_not_take_is_refused_in_one_line(epochs, ranks, expected):
    with pytest.raises(PackctlError, match=f"^s3://b/out: {re.escape(expected)}"):
        refuse_on_store("s3://b/out", epochs=epochs, ranks=ranks)
    refuse_on_store("s3://b/out", epochs=1, ranks=1)

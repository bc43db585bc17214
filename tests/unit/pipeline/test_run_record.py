"""pipeline/manifest.py `RunRecord`: what a run's outputs record of its options, taken once at
preflight; the shards' metadata, the manifest and the run fingerprint are written from it."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from packctl import PackConfig
from packctl.contract.manifest import ShardEntry
from packctl.pipeline.manifest import EXECUTION_ONLY, PLAN_KIND, RunRecord
from packctl.source.files import FileFingerprint
from packctl.source.index import InputFile

FILES = [InputFile(path="data/a.parquet", rows=10, bytes=700), InputFile(path="s3://b/c.parquet", rows=5, bytes=300)]
READ = [FileFingerprint(size=700, mtime_ns=11, footer="f" * 32), FileFingerprint(size=300, mtime_ns=22, footer="e" * 32)]
BASE = PackConfig(inputs=["data"], output="out", capacity=64, too_long="split")


def record(**options) -> RunRecord:
    return RunRecord.of(dataclasses.replace(BASE, **options), "labels", [f.path for f in FILES])


@pytest.mark.parametrize("execution", [dict(output="elsewhere"), dict(overwrite=True), dict(memory_budget="1GiB"),
                                       dict(token_transfer="exchange"), dict(resume=True)])
def test_shards_record_what_they_hold_not_where_or_how_the_run_executes(execution):
    """The same packing has the same shard bytes wherever and however it is written."""
    assert record(**execution).shard_metadata(FILES) == record().shard_metadata(FILES)
    assert record(**execution).fingerprint(FILES, READ) == record().fingerprint(FILES, READ)
    metadata = json.loads(record(**execution).shard_metadata(FILES))
    assert not set(EXECUTION_ONLY) & set(metadata["config"]) and "plan_only" not in metadata["config"]
    assert metadata["config"]["resume"] is False and metadata["config"]["labels_column"] == "labels"
    assert record(**execution).manifest(FILES, [], {}, {})["config"]["resume"] is execution.get("resume", False)


def test_a_plan_shares_its_shards_metadata_with_its_packs_but_not_its_fingerprint_or_manifest_kind():
    plan, packs = record(plan_only=True), record()
    assert plan.plan_only and not packs.plan_only
    assert plan.shard_metadata(FILES) == packs.shard_metadata(FILES)  # materialize writes pack's bytes
    assert plan.fingerprint(FILES, READ)["kind"] == PLAN_KIND and packs.fingerprint(FILES, READ)["kind"] == "packs"
    assert plan.fingerprint(FILES, READ)["config"]["plan_only"] is True
    shards = [ShardEntry(path="data/train-00000.parquet", rows=3, tokens=150, sha256="0" * 64)]
    manifest = plan.manifest(FILES, shards, {"packs": 3}, {"total": 1.0}, READ)
    assert manifest["kind"] == PLAN_KIND and "kind" not in packs.manifest(FILES, shards, {}, {}, READ)
    local, url = manifest["inputs"]
    assert local["absolute_path"] == os.path.abspath("data/a.parquet") and url["absolute_path"] == "s3://b/c.parquet"
    assert (local["mtime_ns"], local["footer"]) == (11, "f" * 32)
    assert manifest["shards"] == [dataclasses.asdict(shards[0])]


def test_the_fingerprint_holds_what_the_run_read_of_each_input():
    fingerprint = record().fingerprint(FILES, READ)
    assert [(e["path"], e["mtime_ns"], e["footer"]) for e in fingerprint["inputs"]] == [
        ("data/a.parquet", 11, "f" * 32), ("s3://b/c.parquet", 22, "e" * 32)]
    changed = [READ[0], dataclasses.replace(READ[1], footer="d" * 32)]
    assert record().fingerprint(FILES, changed) != fingerprint


def test_a_manifest_is_its_own_copy_of_the_record():
    """Every output of a run (one per epoch) gets a manifest of its own: changing one changes no
    other and not the record."""
    kept = record()
    first = kept.manifest(FILES, [], {}, {})
    first["config"]["capacity"] = 1
    first["layout"]["capacity"] = 1
    assert kept.manifest(FILES, [], {}, {})["config"]["capacity"] == 64 == kept.layout["capacity"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.config = {}

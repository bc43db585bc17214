"""`pack --plan-only` and `packctl materialize`: a plan is the output without its token columns,
and materializing it writes the shards `pack` writes, byte for byte, for any rank count; the loader
reads a plan as it reads the materialized output (tests/integration/training/test_plan_loader.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack
from packctl.contract.schema import SEQ_STARTS, TOKEN_COLUMNS
from packctl.pipeline import materialize_plan
from support.adversary import assert_clean_error, assert_every_sample_once, packctl
from support.data import sample_corpus
from support.threadcomm import run_ranks

BASE = ["--capacity", "256", "--too-long", "split", "--shard-rows", "150", "-q"]
CONFIGS = {
    "split": [],
    "cp2": ["--cp-size", "2"],
    "steps": ["--dp-size", "2", "--micro-batches", "2"],
    "shuffle": ["--order", "shuffle", "--seed", "3"],
    "epochs": ["--order", "shuffle", "--epochs", "2"],
    "truncate": ["--too-long", "truncate", "--pad-to", "multiple", "--seq-multiple", "8"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return sample_corpus(tmp_path_factory.mktemp("corpus") / "corpus", sequences=400, distribution="lognormal",
                         shards=2, seed=1, max_length=700)


def digests(out: Path) -> dict[str, str]:
    """sha256 of every file of OUT but its JSON reports (their timings differ run to run)."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.suffix != ".json"}


def manifests(out: Path) -> dict[str, dict]:
    """Every manifest of OUT without its timings and the -o it was written to."""
    found = {}
    for path in sorted(out.rglob("_manifest.json")):
        manifest = json.loads(path.read_text())
        manifest.pop("timings")
        manifest["config"].pop("output")
        found[path.relative_to(out).as_posix()] = manifest
    return found


def three_ways(tmp_path: Path, corpus: Path, options: list[str]) -> tuple[Path, Path, Path]:
    """(pack, pack --plan-only, materialize of that plan)."""
    full, plan, made = tmp_path / "full", tmp_path / "plan", tmp_path / "made"
    assert packctl("pack", corpus, "-o", full, *BASE, *options).code == 0
    result = packctl("pack", corpus, "-o", plan, *BASE, *options, "--plan-only")
    assert result.code == 0, result.stderr
    result = packctl("materialize", plan, "-o", made, "-q")
    assert result.code == 0, result.stderr
    return full, plan, made


@pytest.mark.parametrize("name", list(CONFIGS))
def test_materialized_plan_is_the_packed_output(tmp_path, corpus, name):
    full, plan, made = three_ways(tmp_path, corpus, CONFIGS[name])
    assert digests(made) == digests(full)
    expected = manifests(full)
    for manifest in expected.values():  # the -o of each run aside, materialize records pack's options
        manifest["config"]["memory_budget"] = None
    got = manifests(made)
    for manifest in got.values():
        manifest["config"]["memory_budget"] = None
    assert got == expected
    # the plan: every column of the packs but the token columns, the same values, and seq_starts
    for rel in digests(full):
        packed, planned = pq.read_table(full / rel), pq.read_table(plan / rel)
        assert planned.column_names == [n for n in packed.column_names if n not in TOKEN_COLUMNS] + [SEQ_STARTS]
        for column in planned.column_names[:-1]:
            assert planned.column(column).equals(packed.column(column)), column
        assert pq.read_schema(plan / rel).metadata == pq.read_schema(full / rel).metadata
    for path in plan.rglob("_manifest.json"):
        manifest = json.loads(path.read_text())
        assert manifest["kind"] == "plan" and manifest["config"]["plan_only"] is True
        assert all({"absolute_path", "mtime_ns", "footer"} <= set(entry) for entry in manifest["inputs"])
    if name != "epochs":
        assert_every_sample_once(made, [corpus])


def test_plan_costs_a_few_percent_of_the_output(tmp_path, corpus):
    full, plan, _ = three_ways(tmp_path, corpus, ["--capacity", "4096"])
    size = {out: sum(p.stat().st_size for p in out.rglob("*.parquet")) for out in (full, plan)}
    assert size[plan] < 0.05 * size[full], size


@pytest.mark.parametrize("ranks", [2, 3])
def test_plan_and_materialize_are_the_same_bytes_for_any_rank_count(tmp_path, corpus, ranks):
    options = dict(capacity=256, too_long="split", shard_rows=150, order="shuffle")
    pack(PackConfig(inputs=[str(corpus)], output=str(tmp_path / "plan1"), plan_only=True, **options))
    run_ranks(ranks, lambda comm: pack(PackConfig(inputs=[str(corpus)], output=str(tmp_path / "planN"),
                                                  plan_only=True, **options), comm=comm))
    assert digests(tmp_path / "planN") == digests(tmp_path / "plan1")
    materialize_plan(tmp_path / "plan1", tmp_path / "made1")
    run_ranks(ranks, lambda comm: materialize_plan(tmp_path / "plan1", tmp_path / "madeN", comm=comm,
                                                   token_transfer="read" if ranks == 2 else "exchange"))
    assert digests(tmp_path / "madeN") == digests(tmp_path / "made1")
    pack(PackConfig(inputs=[str(corpus)], output=str(tmp_path / "full"), **options))
    assert digests(tmp_path / "made1") == digests(tmp_path / "full")
    # what the packs achieve is the plan's; how they were written (ranks, scale-out) is this run's
    plan_metrics, made = (json.loads((tmp_path / d / "_metrics.json").read_text()) for d in ("plan1", "madeN"))
    assert [r["rank"] for r in made["ranks"]] == list(range(ranks)) and "ranks" not in plan_metrics
    assert made["scale_out"]["ranks"] == ranks and made["scale_out"]["sequences_planned"]["max"] == 0
    assert sum(r["packs_written"] for r in made["ranks"]) == made["counts"]["packs"] == plan_metrics["counts"]["packs"]
    assert made["utilization"] == plan_metrics["utilization"]
    full = json.loads((tmp_path / "full" / "_metrics.json").read_text())
    assert made["throughput"]["tokens_equal_to_pad_id"] == full["throughput"]["tokens_equal_to_pad_id"]


def test_stats_of_a_plan_are_those_of_its_output(tmp_path, corpus):
    full, plan, _ = three_ways(tmp_path, corpus, [])
    of_plan, of_full = packctl("stats", plan, "--json"), packctl("stats", full, "--json")
    assert of_plan.code == 0 and of_full.code == 0, of_plan.stderr
    a, b = json.loads(of_plan.stdout), json.loads(of_full.stdout)
    for report in (a, b):
        report.pop("path"), report.pop("stats_seconds")
    assert a == b


def test_verify_checks_a_plan_with_its_source_tokens(tmp_path, corpus):
    _, plan, made = three_ways(tmp_path, corpus, [])
    for out in (plan, made):
        result = packctl("verify", out, "--source", corpus, "--no-attention")
        assert result.code == 0, result.stdout + result.stderr


def test_memory_budget_spills_and_writes_the_same_bytes(tmp_path, corpus):
    full, plan, _ = three_ways(tmp_path, corpus, ["--order", "shuffle"])
    result = packctl("materialize", plan, "-o", tmp_path / "spilled", "--memory-budget", "200KB", "--json")
    assert result.code == 0, result.stderr
    assert digests(tmp_path / "spilled") == digests(full)


def test_pack_resume_takes_a_materialized_output_as_its_own(tmp_path, corpus):
    """Materialize writes the output of `pack` without --plan-only: `pack --resume` of those options
    finds it complete, and `pack --plan-only --resume` finds it is not a plan."""
    full, plan, made = three_ways(tmp_path, corpus, [])
    again = packctl("pack", corpus, "-o", made, *BASE, "--resume")
    assert again.code == 0 and "already complete" in again.stderr, again.stderr
    other = packctl("pack", corpus, "-o", made, *BASE, "--plan-only", "--resume")
    assert_clean_error(other, 2, "already exists", "plan_only")
    rematerialized = packctl("materialize", plan, "-o", made, "--resume")
    assert rematerialized.code == 0 and "already complete" in rematerialized.stderr


def test_kept_columns_weights_and_groups_travel_through_a_plan(tmp_path):
    """--keep-columns, --weight-column and --group-column values are the plan's to write: the
    materialized shards hold them as pack writes them."""
    import pyarrow as pa

    corpus = sample_corpus(tmp_path / "corpus", sequences=200, distribution="lognormal", shards=2, seed=4,
                           max_length=100, groups="preference")
    for path in sorted(corpus.glob("*.parquet")):
        table = pq.read_table(path)
        n = table.num_rows
        table = table.append_column("doc", pa.array([f"{path.stem}-{i}" for i in range(n)]))
        table = table.append_column("w", pa.array([0.5 + (i % 3) for i in range(n)], pa.float32()))
        pq.write_table(table, path)
    options = ["--keep-columns", "doc", "--weight-column", "w", "--group-column", "group_id"]
    full, plan, made = three_ways(tmp_path, corpus, options)
    assert digests(made) == digests(full)
    names = pq.read_schema(next((plan / "data").glob("*.parquet"))).names
    assert {"doc", "seq_weights", "group_ids", "seq_starts"} <= set(names)


def test_a_tampered_plan_is_refused_with_advice_materialize_has(tmp_path, corpus):
    """materialize always checks a plan's shards: its error names no option it lacks."""
    plan = tmp_path / "plan"
    assert packctl("pack", corpus, "-o", plan, "--capacity", "4096", "--too-long", "split", "--plan-only",
                   "-q").code == 0
    shard = plan / "data" / "train-00000.parquet"
    pq.write_table(pq.read_table(shard), shard, compression="gzip")  # the same rows, other bytes: another sha256
    result = packctl("materialize", plan, "-o", tmp_path / "out", "-q")
    line = assert_clean_error(result, 2, str(shard), "make the plan again (packctl pack --plan-only)")
    assert "--no-verify-checksums" not in line and "verify=False" not in line

"""`pack --source` with `--group-column`: a blend draws whole groups (DPO-like pairs in one
source, plain rows in another), keeps each drawn group's rows together in gid order, holds the
blend's shares, passes verify's group rules and per-source conservation, and writes the same
bytes for any rank count; `stats --source --group-column` shows what pack writes; --share-prefix
with --source is refused in one line."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack
from support.adversary import assert_clean_error, packctl
from support.data import write_table
from support.threadcomm import run_ranks

CAPACITY = 512


def _source(root: Path, name: str, rows: int, longest: int, seed: int, group: int, first_value: int) -> Path:
    """`rows` rows of 1..longest tokens in groups of `group` consecutive rows (column `g`)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, rows)
    ids = [(seed * 1000 + rng.integers(0, 1000, n)).tolist() for n in lengths]
    values = first_value + np.arange(rows) // group
    write_table(root / name / "part-0.parquet", {"input_ids": pa.array(ids, pa.list_(pa.int32())),
                                                "g": pa.array(values, pa.int64())})
    return root / name


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture-groups")
    return {"pairs": _source(root, "pairs", 400, 100, 1, 2, 0), "plain": _source(root, "plain", 900, 60, 2, 1, 10_000)}


def _config(blend, out: Path, weights: dict[str, float], caps: dict[str, float] | None = None, **options):
    sources = {n: {"path": str(blend[n]), "weight": w, **({"max-repeat": caps[n]} if caps and n in caps else {})}
               for n, w in weights.items()}
    return PackConfig(output=str(out), sources=sources, group_column="g", **{"capacity": CAPACITY, **options})


def _rows(out: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    table = pq.read_table(out / "data", columns=["seq_lens", "sample_ids", "source_ids", "group_ids"])
    flat = [np.concatenate(table.column(c).to_numpy(zero_copy_only=False)) for c in table.column_names]
    return tuple(flat)


@pytest.mark.parametrize("order", ["input", "shuffle", "curriculum"])
def test_a_blend_draws_whole_groups_and_holds_its_shares(tmp_path, blend, order):
    weights = {"pairs": 0.6, "plain": 0.4}
    result = pack(_config(blend, tmp_path / "out", weights, caps={"pairs": 2.0}, tokens=40_000, order=order))
    lens, gids, source, groups = _rows(tmp_path / "out")
    given = np.bincount(source, weights=lens, minlength=2)
    # each source within half its largest group (2 rows of 100 tokens) of its target
    assert np.all(np.abs(given - np.array([0.6, 0.4]) * 40_000) <= np.array([200, 60]) / 2 + 1e-6)
    assert [s["realized"] for s in result.metrics["mixture"]["sources"]] == pytest.approx(given / given.sum())
    pairs = source == 0
    # a pair's rows are used equally often: the group is drawn, not its rows
    counts = np.bincount(gids[pairs], minlength=400)
    assert (counts[0::2] == counts[1::2]).all() and counts.max() == 2
    assert (groups == gids - (gids % 2) * pairs).all()
    # every use of a pair is its two rows in a row, first then second
    first = np.flatnonzero(pairs & (gids % 2 == 0))
    assert (gids[first + 1] == gids[first] + 1).all()
    report = packctl("verify", tmp_path / "out", "--source", blend["pairs"], "--source", blend["plain"],
                     "--no-attention")
    assert report.code == 0, report.stdout + report.stderr


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_same_bytes_for_any_rank_count(tmp_path, blend, ranks):
    options = dict(tokens=30_000, window=60, shard_rows=10, order="shuffle")
    weights = {"pairs": 0.5, "plain": 0.5}
    pack(_config(blend, tmp_path / "one", weights, {"pairs": 2.0}, **options))
    run_ranks(ranks, lambda comm: pack(_config(blend, tmp_path / "many", weights, {"pairs": 2.0}, **options),
                                       comm=comm))
    digest = (lambda out: {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                           for p in sorted(out.rglob("*.parquet"))})
    assert digest(tmp_path / "many") == digest(tmp_path / "one")


def test_share_prefix_with_sources_is_refused_in_one_line(tmp_path, blend):
    result = packctl("pack", "--source", f"pairs={blend['pairs']}:1", "--group-column", "g", "--share-prefix",
                     "-o", tmp_path / "out")
    assert_clean_error(result, 2, "--share-prefix with --source")


def test_groups_kept_within_steps_in_a_blend_pass_verify(tmp_path, blend):
    pack(_config(blend, tmp_path / "out", {"pairs": 0.5, "plain": 0.5}, {"pairs": 2.0}, tokens=20_000,
                 order="shuffle", group_scope="step", dp_size=2, micro_batches=2, capacity=128))
    report = packctl("verify", tmp_path / "out", "--source", blend["pairs"], "--source", blend["plain"],
                     "--no-attention")
    assert report.code == 0, report.stdout + report.stderr


@pytest.mark.parametrize("dp_size", [None, 2])
def test_stats_of_a_grouped_blend_before_packing_is_what_pack_writes(tmp_path, blend, dp_size):
    steps = {"dp_size": dp_size, "micro_batches": 2} if dp_size else {}
    result = pack(_config(blend, tmp_path / "out", {"pairs": 0.5, "plain": 0.5}, caps={"pairs": 2.0},
                          tokens=30_000, order="shuffle", algorithm="bfd", **steps))
    flags = ["--dp-size", str(dp_size), "--micro-batches", "2"] if dp_size else []
    before = packctl("stats", "--source", f"pairs={blend['pairs']}:0.5:2", "--source", f"plain={blend['plain']}:0.5",
                     "--group-column", "g", "--capacity", str(CAPACITY), "--tokens", "30000", "--order", "shuffle",
                     "--algorithm", "bfd", *flags, "--json")
    assert before.code == 0, before.stderr
    planned = json.loads(before.stdout)
    row = next(r for r in planned["what_if"] if r["algorithm"] == "bfd")
    assert row["packs"] == result.metrics["packs"]
    recorded = result.metrics["mixture"]["sources"]
    assert [s["uses"] for s in planned["mixture"]["sources"]] == [s["uses"] for s in recorded]
    assert [s["realized"] for s in planned["mixture"]["sources"]] == pytest.approx([s["realized"] for s in recorded])
    assert row["group_cost"]["packs_without_groups"] > 0


def test_stats_of_a_blend_refuses_a_group_found_in_two_sources(tmp_path):
    root = tmp_path / "in"
    one, two = _source(root, "one", 20, 30, 1, 2, 0), _source(root, "two", 20, 30, 2, 2, 5)
    result = packctl("stats", "--source", f"one={one}:0.5", "--source", f"two={two}:0.5", "--group-column", "g",
                     "--capacity", str(CAPACITY))
    assert_clean_error(result, 2, "column 'g'", "appears again")

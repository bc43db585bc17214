"""`pack --source` with `--group-column`: a blend draws whole groups (DPO-like pairs in one
source, plain rows in another), keeps each drawn group's rows together in gid order, holds the
blend's shares, passes verify's group rules and per-source conservation, and writes the same
bytes for any rank count; --share-prefix with --source is refused in one line."""
from __future__ import annotations

import hashlib
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


@pytest.mark.parametrize("order", ["input", "shuffle"])
def test_stats_of_a_grouped_blend_before_packing_is_what_pack_writes(tmp_path, blend, order):
    """The what-if of a grouped blend draws, orders and packs the blend's uses as pack does: its
    row for pack's settings has pack's packs, tokens and sequences, and its blend is pack's."""
    from packctl.stats import stats

    weights, caps = {"pairs": 0.5, "plain": 0.5}, {"pairs": 2.0}
    result = pack(_config(blend, tmp_path / "out", weights, caps, tokens=20_000, order=order, algorithm="ffd"))
    config = _config(blend, tmp_path / "unused", weights, caps, tokens=20_000, order=order, algorithm="ffd")
    sources = [f"{n}={blend[n]}:{w}" + (f":{caps[n]}" if n in caps else "") for n, w in weights.items()]
    report = stats([], capacities=[CAPACITY], sources=sources, group_column="g", tokens=20_000, order=order,
                   algorithm="ffd")
    row = next(r for r in report["what_if"] if r["algorithm"] == "ffd")
    assert row["packs"] == result.metrics["packs"]
    assert row["tokens"] == result.metrics["tokens"]
    assert report["groups"] is not None
    realized = {s["name"]: s["realized"] for s in report["mixture"]["sources"]}
    assert realized == {s["name"]: s["realized"] for s in result.metrics["mixture"]["sources"]}
    assert config.group_column == "g"

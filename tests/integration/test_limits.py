"""--limit COL=N through the whole pipeline: random small corpora with one or two limited columns,
every algorithm, order, window, group scope, balancing and rank count (in-process ranks): no pack over any
limit (read back from the output), every sample exactly once or counted as over_limit, the values
of the source, the same bytes for any rank count, and the independent contract checker passing."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from packctl import PackConfig, PackctlError, pack
from packctl.plan.names import ALGORITHMS

from support.contract import check_contract
from support.profiles import examples
from support.threadcomm import run_ranks

COLUMNS = ("images", "frames")
INTEGER_TYPES = (pa.int32(), pa.uint8(), pa.int64(), pa.uint32())


def _write_corpus(folder: Path, lengths, costs, groups, types) -> None:
    """Two files of rows with token lists, the limited columns (each of its own integer type) and,
    with `groups`, a group_id column (runs of consecutive rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(lengths)
    cut = n // 2
    rng = np.random.default_rng(n)
    for part, (lo, hi) in enumerate(((0, cut), (cut, n))):
        if lo == hi:
            continue
        columns = {"input_ids": pa.array([rng.integers(1, 1000, size=length).tolist() for length in lengths[lo:hi]],
                                         pa.list_(pa.int32()))}
        for j, column in enumerate(COLUMNS[:costs.shape[1]]):
            columns[column] = pa.array(costs[lo:hi, j].tolist(), types[j])
        if groups is not None:
            columns["group_id"] = pa.array(groups[lo:hi].tolist(), pa.int64())
        pq.write_table(pa.table(columns), folder / f"part-{part}.parquet", row_group_size=7)


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(out.glob("data/*.parquet")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _read_output(out: Path, names: list[str]):
    """(sample ids, per-sequence values n x k, per-pack sums P x k, sequences per pack) of every shard."""
    tables = [pq.read_table(p) for p in sorted(out.glob("data/*.parquet"))]
    table = pa.concat_tables(tables)
    ids = table.column("sample_ids").combine_chunks()
    per_pack = np.diff(ids.offsets.to_numpy())
    values = np.stack([table.column(c).combine_chunks().flatten().to_numpy() for c in names], axis=1)
    sums = np.stack([table.column(f"{c}_sum").to_numpy() for c in names], axis=1)
    assert all(table.schema.field(c).type == pa.list_(pa.int64()) for c in names)
    assert all(table.schema.field(f"{c}_sum").type == pa.int64() for c in names)
    return ids.flatten().to_numpy(), values, sums, per_pack


@st.composite
def _cases(draw):
    n = draw(st.integers(1, 40))
    k = draw(st.integers(1, 2))
    capacity = draw(st.sampled_from([64, 128]))
    algorithm = draw(st.sampled_from(ALGORITHMS))
    grouped = algorithm != "split" and draw(st.booleans())
    too_long = draw(st.sampled_from(["drop", "drop", "split"])) if not grouped else "drop"
    lengths = np.array(draw(st.lists(st.integers(1, capacity + 40), min_size=n, max_size=n)), np.int64)
    costs = np.array(draw(st.lists(st.lists(st.integers(0, 9), min_size=k, max_size=k), min_size=n, max_size=n)),
                     np.int64)
    costs[np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))] = 0  # text rows: no cost
    limits = draw(st.lists(st.integers(1, 12), min_size=k, max_size=k))
    if too_long == "split":  # split refuses media it would cut: over-long rows have none, none is over a limit
        costs[lengths > capacity] = 0
        costs = np.minimum(costs, np.array(limits))
    groups = None
    if grouped:  # runs of 1-3 rows, members of a run of two or more short enough to fit a pack together
        sizes = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        groups = np.repeat(np.arange(n), sizes)[:n]
        big = np.bincount(groups)[groups] > 1
        lengths[big] = np.minimum(lengths[big], capacity // 4)
    return dict(lengths=lengths, costs=costs, limits=limits, capacity=capacity, algorithm=algorithm,
                too_long=too_long, groups=groups,
                order=draw(st.sampled_from(["input", "shuffle", "curriculum"])),
                window=draw(st.sampled_from([4, 9, 100])), ranks=draw(st.integers(2, 3)),
                scope=draw(st.sampled_from(["pack", "step"])) if grouped else "pack",
                types=[draw(st.sampled_from(INTEGER_TYPES)) for _ in range(k)], seed=draw(st.integers(0, 3)),
                balanced=not grouped and draw(st.booleans()))


def _expected_group_error(case) -> bool:
    """Whether a group of two or more is over a limit: its sum (--group-scope pack) or a member (step)."""
    groups, costs, limits = case["groups"], case["costs"], np.array(case["limits"])
    if groups is None:
        return False
    size = np.bincount(groups)
    big = size[groups] > 1
    if case["scope"] == "step":
        return bool(((costs > limits).any(axis=1) & big).any())
    sums = np.stack([np.bincount(groups, weights=costs[:, j]) for j in range(costs.shape[1])], axis=1)
    return bool(((sums > limits).any(axis=1) & (size > 1)).any())


@pytest.mark.slow
@settings(max_examples=examples(200, default=12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_cases())
def test_no_pack_over_a_limit_every_sample_once_same_bytes_on_any_rank_count(tmp_path_factory, contract, case):
    tmp = tmp_path_factory.mktemp("limits")
    names = list(COLUMNS[:case["costs"].shape[1]])
    _write_corpus(tmp / "in", case["lengths"], case["costs"], case["groups"], case["types"])
    options = dict(inputs=[str(tmp / "in")], capacity=case["capacity"], algorithm=case["algorithm"],
                   too_long=case["too_long"], order=case["order"], window=case["window"], seed=case["seed"],
                   limits=dict(zip(names, case["limits"])), overwrite=True)
    if case["groups"] is not None:
        options.update(group_column="group_id", group_scope=case["scope"])
        if case["scope"] == "step":
            options.update(dp_size=2, micro_batches=2)
    if case["balanced"]:  # the balancer moves sequences between a step's packs: never one with a cost
        options.update(dp_size=2, micro_batches=3, balance_scope="sequences")
    if _expected_group_error(case):
        with pytest.raises(PackctlError, match="--limit"):
            pack(PackConfig(output=str(tmp / "one"), **options))
        return
    limits, lengths, costs = np.array(case["limits"]), case["lengths"], case["costs"]
    over_limit = (costs > limits).any(axis=1)
    over_capacity = lengths > case["capacity"]
    lost = over_limit | over_capacity if case["too_long"] == "drop" else np.zeros(len(lengths), bool)
    if lost.all():
        with pytest.raises(PackctlError, match="nothing to pack"):
            pack(PackConfig(output=str(tmp / "one"), **options))
        return
    result = pack(PackConfig(output=str(tmp / "one"), **options))

    ids, values, sums, per_pack = _read_output(tmp / "one", names)
    assert (sums <= limits).all(), "a pack over a limit"
    starts = np.concatenate([[0], np.cumsum(per_pack)[:-1]])
    assert np.array_equal(np.add.reduceat(values, starts, axis=0), sums)
    assert np.array_equal(values, costs[ids]), "each sequence carries its sample's values"
    assert set(ids.tolist()) == set(np.flatnonzero(~lost).tolist()), "every sample packed but those dropped"
    pieces = np.bincount(ids, minlength=len(lengths))
    assert (pieces[costs.any(axis=1)] <= 1).all(), "a sample with media is never cut"
    counts = result.counts
    assert counts["over_limit"] == int((over_limit & (case["too_long"] == "drop")).sum())
    assert counts["sequences_dropped"] == int(lost.sum())
    metrics = json.loads((tmp / "one" / "_metrics.json").read_text())
    for j, column in enumerate(names):
        figures = metrics["limits"][column]
        assert figures["limit"] == limits[j] and figures["total"] == int(sums[:, j].sum())
        assert figures["packs_at_limit"] == int((sums[:, j] * 100 >= 99 * limits[j]).sum())
    manifest = json.loads((tmp / "one" / "_manifest.json").read_text())
    assert manifest["layout"]["limits"] == dict(zip(names, case["limits"]))
    assert check_contract(contract, tmp / "one", [tmp / "in"]) == []

    run_ranks(case["ranks"], lambda comm: pack(PackConfig(output=str(tmp / "many"), **options), comm=comm))
    assert _digest(tmp / "many") == _digest(tmp / "one")


def test_limits_that_never_bind_write_the_packs_of_tokens_alone(tmp_path):
    """A limit no pack reaches changes no pack: the token columns are those of a run without it."""
    lengths = np.array([40, 30, 20, 90, 10, 64, 5, 33] * 4)
    costs = np.ones((len(lengths), 1), np.int64)
    _write_corpus(tmp_path / "in", lengths, costs, None, [pa.int32()])
    options = dict(inputs=[str(tmp_path / "in")], capacity=128, too_long="split", overwrite=True)
    pack(PackConfig(output=str(tmp_path / "plain"), **{**options, "too_long": "drop"}))
    pack(PackConfig(output=str(tmp_path / "limited"), limits={"images": 1000}, **{**options, "too_long": "drop"}))
    plain = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "plain").glob("data/*.parquet"))])
    limited = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "limited").glob("data/*.parquet"))])
    for name in plain.column_names:
        assert limited.column(name).equals(plain.column(name)), name
    assert limited.column_names == [*plain.column_names, "images_sum", "images"]


def test_a_plan_and_its_materialized_output_carry_the_limits(tmp_path, contract):
    """--plan-only writes COL and COL_sum like any column of one value per sequence or pack, and
    packctl materialize writes the bytes pack writes."""
    from packctl.pipeline.from_plan import materialize_plan

    lengths = np.arange(1, 61) * 3
    costs = np.stack([np.arange(60) % 4, np.arange(60) % 3], axis=1)
    _write_corpus(tmp_path / "in", lengths, costs, None, [pa.uint8(), pa.int64()])
    options = dict(inputs=[str(tmp_path / "in")], capacity=256, limits={"images": 5, "frames": 4},
                   order="shuffle", overwrite=True)
    pack(PackConfig(output=str(tmp_path / "packs"), **options))
    pack(PackConfig(output=str(tmp_path / "plan"), plan_only=True, **options))
    plan = pq.read_table(sorted((tmp_path / "plan").glob("data/*.parquet"))[0])
    assert {"images", "images_sum", "frames", "frames_sum"} <= set(plan.column_names)
    materialize_plan(tmp_path / "plan", tmp_path / "made")
    assert _digest(tmp_path / "made") == _digest(tmp_path / "packs")
    assert check_contract(contract, tmp_path / "made", [tmp_path / "in"]) == []


def test_epochs_keep_every_limit(tmp_path):
    """Each epoch's packs, exchanged from the exact plan, keep every limit."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(5, 120, 200)
    costs = rng.integers(0, 4, (200, 1))
    _write_corpus(tmp_path / "in", lengths, costs, None, [pa.int32()])
    pack(PackConfig(inputs=[str(tmp_path / "in")], output=str(tmp_path / "out"), capacity=256, epochs=3,
                    order="shuffle", limits={"images": 6}, overwrite=True))
    for epoch in range(3):
        _, values, sums, _ = _read_output(tmp_path / "out" / f"epoch-{epoch:05d}", ["images"])
        assert (sums <= 6).all() and values.sum() == costs.sum()

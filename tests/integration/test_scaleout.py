"""Scale-out: shards and row-group units, the writers' runs, joining shared shards, the sort's merge,
and multi-rank packs run in-process (tests/support/threadcomm.py) so the exchange paths run in plain pytest."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from packctl import PackConfig, pack
from packctl.pipeline.assign import ROW_GROUP_PACKS, Units, assign, units_of, write_run, writer_cuts
from packctl.mpi.samplesort import _lex_order, merge_runs
from packctl.output.stitch import encode_footer, parse_footer, stitch
from packctl.output.encode import PARQUET_OPTIONS, encode_table

from support.runs import assert_ranks_shared_the_run
from support.threadcomm import run_ranks
from support.profiles import examples


def test_units_are_row_groups_inside_shards():
    units = units_of(np.array([0, 300, 310]), np.full(310, 10), shard_rows=200, row_group_packs=128)
    # shards [0, 200) [200, 300) [300, 310): units of at most 128 packs inside each
    assert units.bounds.tolist() == [0, 128, 200, 300, 310]
    assert units.first_of_shard.tolist() == [True, False, True, True]
    assert units.tokens.tolist() == [1280, 720, 1000, 100]


def test_writer_cuts_by_hand():
    assert writer_cuts(np.array([4, 4, 4, 4]), 2).tolist() == [0, 2, 4]
    assert writer_cuts(np.array([10, 1, 1, 1, 1]), 2).tolist() == [0, 1, 5]  # 7 is nearer to 10 than to 0
    assert writer_cuts(np.array([5]), 3).tolist() == [0, 0, 1, 1]  # more writers than units: some get none
    assert writer_cuts(np.zeros(0, np.int64), 2).tolist() == [0, 0, 0]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=0, max_size=60), st.integers(1, 12))
def test_every_writer_is_within_one_unit_of_an_equal_share(tokens, writers):
    tokens = np.array(tokens, dtype=np.int64)
    cuts = writer_cuts(tokens, writers)
    assert cuts[0] == 0 and cuts[-1] == len(tokens) and (np.diff(cuts) >= 0).all()
    shares = np.diff(np.concatenate([[0], np.cumsum(tokens)])[cuts]) if len(tokens) else np.zeros(writers)
    biggest = int(tokens.max()) if len(tokens) else 0
    assert (shares <= tokens.sum() / writers + biggest).all()


def test_assignment_numbers_shards_globally_and_finds_shared_ones():
    # two planning ranks: rank 0 planned shards of 3 and 1 units, rank 1 one shard of 2 units
    rank0 = Units(bounds=np.array([0, 2, 4, 6, 7]), first_of_shard=np.array([True, False, False, True]),
                  tokens=np.array([20, 20, 20, 5]))
    rank1 = Units(bounds=np.array([0, 2, 4]), first_of_shard=np.array([True, False]), tokens=np.array([10, 10]))
    a = assign([rank0, rank1], 2)
    assert a.unit_shard.tolist() == [0, 0, 0, 1, 2, 2]
    assert a.unit_part.tolist() == [0, 1, 2, 0, 0, 1]
    assert a.cuts.tolist() == [0, 2, 6]  # 85 tokens: the boundary nearest to 42.5 is 40, inside shard 0
    first, second = write_run(a, 0), write_run(a, 1)
    assert first.shard_runs == {0: [0, 2]} and first.finishes(0)
    assert second.shard_runs == {0: [0, 2]} and not second.finishes(0)
    assert second.unit_bounds.tolist() == [0, 2, 3, 5, 7]
    assert a.writer_tokens().tolist() == [40, 45]


def _table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 500, rows)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    values = rng.integers(0, 32000, int(offsets[-1])).astype(np.int32)
    return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                     "num_tokens": pa.array(lens.astype(np.int32)),
                     "lr_scale": pa.array(rng.random(rows).astype(np.float32))}
                    ).replace_schema_metadata({b"packctl": b'{"format_version": 1}'})


@pytest.mark.parametrize("rows, group", [(300, 128), (1, 1), (257, 64)])
def test_joined_parts_are_the_file_pyarrow_writes_with_those_row_groups(rows, group):
    table = _table(rows, rows)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=group, **PARQUET_OPTIONS)
    direct = sink.getvalue().to_pybytes()
    parts = [encode_table(table.slice(lo, group)) for lo in range(0, rows, group)]
    assert stitch(parts) == direct
    # joining is associative: runs joined first (one writer's part of a shard), then joined again
    half = max(1, len(parts) // 2)
    assert stitch([stitch(parts[:half]), *([stitch(parts[half:])] if parts[half:] else [])]) == direct
    assert pq.read_table(pa.BufferReader(stitch(parts))).equals(table)


def test_footer_round_trip_and_refused_page_index():
    data = encode_table(_table(50, 1))
    footer, start = parse_footer(data)
    assert encode_footer(footer) == data[start:-8]
    sink = pa.BufferOutputStream()
    pq.write_table(_table(50, 2), sink, write_page_index=True)
    with pytest.raises(ValueError, match="page index"):
        stitch([sink.getvalue().to_pybytes(), sink.getvalue().to_pybytes()])
    with pytest.raises(ValueError, match="not a Parquet file"):
        stitch([b"nope", data])


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6)), max_size=30), min_size=1, max_size=6),
       st.booleans())
def test_merge_of_sorted_runs_is_the_lexicographic_order(runs, gid_ranges_in_order):
    keys, gids = [], []
    base = 0
    for run in runs:
        k = np.array([r[0] for r in run], dtype=np.int64)
        g = np.array([r[1] for r in run], dtype=np.int64)
        if gid_ranges_in_order:  # as scan gives them: every rank's gids below the next rank's
            g = base + np.arange(len(run), dtype=np.int64)
            base += len(run)
        else:
            g = np.unique(g + 10**7 * len(keys))[:len(run)]
            k = k[:len(g)]
        order = np.lexsort((g, k))
        keys.append(k[order])
        gids.append(g[order])
    k, g = np.concatenate(keys), np.concatenate(gids)
    lengths = np.array([len(x) for x in keys])
    assert (merge_runs(k, g, lengths) == np.lexsort((g, k))).all()
    assert (_lex_order(k, g) == np.lexsort((g, k))).all()


def _digest(out: Path) -> tuple[str, dict]:
    h = hashlib.sha256()
    shards = sorted(out.glob("data/*.parquet"))
    assert shards
    for path in shards:
        h.update(path.name.encode() + path.read_bytes())
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest.pop("timings")
    for how in ("output", "token_transfer", "resume"):  # where and how it ran, not what it wrote
        manifest["config"].pop(how)
    return h.hexdigest(), manifest


@pytest.mark.parametrize("ranks, order, transfer, extra", [
    (2, "input", "read", {}),
    (3, "shuffle", "exchange", {"dp_size": 2, "micro_batches": 2}),
    (4, "curriculum", "auto", {"shard_rows": 200}),
])
def test_ranks_in_one_process_write_the_single_process_bytes(tmp_path, sample_data, contract, ranks, order,
                                                             transfer, extra):
    """The exchange (route_tokens), the direct reads and the join of shards shared by writers,
    run by in-process ranks: the same bytes as one process."""
    from support.contract import check_contract

    options = dict(inputs=[str(sample_data)], capacity=4096, too_long="split", order=order, window=700,
                   token_transfer=transfer, overwrite=True, **extra)
    pack(PackConfig(output=str(tmp_path / "one"), **options))
    results = run_ranks(ranks, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **options), comm=comm))
    assert _digest(tmp_path / "many") == _digest(tmp_path / "one")
    assert check_contract(contract, tmp_path / "many", [sample_data]) == []
    per_rank = results[0].metrics["ranks"]
    assert [r["token_transfer"] for r in per_rank] == [("read" if transfer == "read" else r["token_transfer"])
                                                       for r in per_rank]
    assert sum(r["packs_written"] for r in per_rank) == results[0].counts["packs"]
    scale = results[0].metrics["scale_out"]
    assert scale["ranks"] == ranks and scale["bytes_exchanged"] == sum(r["bytes_sent"] for r in per_rank)
    assert set(scale["stage_seconds"]) >= {"scan", "order", "plan", "assign", "materialize"}
    if transfer == "read":  # only plan arrays travel
        assert scale["bytes_exchanged"] < 100_000
    # shards of 1,024 packs hold several row groups, and a shard may be written by two ranks
    rows = [pq.ParquetFile(p).metadata for p in sorted((tmp_path / "many").glob("data/*.parquet"))]
    assert rows and all(m.num_row_groups == -(-m.num_rows // ROW_GROUP_PACKS) for m in rows)


def test_shared_shards_resume_after_an_interrupted_multi_rank_run(tmp_path, sample_data, monkeypatch):
    """A shard cut between two writers is joined by the first; a rerun with --resume after the
    run stopped before the join keeps the finished shards and writes the same bytes."""
    from packctl.pipeline import materialize

    options = dict(inputs=[str(sample_data)], capacity=2048, too_long="split", overwrite=True)
    pack(PackConfig(output=str(tmp_path / "one"), **options))
    reference = _digest(tmp_path / "one")

    class Stop(Exception):
        pass

    def stop(run, output):
        raise Stop()

    monkeypatch.setattr(materialize, "join_shared_shards", stop)
    with pytest.raises(Stop):
        run_ranks(2, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **options), comm=comm))
    monkeypatch.undo()
    partial = tmp_path / ".many.packctl-partial"
    assert any(p.name.startswith(".train-") for p in (partial / "data").iterdir())  # runs left for the join
    run_ranks(2, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), resume=True, **options), comm=comm))
    assert _digest(tmp_path / "many") == reference


# The cases of tests/mpi/test_mpi.py::test_same_bytes_for_any_number_of_ranks, on every rank count it
# names, run here by in-process ranks; mpiexec runs a few of the counts in processes of their own.
SPREAD = dict(too_long="split", window=300, shard_rows=40)
BALANCED = dict(dp_size=4, micro_batches=2, lr_scaling="sqrt")
ANY_RANKS = [
    (dict(order="input", algorithm="concat"), range(1, 9)),
    (dict(order="shuffle", algorithm="ffs"), range(1, 9)),
    (dict(order="curriculum", algorithm="bfd"), range(1, 9)),
    (dict(order="shuffle", algorithm="ffs", **BALANCED), (2, 3)),
    # one shard of several row groups, cut between writers and joined; tokens read, not exchanged
    (dict(order="input", algorithm="bfd", shard_rows=1024, token_transfer="read"), (2, 3)),
    # the stratified pack order and near ties of --order shuffle, packs and whole steps
    (dict(order="shuffle", algorithm="bfd"), (1, 2, 3)),
    (dict(order="shuffle", algorithm="bfd", **BALANCED), (2, 3)),
    (dict(order="curriculum", algorithm="ffd", pack_order="longest"), (2, 3)),
]


def _fingerprint(out: Path) -> tuple[list[str], dict]:
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest.pop("timings")
    return [s["sha256"] for s in manifest["shards"]], manifest


@pytest.mark.slow
@pytest.mark.parametrize("options, ranks", ANY_RANKS, ids=["input-concat", "shuffle-ffs", "curriculum-bfd",
                                                           "shuffle-ffs-balanced", "input-bfd-read",
                                                           "shuffle-bfd", "shuffle-bfd-balanced",
                                                           "curriculum-longest"])
def test_any_number_of_in_process_ranks_writes_the_single_process_bytes(tmp_path, sample_data, contract, options,
                                                                        ranks):
    from support.contract import check_contract

    out = tmp_path / "out"
    config = dict(inputs=[str(sample_data)], output=str(out), overwrite=True, **{**SPREAD, **options})
    pack(PackConfig(**config))
    reference = _fingerprint(out)
    assert len(reference[0]) > 4 or options.get("shard_rows")
    assert check_contract(contract, out, [sample_data]) == []
    for n in ranks:
        run_ranks(n, lambda comm: pack(PackConfig(**config), comm=comm))
        assert _fingerprint(out) == reference, f"{n} ranks"
        assert_ranks_shared_the_run(json.loads((out / "_metrics.json").read_text()), n, 2000)


@settings(max_examples=examples(200), deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=25), ranks=st.integers(1, 9),
       held=st.lists(st.integers(0, 400), max_size=8), epochs=st.integers(1, 3), data=st.data())
def test_windows_are_dealt_whole_in_order_by_their_sequences(sizes, ranks, held, epochs, data):
    """Whatever the windows' sizes and however the order is spread over the ranks: every window goes
    whole to one rank, in order, and no rank plans more than its equal share plus one window."""
    from packctl.pipeline.order import window_owners

    epoch = data.draw(st.integers(0, epochs - 1))
    window = np.repeat(np.arange(len(sizes)), sizes)
    opens = np.concatenate([[True] + [False] * (s - 1) for s in sizes])
    total = len(window)
    cuts = sorted({0, total, *(min(h, total) for h in held)})
    cuts = (cuts + [total] * ranks)[:ranks + 1] if len(cuts) < ranks + 1 else cuts[:ranks] + [total]
    parts = [(window[lo:hi], opens[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]
    owners = np.concatenate(run_ranks(ranks, lambda comm: window_owners(comm, *parts[comm.rank], epoch, epochs)))
    assert len(owners) == total and (np.diff(owners) >= 0).all() and (owners < ranks).all()
    assert all(len(set(owners[window == w].tolist())) == 1 for w in range(len(sizes)))
    # epoch e's sequences are the e-th of `epochs` equal runs of the axis dealt over the ranks
    share = total * epochs / ranks
    planned = np.bincount(owners, minlength=ranks)
    assert planned.max() <= share + max(sizes)
    if epochs == 1 and len(set(sizes)) == 1 and ranks <= len(sizes):  # equal windows: at most one window over
        assert planned.max() <= -(-len(sizes) // ranks) * sizes[0]


def test_a_short_last_window_goes_where_it_evens_the_work():
    from packctl.pipeline.order import window_owners

    window = np.repeat(np.arange(3), [4, 4, 2])
    opens = np.array([1, 0, 0, 0, 1, 0, 0, 0, 1, 0], dtype=bool)
    owners = run_ranks(2, lambda comm: window_owners(comm, window[comm.rank * 5:(comm.rank + 1) * 5],
                                                     opens[comm.rank * 5:(comm.rank + 1) * 5], 0, 1))
    assert np.concatenate(owners).tolist() == [0] * 4 + [1] * 6  # 4 and 6 sequences; by count 8 and 2


@pytest.mark.slow
@pytest.mark.parametrize("ranks, window, grouped", [(4, 1000, False), (5, 2000, False), (3, None, True),
                                                    (6, None, True)])
def test_more_ranks_than_windows_or_uneven_windows_write_the_single_process_bytes(tmp_path, sample_data, ranks,
                                                                                window, grouped):
    """4 ranks for 2 windows, 5 for 1 (ranks that plan nothing), and 7 windows of groups of uneven
    sizes over 3 and 6 ranks: the bytes of one process, and the planning share reported."""
    from support.data import write_table
    from support.runs import packed_on_ranks

    if grouped:  # 70 groups of 1 to 12 sequences, 10 groups a window: windows of 23 to 75 sequences
        rng = np.random.default_rng(5)
        sizes = rng.integers(1, 13, 70)
        group = np.repeat(np.arange(70), sizes)
        rows = [[int(t) for t in rng.integers(1, 1000, n)] for n in rng.integers(5, 300, len(group))]
        half = len(rows) // 2
        inputs = [write_table(tmp_path / f"g{k}.parquet", {"input_ids": rows[lo:hi], "g": group[lo:hi].tolist()})
                  for k, (lo, hi) in enumerate([(0, half), (half, len(rows))])]
        options = dict(inputs=[str(p) for p in inputs], group_column="g", capacity=8192, window=10,
                       order="shuffle", shard_rows=20)
    else:
        options = dict(inputs=[str(sample_data)], capacity=4096, too_long="split", window=window, shard_rows=100)
    many = packed_on_ranks(tmp_path, ranks, **options)
    metrics = json.loads((many / "_metrics.json").read_text())
    planned = [r["sequences_planned"] for r in metrics["ranks"]]
    assert sum(planned) == metrics["counts"]["sequences_in"] - metrics["counts"]["sequences_skipped_empty"]
    assert metrics["scale_out"]["sequences_planned"]["max"] == max(planned)
    if grouped:
        assert len(json.loads((many / "_manifest.json").read_text())["window_starts"]) == 7
    else:
        assert planned.count(0) == ranks - -(-2000 // window)  # ranks without a window plan nothing

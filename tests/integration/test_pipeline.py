"""End-to-end `pack` on sample_data, judged by the independent contract checker."""
from __future__ import annotations

import itertools
import json

import pyarrow.parquet as pq
import pytest

from support.contract import check_contract
from support.runs import pack_to
from packctl import PackConfig, PackctlError, pack
from packctl.config import ALGORITHMS, choices_of

ORDERS = choices_of("order")

LAYOUTS = [  # (cp_size, tp_size, pad_to)
    (cp, tp, pad_to) for cp, tp, pad_to in itertools.product((1, 2), (1, 2), ("capacity", "multiple"))
]
TOO_LONG = ["drop", "truncate", "split"]


def layouts_of(algorithm: str, order: str, too_long: str) -> list[tuple[int, int, str]]:
    """The layouts the case (algorithm, order, too_long) packs: the 8 layouts dealt out over the 3
    orders, layout i to the order of index (i + algorithm's index + too_long's index) % 3. Every
    triple of the four options (algorithm, order, too_long, layout) is packed, in 168 packs instead of
    the 504 of the full product:

        layouts_of("concat", "input", "drop") == [LAYOUTS[0], LAYOUTS[3], LAYOUTS[6]]
    """
    a, o, t = ALGORITHMS.index(algorithm), ORDERS.index(order), TOO_LONG.index(too_long)
    return [layout for i, layout in enumerate(LAYOUTS) if (i + a + t) % len(ORDERS) == o]


def test_the_cases_pack_every_triple_of_options():
    options = [ALGORITHMS, ORDERS, TOO_LONG, LAYOUTS]
    packed = [(a, o, t, layout) for a in ALGORITHMS for o in ORDERS for t in TOO_LONG for layout in layouts_of(a, o, t)]
    assert len(packed) == 168 and all(len(layouts_of(a, o, t)) >= 2 for a, o, t, _ in packed)
    for triple in itertools.combinations(range(4), 3):
        assert {tuple(case[k] for k in triple) for case in packed} == set(itertools.product(*(options[k] for k in triple)))


# The quick loop (-m "not slow") packs the cases of order shuffle: every algorithm with every policy.
CASES = [pytest.param(a, o, t, id=f"{a}-{o}-{t}", marks=[] if o == "shuffle" else [pytest.mark.slow])
         for a in ALGORITHMS for o in ORDERS for t in TOO_LONG]


@pytest.mark.parametrize("algorithm, order, too_long", CASES)
def test_every_combination_passes_the_contract(tmp_path, small_sample_data, contract, algorithm, order, too_long):
    """On sample_data cut to 206 rows (small_sample_data, 7 of them over 4096 tokens), window 70:
    three windows, as window 700 gives on the whole of sample_data."""
    for cp, tp, pad_to in layouts_of(algorithm, order, too_long):
        result, out = pack_to(tmp_path, [small_sample_data], capacity=4096, algorithm=algorithm, order=order,
                              too_long=too_long, cp_size=cp, tp_size=tp, pad_to=pad_to, window=70)
        errors = check_contract(contract, out, [small_sample_data])
        assert errors == [], (algorithm, order, too_long, cp, tp, pad_to, errors)
        manifest = json.loads((out / "_manifest.json").read_text())
        # lcm(2*cp if cp > 1, cp*tp with sequence parallelism (the default) and tp > 1)
        assert manifest["layout"]["align"] == {(1, 1): 1, (1, 2): 2, (2, 1): 4, (2, 2): 4}[cp, tp]
        counts = result.counts
        assert counts["sequences_in"] == 206
        over = 7  # every sequence of sample_data longer than 4096 is in small_sample_data
        assert counts["sequences_dropped"] == (over if too_long == "drop" else 0)
        assert counts["sequences_truncated"] == (over if too_long == "truncate" else 0)
        if too_long == "split" and algorithm != "split":
            assert counts["sequences_split"] == over


def test_too_long_error_names_file_row_and_fix(tmp_path, sample_data):
    with pytest.raises(PackctlError) as err:
        pack_to(tmp_path, [sample_data], capacity=4096)
    msg = str(err.value)
    lengths = [len(r) for r in pq.read_table(sample_data / "shard-00000.parquet").column("input_ids").to_pylist()]
    row = next(i for i, n in enumerate(lengths) if n > 4096)
    assert f"shard-00000.parquet row {row} column 'input_ids': sequence of {lengths[row]} tokens" in msg
    assert "--too-long" in msg
    assert not (tmp_path / "out").exists()


def _shard_hashes(out):
    return [s["sha256"] for s in json.loads((out / "_manifest.json").read_text())["shards"]]


@pytest.mark.parametrize("algorithm", ["ffs", "bfd"])
def test_output_bytes_are_deterministic(tmp_path, sample_data, algorithm):
    options = dict(capacity=2048, algorithm=algorithm, order="shuffle", seed=7, too_long="split", shard_rows=100)
    _, out = pack_to(tmp_path / "a", [sample_data], **options)
    _, out2 = pack_to(tmp_path / "b", [sample_data], **options)
    assert _shard_hashes(out) == _shard_hashes(out2)
    assert len(_shard_hashes(out)) > 1


def test_seed_changes_shuffle(tmp_path, sample_data):
    base = dict(capacity=4096, order="shuffle", too_long="drop")
    _, a = pack_to(tmp_path / "a", [sample_data], seed=1, **base)
    _, b = pack_to(tmp_path / "b", [sample_data], seed=2, **base)
    assert _shard_hashes(a) != _shard_hashes(b)


def _read(out, column):
    """One column of every pack, shards in manifest order."""
    shards = json.loads((out / "_manifest.json").read_text())["shards"]
    return [v for s in shards for v in pq.read_table(out / s["path"], columns=[column]).column(column).to_pylist()]


def test_curriculum_concat_packs_grow(tmp_path, sample_data):
    _, out = pack_to(tmp_path, [sample_data], capacity=4096, algorithm="concat", order="curriculum",
                     too_long="drop", window=500)
    lens = [l for row in _read(out, "seq_lens") for l in row]
    assert lens == sorted(lens)


def test_curriculum_windows_do_not_overlap(tmp_path, sample_data):
    _, out = pack_to(tmp_path, [sample_data], capacity=4096, algorithm="bfd", order="curriculum",
                     too_long="drop", window=500, shard_rows=10_000)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert len(manifest["shards"]) == 4  # one shard per window: shards never straddle windows
    ranges = []
    for shard in manifest["shards"]:
        lens = [l for row in pq.read_table(out / shard["path"]).column("seq_lens").to_pylist() for l in row]
        ranges.append((min(lens), max(lens)))
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi <= lo


def test_max_seqs_per_bin_and_pad_to_multiple(tmp_path, sample_data, contract):
    _, out = pack_to(tmp_path, [sample_data], capacity=4096, max_seqs_per_bin=3, pad_to="multiple",
                     pack_multiple=256, seq_multiple=8, too_long="truncate")
    assert max(len(r) for r in _read(out, "seq_lens")) <= 3
    assert all(len(r) % 256 == 0 for r in _read(out, "input_ids"))
    assert check_contract(contract, out, [sample_data]) == []


def test_no_labels_column_uses_tokens(tmp_path, sample_data, contract):
    src = tmp_path / "src"
    src.mkdir()
    for path in sorted(sample_data.glob("*.parquet"))[:2]:
        pq.write_table(pq.read_table(path, columns=["input_ids"]).rename_columns(["tokens"]), src / path.name)
    result, out = pack_to(tmp_path, [src], capacity=8192, tokens_column="tokens")
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["config"]["labels_column"] is None
    assert manifest["config"]["tokens_column"] == "tokens"
    first = pq.read_table(out / "data/train-00000.parquet").slice(0, 1).to_pylist()[0]
    n = first["seq_lens"][0]
    assert first["labels"][1:n] == first["input_ids"][1:n]
    assert first["labels"][0] == -100


def test_existing_output_is_refused_then_replaced(tmp_path, sample_data):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    cfg = dict(inputs=[str(sample_data)], output=str(out), too_long="drop")
    with pytest.raises(PackctlError, match="already exists; pass overwrite=True to replace it"):  # the API's words
        pack(PackConfig(**cfg))
    assert (out / "keep.txt").exists()
    pack(PackConfig(**cfg, overwrite=True))
    assert (out / "_manifest.json").exists() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left behind


def test_failed_run_leaves_previous_output_untouched(tmp_path, sample_data):
    _, out = pack_to(tmp_path, [sample_data], too_long="drop")
    before = _shard_hashes(out)
    with pytest.raises(PackctlError):
        pack_to(tmp_path, [sample_data], too_long="error")
    assert _shard_hashes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("algorithm", ["ffd", "bfd"])
def test_manifest_counts_and_metrics(tmp_path, sample_data, algorithm):
    result, out = pack_to(tmp_path, [sample_data], capacity=4096, too_long="split", algorithm=algorithm)
    manifest = json.loads((out / "_manifest.json").read_text())
    metrics = json.loads((out / "_metrics.json").read_text())
    c = manifest["counts"]
    assert c["tokens_packed"] == c["tokens_in"] == 1_170_955
    assert c["sequences_packed"] == 2000
    assert [i["rows"] for i in manifest["inputs"]] == [500, 500, 500, 500]
    assert sum(s["rows"] for s in manifest["shards"]) == metrics["packs"]
    assert metrics["tokens"] == sum(_read(out, "num_tokens"))
    assert metrics["packs"] <= 1.01 * metrics["lower_bound_packs"]
    meta = json.loads(pq.read_schema(out / manifest["shards"][0]["path"]).metadata[b"packctl"])
    assert meta["format_version"] == 2 and meta["config"]["algorithm"] == algorithm
    assert set(manifest["timings"]) >= {"scan", "order", "plan", "materialize", "report", "total"}


def test_shards_are_zstd_without_dictionaries(tmp_path, sample_data):
    """The storage settings of docs/performance.md: zstd, no dictionary pages, row groups of 128 packs."""
    _, out = pack_to(tmp_path, [sample_data], capacity=4096, too_long="split")
    for shard in sorted((out / "data").glob("*.parquet")):
        meta = pq.ParquetFile(shard).metadata
        assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)][:-1] == [128] * (meta.num_row_groups - 1)
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                column = meta.row_group(g).column(c)
                assert column.compression == "ZSTD", column.path_in_schema
                assert not column.has_dictionary_page, column.path_in_schema
                assert not any("DICTIONARY" in e for e in column.encodings), (column.path_in_schema, column.encodings)

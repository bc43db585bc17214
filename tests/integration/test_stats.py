"""`packctl stats`: every metric against a hand computation, what-if == pack, JSON == _metrics.json.

The fixture, worked by hand (capacity 16, --seq-multiple 2, --too-long split, concat, input order):

    lengths by sample id   [9, 9, 7, 20, 3, 6, 1]
    padded to 2            [10, 10, 8, 20, 4, 6, 2]; sample 3 is over 16: a full chunk of 16 tokens
                           and a last piece of 4 (padded 4) that concat packs with the others
    concat over [10, 10, 8, 4, 4, 6, 2]:  [10] [10] [8 4 4] [6 2]; the chunk goes right before the
                           pack that holds the last piece of its sample, so the packs are
    true lengths           [9] [9] [16] [7 4 3] [6 1]          sample ids [0] [1] [3] [2 3 4] [5 6]
"""
from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.adversary import packctl
from support.runs import pack_to
from support.data import write_table
from packctl import PackConfig, PackctlError
from packctl.config import ALGORITHMS
from packctl.contract.manifest import sha256_file
from packctl.plan.metrics import attention_cost, dp_balance, fill_histogram, length_summary, pack_loads
from packctl.stats import input_stats, packed_stats, read_lengths, stats

PLOT = importlib.util.find_spec("matplotlib") is not None

LENGTHS = [9, 9, 7, 20, 3, 6, 1]
TINY = dict(capacity=16, seq_multiple=2, too_long="split", algorithm="concat")
NOT_IN_STATS = ("throughput", "timings")  # run facts of a pack, not properties of the packing


def _tokens(lengths, start=1):
    return pa.array([list(range(start, start + n)) for n in lengths], pa.list_(pa.int32()))


@pytest.fixture(scope="module")
def tiny_input(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    # two files, so sample ids cross a file boundary: a.parquet holds samples 0-3, b.parquet 4-6
    write_table(root / "in" / "a.parquet", {"input_ids": _tokens(LENGTHS[:4])})
    write_table(root / "in" / "b.parquet", {"input_ids": _tokens(LENGTHS[4:])})
    return root / "in"


@pytest.fixture(scope="module")
def tiny_output(tiny_input, tmp_path_factory) -> Path:
    _, out = pack_to(tmp_path_factory.mktemp("tiny_out"), [tiny_input], **TINY)
    return out


@pytest.fixture(scope="module")
def sample_output(sample_data, tmp_path_factory) -> Path:
    _, out = pack_to(tmp_path_factory.mktemp("sample_out"), [sample_data], too_long="split")
    return out


# --- a packed output, by hand ----------------------------------------------------------------------

def test_packed_stats_by_hand(tiny_output):
    r = packed_stats(tiny_output)
    loads = [9, 9, 16, 14, 7]  # true tokens per pack
    assert r["kind"] == "packed" and r["algorithm"] == "concat" and r["order"] == "input"
    assert r["packs"] == 5 and r["sequences"] == 8 and r["tokens"] == 55 and r["capacity"] == 16
    assert r["utilization"] == pytest.approx(55 / 80)
    assert r["waste_ratio"] == pytest.approx(25 / 80)
    fills = [x / 16 for x in loads]
    assert r["bin_balance"] == pytest.approx(1 - statistics.pstdev(fills) / (55 / 80))
    # padded lengths [10] [10] [16] [8 4 4] [6 2] sum to 60: ceil(60/16) = 4 packs would do
    assert r["lower_bound_packs"] == 4
    assert r["packing_efficiency"] == pytest.approx(4 / 5)
    # L2 >= ceil = 4, and 4 packs exist: [16] [10 6] [10 4 2] [8 4]
    assert r["lower_bound_packs_l2"] == 4
    assert r["padding"] == {"alignment_tokens": 5,  # 9->10 twice, 7->8, 3->4, 1->2
                            "tail_tokens": 80 - 60, "written_tokens": 80,
                            "fraction_of_written": pytest.approx(25 / 80)}
    assert r["sequences_per_pack"] == {"min": 1, "mean": pytest.approx(8 / 5), "max": 3, "histogram": [0, 3, 1, 1]}
    # true lengths [9, 9, 16, 7, 4, 3, 6, 1] in [1,2) [2,4) [4,8) [8,16) [16,32)
    assert r["length_histogram"] == {"edges": [1, 2, 4, 8, 16, 32], "counts": [1, 1, 3, 2, 1],
                                   "tokens": [1, 3, 17, 18, 16]}
    # padded batching: pieces in sample-id order [9, 9, 7, 16, 4, 3, 6, 1], batches of round(1.6) = 2
    # -> 2*9 + 2*16 + 2*4 + 2*6 = 70 tokens against the 80 written
    assert r["padded_batching"] == {"batch_size": 2, "tokens": 70, "packed_tokens": 80,
                                    "estimated_gain": pytest.approx(70 / 80)}
    # fills .5625 .5625 1.0 .875 .4375 -> [0.4, 0.5): 1, [0.5, 0.6): 2, [0.8, 0.9): 1, [0.99, 1]: 1
    assert r["fill_histogram"]["counts"] == [0, 0, 0, 0, 1, 2, 0, 0, 1, 0, 0, 1]
    # sorted lengths [1, 3, 4, 6, 7, 9, 9, 16]: p50 is the 4th (4 of 8 <= 6), p90 the 8th
    assert r["lengths"] == {"min": 1, "mean": pytest.approx(55 / 8), "max": 16,
                            "percentiles": {"p10": 1, "p50": 6, "p90": 16, "p99": 16, "p99.9": 16}}
    assert r["counts"]["sequences_split"] == 1 and r["counts"]["sequences_dropped"] == 0
    assert r["counts"]["sequences_truncated"] == 0 and r["counts"]["pieces"] == 8
    assert r["dp_balance"] is None


def test_packed_stats_agree_with_metrics_json(tiny_output):
    metrics = json.loads((tiny_output / "_metrics.json").read_text())
    r = packed_stats(tiny_output)
    for key, value in metrics.items():
        if key not in NOT_IN_STATS:
            assert r[key] == value, key


def test_stats_json_on_sample_output_agrees_with_metrics_json(sample_output):
    proc = packctl("stats", str(sample_output), "--json")
    assert proc.code == 0, proc.stderr
    report = json.loads(proc.stdout)
    metrics = json.loads((sample_output / "_metrics.json").read_text())
    assert {k for k in metrics if k not in NOT_IN_STATS} <= report.keys()
    for key in metrics:
        if key not in NOT_IN_STATS:
            assert report[key] == metrics[key], key
    assert report["counts"]["sequences_split"] == 7  # sample_data/README.md: 7 over 4096


def _with_balance(out: Path, step, dp_rank, micro_batch) -> Path:
    """Balance columns added to the only shard, and its sha256 recorded, as a packer writing them would."""
    shard = out / "data/train-00000.parquet"
    table = pq.read_table(shard)
    for name, values in (("step", step), ("dp_rank", dp_rank), ("micro_batch", micro_batch)):
        table = table.append_column(name, pa.array(values, pa.int32()))
    pq.write_table(table, shard)
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest["shards"][0]["sha256"] = sha256_file(shard)
    (out / "_manifest.json").write_text(json.dumps(manifest))
    return out


def test_dp_balance_by_hand(tiny_input, tmp_path):
    _, out = pack_to(tmp_path, [tiny_input], **TINY)
    # packs [9] [9] [16] [7 4 3] [6 1]: step 0 = ranks 0, 1; step 1 = ranks 0, 1; step 2 = rank 0 only
    _with_balance(out, step=[0, 0, 1, 1, 2], dp_rank=[0, 1, 0, 1, 0], micro_batch=[0, 0, 0, 0, 0])
    dp = packed_stats(out, attn_coeff=2.0)["dp_balance"]
    assert dp["steps"] == 3 and dp["dp_size"] == 2 and dp["micro_batches"] == 1 and dp["attn_coeff"] == 2.0
    tokens = [9 / 9, 16 / 15, 7 / 3.5]
    assert dp["per_step"]["tokens"] == pytest.approx(tokens)
    assert dp["tokens"] == {"mean": pytest.approx(sum(tokens) / 3), "max": 2.0, "worst_step": 2}
    cost = lambda L: 2 * L + L * L  # noqa: E731
    packs = [cost(9), cost(9), cost(16), cost(7) + cost(4) + cost(3), cost(6) + cost(1)]
    attention = [packs[0] / ((packs[0] + packs[1]) / 2), packs[2] / ((packs[2] + packs[3]) / 2), 2.0]
    assert dp["per_step"]["attention"] == pytest.approx(attention)
    assert dp["attention"]["max"] == pytest.approx(2.0) and dp["attention"]["worst_step"] == 2
    assert dp["per_step"]["step"] == [0, 1, 2]


# --- the what-if on raw input -------------------------------------------------------------------

def test_what_if_by_hand(tiny_input):
    r = input_stats([str(tiny_input)], [16], PackConfig(seq_multiple=2, too_long="split"))
    rows = {row["algorithm"]: row for row in r["what_if"]}
    assert list(rows) == list(ALGORITHMS)
    assert r["sequences"] == 7 and r["tokens"] == 55
    assert r["capacities"][0]["sequences_over_capacity"] == 1
    # concat as drawn in the module docstring
    assert rows["concat"]["packs"] == 5
    # first fit decreasing over [10, 10, 8, 6, 4, 4, 2]: [10 6] [10 4 2] [8 4], plus the chunk of 16
    for name in ("ffd", "bfd", "mffd"):
        assert rows[name]["packs"] == 4, name
        assert rows[name]["packing_efficiency"] == pytest.approx(1.0)
        assert rows[name]["utilization"] == pytest.approx(55 / 64)
    # split cuts at 16 (at even offsets) over [10, 10, 8, 20, 4, 6, 2]:
    # [10 6'] [4' 8 4'] [16'] [4 6 2]: samples 1 and 3 cut, 4 packs
    assert rows["split"]["packs"] == 4 and rows["split"]["counts"]["sequences_split"] == 2
    # ffd, bfd and mffd tie; bfd is pack's default, so it is the one recommended
    assert r["best"] == {"capacity": 16, "algorithm": "bfd"}
    assert r["recommendation"].startswith("bfd at --capacity 16: 85.94% utilization, 4 packs (at the lower bound 4)")
    pb = r["capacities"][0]["padded_batching"]
    # bfd's pieces in sample-id order [9, 9, 7, 16, 4, 3, 6, 1], 8 pieces in 4 packs -> batches of 2
    assert pb == {"batch_size": 2, "batches": 4, "tokens": 70, "padding_tokens": 15,
                  "utilization": pytest.approx(55 / 70), "estimated_gain": pytest.approx(70 / 64)}
    assert r["lengths"]["max"] == 20 and r["lengths"]["percentiles"]["p50"] == 7


def test_what_if_with_too_long_error_reports_instead_of_stopping(tiny_input):
    """The default --too-long error: pack would stop at sample 3 (20 tokens > 16); the what-if says
    where, plans that capacity's rows with split (the same rows as --too-long split gives), and
    leaves a capacity with nothing over it planned as asked."""
    r = input_stats([str(tiny_input)], [16, 32], PackConfig(seq_multiple=2))
    split = input_stats([str(tiny_input)], [16], PackConfig(seq_multiple=2, too_long="split"))
    at16, at32 = r["capacities"]
    assert at16["pack_stops_at"].endswith("a.parquet row 3 column 'input_ids'")
    assert at16["too_long"] == "split" and at16["over_capacity"]["pieces_added"]["split"] == 1
    assert at32["pack_stops_at"] is None and at32["too_long"] == "error"
    rows16 = [row for row in r["what_if"] if row["capacity"] == 16]
    for got, want in zip(rows16, split["what_if"]):
        assert (got["algorithm"], got["packs"], got["counts"]) == (want["algorithm"], want["packs"], want["counts"])
    # the split rows' extra pieces are the over-long sequence's: ceil(20 / 16) - 1
    assert rows16[0]["counts"]["pieces"] - r["sequences"] == 1
    # the best capacity is 32 (nothing cut, nothing stops); asking for 16 alone says what to pass
    only16 = input_stats([str(tiny_input)], [16], PackConfig(seq_multiple=2))
    assert "pass --too-long split (with --too-long error pack stops at" in only16["recommendation"]
    assert "--too-long" not in r["recommendation"]


def test_stats_cli_what_if_on_over_long_input_exits_0(tiny_input):
    proc = packctl("stats", str(tiny_input), "--capacity", "16", "--seq-multiple", "2", "--json")
    assert proc.code == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["capacities"][0]["pack_stops_at"] is not None


def test_what_if_shows_the_tokens_of_over_long_sequences_and_what_each_policy_does(tiny_input):
    r = input_stats([str(tiny_input)], [16, 32], PackConfig(seq_multiple=2, too_long="split"))
    over16, over32 = (c["over_capacity"] for c in r["capacities"])
    # one sequence of 20 tokens over 16: 20 of the 55 tokens; drop loses 20, truncate the 4 past 16
    assert over16 == {"sequences": 1, "tokens": 20, "token_share": pytest.approx(20 / 55),
                      "tokens_lost": {"error": 0, "drop": 20, "truncate": 4, "split": 0},
                      "pieces_added": {"error": 0, "drop": 0, "truncate": 0, "split": 1}}
    assert over32["sequences"] == 0 and over32["token_share"] == 0.0
    # lengths [9, 9, 7, 20, 3, 6, 1] by power-of-two bucket, counted and weighted by tokens
    hist = r["length_histogram"]
    assert hist["counts"] == [1, 1, 2, 2, 1] and hist["tokens"] == [1, 3, 13, 18, 20]
    text = "".join(str(x) for x in stats_renderables_text(r))
    assert "36.4% of the tokens" in text and "of tokens" in text


def stats_renderables_text(report):
    from rich.console import Console

    console = Console(record=True, width=200)
    for renderable in __import__("packctl.cli.render", fromlist=["stats_renderables"]).stats_renderables(report):
        console.print(renderable)
    return [console.export_text()]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_what_if_predicts_pack_on_the_tiny_input(tiny_input, tmp_path, algorithm):
    options = dict(TINY, algorithm=algorithm)
    result, out = pack_to(tmp_path, [tiny_input], **options)
    r = input_stats([str(tiny_input)], [16], PackConfig(seq_multiple=2, too_long="split"), algorithms=[algorithm])
    (row,) = r["what_if"]
    metrics = json.loads((out / "_metrics.json").read_text())
    for key, value in metrics.items():
        if key not in NOT_IN_STATS:
            assert row[key] == value, key
    assert row["packs"] == json.loads((out / "_manifest.json").read_text())["counts"]["packs"]


SETTINGS = [
    dict(capacity=2048, too_long="drop", order="shuffle", seed=3, cp_size=2, window=700),
    dict(capacity=4096, too_long="truncate", order="curriculum", curriculum_order="desc", tp_size=2,
         pad_to="multiple", max_seqs_per_bin=5, window=900),
    # --shape-buckets rounds pack lengths up to K chosen lengths: the what-if must round them too
    dict(capacity=4096, too_long="split", pad_to="multiple", pack_multiple=256, shape_buckets=3, window=700),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["drop-shuffle-cp2", "truncate-curriculum-multiple",
                                                    "shape-buckets"])
def test_what_if_predicts_pack_on_sample_data(sample_data, tmp_path, settings):
    planning = {k: v for k, v in settings.items() if k != "capacity"}
    r = input_stats([str(sample_data)], [settings["capacity"]], PackConfig(**planning))
    for algorithm in ("concat", "bfd", "ffs", "split"):
        _, out = pack_to(tmp_path / algorithm, [sample_data], algorithm=algorithm, **settings)
        manifest = json.loads((out / "_manifest.json").read_text())
        metrics = json.loads((out / "_metrics.json").read_text())
        row = next(w for w in r["what_if"] if w["algorithm"] == algorithm)
        assert row["packs"] == manifest["counts"]["packs"] == sum(s["rows"] for s in manifest["shards"])
        assert row["counts"] == manifest["counts"]
        for key, value in metrics.items():
            if key not in NOT_IN_STATS:
                assert row[key] == value, (algorithm, key)


def test_several_capacities(sample_data):
    r = stats([str(sample_data)], capacities=[2048, 4096], too_long="split")
    assert [c["capacity"] for c in r["capacities"]] == [2048, 4096]
    assert [(w["capacity"], w["algorithm"]) for w in r["what_if"]] == [
        (c, a) for c in (2048, 4096) for a in ALGORITHMS]
    assert r["capacities"][0]["sequences_over_capacity"] == 63 and r["capacities"][1]["sequences_over_capacity"] == 7
    # split fills as well or better, but cuts sequences: the recommendation keeps them whole and says so
    assert r["best"]["algorithm"] != "split"
    assert r["settings"]["too_long"] == "split" and r["settings"]["align"] == 1
    assert set(r["stats_seconds"]) == {"read_lengths", "load_kernels", "plan", "metrics", "total"}
    # dropping loses tokens: the capacity that drops fewer wins, and the line says what is lost
    r = stats([str(sample_data)], capacities=[2048, 4096], too_long="drop")
    assert r["best"]["capacity"] == 4096
    assert "drops 7 over-long sequences" in r["recommendation"]


def test_config_file_values_feed_the_what_if(tiny_input, tmp_path):
    config = tmp_path / "pack.toml"
    config.write_text(f'inputs = ["{tiny_input}"]\ncapacity = 16\nseq-multiple = 2\ntoo-long = "split"\n')
    proc = packctl("stats", "--config", str(config), "--json", "--order", "curriculum")
    assert proc.code == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["kind"] == "input" and [c["capacity"] for c in r["capacities"]] == [16]
    assert r["settings"]["align"] == 2 and r["settings"]["order"] == "curriculum"  # the flag wins over the file


def test_read_lengths_uses_file_order_and_matches_pyarrow(sample_data):
    index = read_lengths([str(sample_data)])
    files = sorted(sample_data.glob("*.parquet"))
    expected = np.concatenate([np.diff(np.asarray(pq.read_table(f).column("input_ids").combine_chunks().offsets))
                               for f in files])
    assert index.lengths.tolist() == expected.tolist()
    assert [Path(f.path).name for f in index.files] == [f.name for f in files]
    assert index.describe(500) == f"{files[1]} row 0 column 'input_ids'"  # 500 rows per shard


# --- metric functions -----------------------------------------------------------------------------

def test_metric_helpers_by_hand():
    assert pack_loads(np.array([3, 2, 5]), np.array([0, 2, 3])).tolist() == [5, 5]
    assert pack_loads(np.array([1.5, 2.0]), np.array([0, 0, 2])).tolist() == [0.0, 3.5]
    assert attention_cost(np.array([3, 4]), 10.0).tolist() == [39.0, 56.0]
    # 3/10 and 99/100 are exact bucket edges; a full pack goes to the last bucket
    h = fill_histogram(np.array([3, 10, 0, 9]), 10)
    assert h["edges"][-4:] == [0.9, 0.95, 0.99, 1.0]
    assert h["counts"] == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1]
    assert fill_histogram(np.array([99, 98, 95]), 100)["counts"][-3:] == [0, 2, 1]
    s = length_summary(np.array([1, 2, 3, 4, 100]))
    assert s["percentiles"]["p50"] == 3 and s["percentiles"]["p90"] == 100 and s["percentiles"]["p10"] == 1
    assert s["min"] == 1 and s["max"] == 100 and s["mean"] == pytest.approx(22.0)


def test_dp_balance_counts_a_rank_without_packs_as_zero():
    # step 5: rank 0 has 4 tokens, rank 2 has 8, rank 1 none -> max 8 / mean 4 = 2
    dp = dp_balance(np.array([5, 5]), np.array([0, 2]), np.array([4, 8]), np.array([16.0, 64.0]), attn_coeff=0.0)
    assert dp["dp_size"] == 3 and dp["tokens"]["max"] == pytest.approx(2.0)
    assert dp["attention"]["max"] == pytest.approx(64 / (80 / 3)) and dp["micro_batches"] is None


# --- several outputs, terminal, plot ------------------------------------------------------------

def test_two_outputs_side_by_side(tiny_input, tiny_output, tmp_path):
    _, other = pack_to(tmp_path, [tiny_input], **dict(TINY, algorithm="ffd"))
    r = stats([str(tiny_output), str(other)])
    assert r["kind"] == "compare"
    assert [o["packs"] for o in r["outputs"]] == [5, 4]
    assert [o["algorithm"] for o in r["outputs"]] == ["concat", "ffd"]


@pytest.mark.slow  # matplotlib: the report alone is checked quickly by the tests around it
def test_terminal_report_and_plot(tiny_input, tiny_output, tmp_path):
    from rich.console import Console

    from packctl.cli.render import bar, stats_renderables
    from packctl.stats.plot import write_plot

    assert bar(3, 4, 4) == "███" and bar(1, 16, 2) == "▏" and bar(9, 16, 2) == "█▏" and bar(0, 4) == ""
    reports = {
        "packed": stats([str(tiny_output)]),
        "compare": stats([str(tiny_output), str(tiny_output)]),
        "input": stats([str(tiny_input)], capacities=[16, 32], seq_multiple=2, too_long="split"),
    }
    texts = {}
    for kind, report in reports.items():
        console = Console(record=True, width=120)
        for renderable in stats_renderables(report):
            console.print(renderable)
        texts[kind] = console.export_text()
        assert "█" in texts[kind], kind
        if PLOT:  # the plot extra (matplotlib)
            png = write_plot(report, tmp_path / f"{kind}.png")
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 300_000, kind
    assert "Martello-Toth L2 4" in texts["packed"] and "[99%, 100%]" in texts["packed"]
    assert texts["compare"].count("algorithm / order") == 1 and texts["compare"].count("concat / input") == 2
    assert "padded b=2" in texts["input"] and "recommended: bfd at --capacity 32" in texts["input"]
    assert "bfd ★" in texts["input"]


# --- bad input: exit code 2, one line naming the file and the fix ----------------------------------

def _bad(paths, **options) -> str:
    with pytest.raises(PackctlError) as err:
        stats([str(p) for p in paths], **options)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_input(tiny_input, tiny_output, tmp_path):
    assert "nothing-here: no such file or directory" in _bad([tmp_path / "nothing-here"])
    assert "not a packed output" in _bad([tiny_output, tiny_input])
    assert "--capacity only apply to raw input" in _bad([tiny_output], capacities=[8])
    # --attn-coeff is pack's planning option for raw input (the cost balanced with --dp-size)
    assert stats([str(tiny_input)], capacities=[16], attn_coeff=1.0, too_long="split")["settings"]["attn_coeff"] == 1.0
    assert "--capacity 15 is not a multiple of the alignment 2" in _bad([tiny_input], capacities=[15], seq_multiple=2)


def test_cli_exit_code_2_with_one_line(tiny_input):
    proc = packctl("stats", str(tiny_input), "--capacity", "15", "--seq-multiple", "2")
    assert proc.code == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and "--capacity 15 is not a multiple of the alignment 2" in \
        " ".join(proc.stderr.split())


def test_damaged_outputs(tiny_input, tmp_path):
    _, out = pack_to(tmp_path / "a", [tiny_input], **TINY)
    (out / "data/train-00000.parquet").unlink()
    with pytest.raises(PackctlError, match="data/train-00000.parquet: listed in .*manifest.json but missing"):
        packed_stats(out)
    _, out = pack_to(tmp_path / "b", [tiny_input], **TINY)
    (out / "_manifest.json").unlink()
    with pytest.raises(PackctlError, match="without _manifest.json"):
        stats([str(out)])
    _, out = pack_to(tmp_path / "c", [tiny_input], **TINY)
    table = pq.read_table(out / "data/train-00000.parquet")
    table = table.set_column(table.schema.get_field_index("num_tokens"), "num_tokens",
                             pa.array([9, 9, 16, 14, 8], pa.int32()))
    pq.write_table(table, out / "data/train-00000.parquet")
    with pytest.raises(PackctlError, match="data/train-00000.parquet: sha256 differs from the manifest's"):
        packed_stats(out)
    with pytest.raises(PackctlError, match="data/train-00000.parquet row 4: num_tokens 8 but seq_lens sum to 7"):
        packed_stats(out, verify=False)  # read unchecked, the shard's own rules still hold it


def test_null_and_empty_rows_are_refused(tmp_path):
    f = write_table(tmp_path / "n" / "a.parquet", {"input_ids": pa.array([[1, 2], None], pa.list_(pa.int32()))})
    with pytest.raises(PackctlError, match=r"a.parquet row 1 column 'input_ids': null instead of a list"):
        read_lengths([str(f)])
    f = write_table(tmp_path / "e" / "a.parquet", {"input_ids": pa.array([[1, 2], []], pa.list_(pa.int32()))})
    with pytest.raises(PackctlError, match=r"a.parquet row 1 column 'input_ids': empty sequence"):
        read_lengths([str(f)])
    f = write_table(tmp_path / "t" / "a.parquet", {"tokens": pa.array([[1, 2]], pa.list_(pa.int32()))})
    with pytest.raises(PackctlError, match="no column 'input_ids'"):
        read_lengths([str(f)])
    assert math.isclose(read_lengths([str(f)], "tokens").lengths.sum(), 2)


# What pack plans beyond the algorithm: steps balanced over data-parallel ranks, padded
# micro-batches, groups within optimizer steps, empty rows left out. The what-if plans them as pack
# does (`plan_stage` on one rank), so each row equals pack's _metrics.json, `balance` and `batching`
# included.
PLANNING_SETTINGS = [
    dict(capacity=4096, too_long="split", dp_size=4, micro_batches=2, balance="attention", order="curriculum",
         lr_scaling="sqrt", window=900),
    dict(capacity=4096, too_long="split", dp_size=3, step_tokens=20000, balance="tokens", balance_scope="packs",
         step_grouping="order", equal_counts=False, order="shuffle", seed=5),
    dict(capacity=4096, too_long="truncate", mode="batch", max_tokens=16384, seq_round=64, shape_buckets=4,
         dp_size=2, micro_batches=2, warmup_shapes=True),
]


@pytest.mark.parametrize("settings", PLANNING_SETTINGS, ids=["dp-curriculum-lr", "step-tokens-packs", "batch-buckets"])
def test_what_if_predicts_pack_with_balancing_and_batches(sample_data, tmp_path, settings):
    planning = {k: v for k, v in settings.items() if k != "capacity"}
    algorithm = "bfd" if settings.get("mode") == "batch" else "ffd"
    r = stats([str(sample_data)], capacities=[settings["capacity"]], algorithm=algorithm, **planning)
    (row,) = r["what_if"]  # --algorithm given: that algorithm alone
    assert row["algorithm"] == algorithm
    _, out = pack_to(tmp_path, [sample_data], algorithm=algorithm, **settings)
    metrics = json.loads((out / "_metrics.json").read_text())
    assert ("balance" in metrics) and ("batching" in metrics) == (settings.get("mode") == "batch")
    for key, value in metrics.items():
        if key not in NOT_IN_STATS:
            assert row[key] == value, key


def test_what_if_keeps_groups_within_steps_and_leaves_empty_rows_out(tmp_path):
    from packctl.sample import SampleSpec, write_sample

    corpus = tmp_path / "rollouts"
    write_sample(corpus, SampleSpec(sequences=600, distribution="lognormal", shards=2, seed=4, max_length=1500,
                                    groups="rollout", group_size=4))
    settings = dict(capacity=2048, group_column="group_id", group_scope="step", dp_size=2, micro_batches=2,
                    order="shuffle", window=300)
    r = stats([str(corpus)], capacities=[2048], algorithm="bfd", **{k: v for k, v in settings.items()
                                                                     if k != "capacity"})
    (row,) = r["what_if"]
    _, out = pack_to(tmp_path, [corpus], algorithm="bfd", **settings)
    metrics = json.loads((out / "_metrics.json").read_text())
    assert row["groups"]["scope"] == "step" and row["groups"] == metrics["groups"]
    assert row["balance"] == metrics["balance"] and row["packs"] == metrics["packs"]

    empty = write_table(tmp_path / "gaps" / "a.parquet", {"input_ids": pa.array(
        [[1, 2, 3], [], [4, 5], [], [6]], pa.list_(pa.int32()))})
    refused = packctl("stats", empty, "--capacity", "8")
    assert refused.code == 2 and "--skip-empty" in refused.stderr
    r = stats([str(empty)], capacities=[8], skip_empty=True, algorithm="bfd")
    _, out = pack_to(tmp_path / "gaps-out", [empty], capacity=8, skip_empty=True)
    metrics = json.loads((out / "_metrics.json").read_text())
    assert r["what_if"][0]["counts"] == metrics["counts"] and metrics["counts"]["sequences_skipped_empty"] == 2


def test_stats_takes_every_planning_option_of_pack():
    """The stats command's options are generated from the same declarations as pack's: every
    PackConfig field declared `planning=True` is a flag of both, with the same help."""
    import inspect

    from packctl.cli.pack import pack_command
    from packctl.cli.stats import stats_command
    from packctl.config import FIELDS, PLANNING_OPTIONS

    def flags(command) -> dict[str, str]:
        return {name: param.default.help for name, param in inspect.signature(command).parameters.items()
                if hasattr(param.default, "help") and name in FIELDS}

    pack_flags, stats_flags = flags(pack_command), flags(stats_command)
    assert "repeat it" in stats_flags.pop("capacity")  # stats' own --capacity compares several
    assert set(PLANNING_OPTIONS) == set(stats_flags), set(PLANNING_OPTIONS) ^ set(stats_flags)
    assert {"dp_size", "micro_batches", "mode", "shape_buckets", "warmup_shapes", "skip_empty",
            "group_scope", "algorithm"} <= set(PLANNING_OPTIONS)
    assert all(stats_flags[name] == pack_flags[name] for name in PLANNING_OPTIONS)
    # what pack writes, not what it plans, is not a stats option
    assert not {"output", "shard_rows", "memory_budget", "resume", "token_transfer", "keep_columns"} & set(stats_flags)


# --- order quality and epochs ------------------------------------------------------------------------

def _longest_by_pack(out: Path) -> np.ndarray:
    lens = [p for f in sorted((out / "data").glob("*.parquet")) for p in pq.read_table(f, columns=["seq_lens"])
            .column("seq_lens").to_pylist()]
    return np.array([max(p) for p in lens])


@pytest.mark.parametrize("pack_order, sign", [("longest", 1), ("planner", -1), ("shuffle", 0)])
def test_stats_reports_the_order_of_packs_window_by_window(sample_data, tmp_path, pack_order, sign):
    """bfd opens packs longest first (rho near -1), --pack-order longest ascends (near +1), the
    stratified shuffle stays within 0.05 in every window the manifest records."""
    _, out = pack_to(tmp_path, [sample_data], too_long="split", order="shuffle", window=700, shard_rows=40,
                     pack_order=pack_order)
    q = packed_stats(out)["pack_order"]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert q["windows_recorded"] and q["windows"] == len(manifest["window_starts"]) == 3
    assert q["tiny_windows"] == 0
    rhos = np.array(q["spearman_by_window"])
    if sign:
        # overall a sawtooth over three windows: weaker than within each, which is why windows count
        assert (sign * rhos > 0.8).all() and sign * q["spearman_overall"] > 0.2
        assert q["windows_over_bound"] == 3
    else:
        assert q["worst_abs_spearman"] <= 0.05 and q["windows_over_bound"] == 0
    # the figure is the rank correlation of the packs as written: recomputed here from the shards
    longest = _longest_by_pack(out).tolist()
    ordered = sorted(longest)
    rank = {v: statistics.mean(i for i, w in enumerate(ordered) if w == v) for v in set(longest)}  # ties: mean rank
    ranks = [rank[v] for v in longest]
    assert q["spearman_overall"] == pytest.approx(statistics.correlation(list(range(len(ranks))), ranks), abs=1e-9)
    proc = packctl("stats", str(out))
    assert proc.code == 0 and "Spearman(position, longest sequence)" in proc.stdout


def test_stats_of_an_output_without_recorded_windows_counts_it_as_one(tiny_output, tmp_path):
    import shutil

    copy = tmp_path / "old"
    shutil.copytree(tiny_output, copy)
    manifest = json.loads((copy / "_manifest.json").read_text())
    manifest.pop("window_starts", None)
    (copy / "_manifest.json").write_text(json.dumps(manifest))
    q = packed_stats(copy)["pack_order"]
    assert not q["windows_recorded"] and q["windows"] == 1 and q["tiny_windows"] == 1
    assert q["worst_abs_spearman"] is None
    assert "windows not recorded" in packctl("stats", str(copy)).stdout


def test_stats_of_several_epochs_summarises_each_and_their_overlap(sample_data, tmp_path):
    _, out = pack_to(tmp_path, [sample_data], too_long="split", order="shuffle", epochs=3, algorithm="ffs")
    proc = packctl("stats", str(out), "--json")
    assert proc.code == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kind"] == "epochs" and len(report["epochs"]) == len(report["overlap"]) == 3
    for e, (r, o) in enumerate(zip(report["epochs"], report["overlap"])):
        assert o["epoch"] == e and o["packs"] == r["packs"]
        assert r["pack_order"]["worst_abs_spearman"] <= 0.05
    # by hand: packs of epoch e whose sample-id set is one of epoch 0's
    def sets(e):
        folder = out / f"epoch-{e:05d}" / "data"
        return [frozenset(p) for f in sorted(folder.glob("*.parquet"))
                for p in pq.read_table(f, columns=["sample_ids"]).column("sample_ids").to_pylist()]
    first = set(sets(0))
    for e in (1, 2):
        packs = sets(e)
        same = sum(p in first for p in packs) / len(packs)
        multi = sum(p in first and len(p) > 1 for p in packs) / len(packs)
        assert report["overlap"][e]["same_as_epoch_0"] == pytest.approx(same)
        assert report["overlap"][e]["same_as_epoch_0_two_or_more"] == pytest.approx(multi) and multi <= 0.05
    assert report["overlap"][0]["same_as_epoch_0"] == 1.0
    table = packctl("stats", str(out))
    assert table.code == 0 and "epochs" in table.stdout and "same" in table.stdout


def test_stats_flags_no_window_of_shuffled_steps(sample_data, tmp_path):
    """`pack sample_data --order shuffle --epochs 3 --dp-size 4 --micro-batches 2 --too-long split`:
    steps are what the shuffle orders, and every epoch's packs stay within 0.05 (steps keyed by
    their longest sequence alone put the third epoch at -0.118, flagged); a window is counted by
    its steps, and one of fewer than 20 steps is counted apart (`tiny_windows`, "under 20
    steps")."""
    from packctl.cli.render import _order_line

    _, out = pack_to(tmp_path, [sample_data], too_long="split", order="shuffle", epochs=3, dp_size=4, micro_batches=2)
    report = stats([str(out)])
    for epoch in report["epochs"]:
        q = epoch["pack_order"]
        assert q["window_unit"] == "steps" and q["tiny_windows"] == 0
        assert q["windows_over_bound"] == 0 and abs(q["spearman_overall"]) <= 0.05, q["spearman_overall"]
    _, small = pack_to(tmp_path / "small", [sample_data], too_long="split", order="shuffle", dp_size=4,
                       micro_batches=2, window=500)  # 4 windows of about 9 steps
    q = packed_stats(small)["pack_order"]
    assert q["windows"] == 4 and q["tiny_windows"] == 4 and q["worst_abs_spearman"] is None
    assert "4 window(s) under 20 steps" in _order_line(q)

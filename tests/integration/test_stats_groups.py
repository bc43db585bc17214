"""`packctl stats INPUT --group-column C`: the what-if plans whole groups exactly as
`packctl pack --group-column C` packs them (same packs, same _metrics.json), says what keeping
groups whole costs, and refuses what pack refuses with groups."""
from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pytest

from support.adversary import packctl
from support.runs import pack_to
from support.data import write_table
from packctl import PackConfig, PackctlError
from packctl.sample import SampleSpec, write_sample
from packctl.stats import input_stats, stats
from packctl.stats.whatif import read_lengths

NOT_IN_STATS = ("throughput", "timings")  # run facts of a pack, not properties of the packing


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """802 RL rollouts, 4 per prompt, long-tailed (groups cross shard boundaries: 3 shards)."""
    out = tmp_path_factory.mktemp("rollouts") / "in"
    write_sample(out, SampleSpec(sequences=802, distribution="rl-longtail", shards=3, seed=5, max_length=1024,
                                 groups="rollout", group_size=4))
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Groups of 1 to 5 rows over 3 files, string group values, a few single rows over 512 tokens."""
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 6, 140)
    lengths = rng.integers(5, 100, int(sizes.sum()))
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    singles = first[sizes == 1]
    lengths[singles[:4]] = [700, 1500, 513, 900]
    values = [f"g{g}" for g, n in enumerate(sizes) for _ in range(n)]
    rows = [[1 + (i + k) % 97 for k in range(n)] for i, n in enumerate(lengths.tolist())]
    out = tmp_path_factory.mktemp("mixed") / "in"
    bounds = [0, 150, 301, len(rows)]
    for f, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        write_table(out / f"part-{f}.parquet", {"input_ids": rows[lo:hi], "g": values[lo:hi]})
    return out


def _assert_row_is_pack(row, out):
    metrics = json.loads((out / "_metrics.json").read_text())
    manifest = json.loads((out / "_manifest.json").read_text())
    assert row["packs"] == manifest["counts"]["packs"] == sum(s["rows"] for s in manifest["shards"])
    assert row["counts"] == manifest["counts"]
    for key, value in metrics.items():
        if key not in NOT_IN_STATS:
            assert row[key] == value, key


ORDERS = [dict(order="input"), dict(order="shuffle", seed=7), dict(order="curriculum"),
          dict(order="curriculum", curriculum_order="desc")]


@pytest.mark.parametrize("order", ORDERS, ids=["input", "shuffle", "curriculum", "curriculum-desc"])
def test_what_if_with_groups_equals_pack_with_groups(rollouts, tmp_path, order):
    # --window 23 groups: 201 groups in 9 windows
    options = dict(window=23, group_column="group_id", **order)
    r = input_stats([str(rollouts)], [4096], PackConfig(**options))
    assert [w["algorithm"] for w in r["what_if"]] == ["concat", "ffd", "bfd", "mffd", "ffs", "pool"]  # no split
    for algorithm in ("concat", "bfd", "ffs", "pool"):
        _, out = pack_to(tmp_path / algorithm, [rollouts], capacity=4096, algorithm=algorithm, **options)
        _assert_row_is_pack(next(w for w in r["what_if"] if w["algorithm"] == algorithm), out)


SETTINGS = [
    dict(capacity=512, too_long="split", order="shuffle", seed=3, window=17, cp_size=2),
    dict(capacity=512, too_long="drop", order="curriculum", window=40, pad_to="multiple", pack_multiple=64),
    dict(capacity=520, too_long="truncate", order="input", window=9, seq_multiple=8),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["split-shuffle-cp2", "drop-curriculum-multiple",
                                                    "truncate-input-align8"])
def test_what_if_with_groups_of_every_size_equals_pack(mixed, tmp_path, settings):
    """Groups of one follow --too-long (the over-long single rows are split, dropped or cut); the
    larger groups stay whole."""
    planning = {k: v for k, v in settings.items() if k != "capacity"}
    r = input_stats([str(mixed)], [settings["capacity"]], PackConfig(group_column="g", **planning))
    for algorithm in ("concat", "ffd", "mffd", "ffs"):
        _, out = pack_to(tmp_path / algorithm, [mixed], algorithm=algorithm, group_column="g", **settings)
        _assert_row_is_pack(next(w for w in r["what_if"] if w["algorithm"] == algorithm), out)


def test_stats_cli_with_group_column_predicts_pack_cli(rollouts, tmp_path):
    flags = ["--capacity", "4096", "--group-column", "group_id", "--order", "shuffle", "--window", "50"]
    proc = packctl("stats", str(rollouts), *flags, "--json")
    assert proc.code == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["settings"]["group_column"] == "group_id"
    out = tmp_path / "out"
    packed = packctl("pack", str(rollouts), "-o", str(out), *flags, "--algorithm", "ffd", "-q")
    assert packed.code == 0, packed.stderr
    _assert_row_is_pack(next(w for w in report["what_if"] if w["algorithm"] == "ffd"), out)


def test_groups_change_the_figures(rollouts, tmp_path):
    """Rollouts of 4 averaging nearly 4,000 tokens: at capacity 6144 no second group fits beside
    one, so whole groups need far more packs than the same sequences one by one. A what-if that
    ignored the groups would give the ungrouped figures."""
    grouped = input_stats([str(rollouts)], [6144], PackConfig(group_column="group_id"), algorithms=["bfd"])
    alone = input_stats([str(rollouts)], [6144], PackConfig(), algorithms=["bfd"])
    (g,), (a,) = grouped["what_if"], alone["what_if"]
    assert g["packs"] > a["packs"] * 1.5 and g["utilization"] < a["utilization"]
    assert g["group_cost"]["packs_without_groups"] == a["packs"]
    assert g["group_cost"]["utilization_without_groups"] == a["utilization"]
    # the bound over whole groups is above the one over sequences, and no plan beats it
    assert a["lower_bound_packs_l2"] < g["group_cost"]["lower_bound_packs_l2"] <= g["packs"]
    _, out = pack_to(tmp_path, [rollouts], capacity=6144, group_column="group_id")
    assert json.loads((out / "_manifest.json").read_text())["counts"]["packs"] == g["packs"] != a["packs"]
    assert grouped["groups"]["groups"] == 201 and grouped["groups"]["grouped_sequences"] == 802
    assert grouped["groups"]["largest"] == 4
    assert grouped["recommendation"].endswith(
        f"keeping groups whole costs +{g['packs'] - a['packs']:,} packs "
        f"(+{(g['packs'] - a['packs']) / a['packs']:.2%}) over packing the sequences one by one ({a['packs']:,} packs)")
    assert alone["groups"] is None and "groups" not in a and "group_cost" not in a
    assert g["groups"]["scope"] == "pack" and g["groups"]["groups"] == 201  # as pack's _metrics.json has it


def test_group_cost_by_hand(tmp_path):
    # capacity 10, six sequences of 3 in three pairs: each pack holds one pair (6 + 6 > 10), while
    # alone they fill [3 3 3] [3 3 3]
    path = write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[1, 2, 3]] * 6, "g": [0, 0, 1, 1, 2, 2]})
    r = input_stats([str(path)], [10], PackConfig(group_column="g"), algorithms=["bfd"])
    (row,) = r["what_if"]
    assert row["packs"] == 3 and row["lower_bound_packs"] == 2 and row["lower_bound_packs_l2"] == 2
    assert row["group_cost"]["lower_bound_packs_l2"] == 3  # items 6, 6, 6: each above half the capacity
    assert row["group_cost"]["packs_without_groups"] == 2
    assert row["group_cost"]["utilization_without_groups"] == pytest.approx(18 / 20)
    assert r["groups"] == {"column": "g", "groups": 3, "grouped_sequences": 6, "largest": 2,
                           "group_tokens": r["groups"]["group_tokens"]}
    assert r["groups"]["group_tokens"]["min"] == r["groups"]["group_tokens"]["max"] == 6
    assert r["recommendation"].startswith("bfd at --capacity 10: 60.00% utilization, 3 packs (at the lower bound 3 "
                                          "over whole groups)")


def test_terminal_report_says_groups_are_in_force(rollouts):
    from rich.console import Console

    from packctl.cli.render import stats_renderables

    r = stats([str(rollouts)], capacities=[4096], group_column="group_id", order="shuffle")
    console = Console(record=True, width=200)
    for renderable in stats_renderables(r):
        console.print(renderable)
    text = console.export_text()
    assert "groups ('group_id')" in text and "201 groups, 802 sequences in groups of 2 or more" in text
    assert "in 201 groups (--group-column group_id)" in text and "no groups" in text
    bfd = next(w for w in r["what_if"] if w["algorithm"] == "bfd")
    line = next(t for t in text.splitlines() if " bfd" in t)
    assert f"{bfd['packs']:,}" in line and f"{bfd['group_cost']['packs_without_groups']:,}" in line
    assert f"+{bfd['packs'] - bfd['group_cost']['lower_bound_packs_l2']:,}" in line


def _over_capacity_corpus(tmp_path, too_long):
    # rows 2-4 form a group of 3 x 8 tokens = 24 > 16; row 5 alone is over-long (--too-long applies)
    lengths = [3, 3, 8, 8, 20 if too_long != "error" else 8, 4]
    rows = [[1 + (i + k) % 50 for k in range(n)] for i, n in enumerate(lengths)]
    a = write_table(tmp_path / "in" / "p0.parquet", {"input_ids": rows[:3], "g": [1, 1, 2]})
    b = write_table(tmp_path / "in" / "p1.parquet", {"input_ids": rows[3:], "g": [2, 2, 3]})
    return [a, b]


@pytest.mark.parametrize("too_long", ["error", "drop", "truncate", "split"])
def test_a_group_over_the_capacity_is_packs_own_error_whatever_too_long_says(tmp_path, too_long):
    inputs = _over_capacity_corpus(tmp_path, too_long)
    with pytest.raises(PackctlError) as packed:
        pack_to(tmp_path, inputs, capacity=16, group_column="g", too_long=too_long)
    padded = 36 if too_long != "error" else 24
    message = (f"{inputs[0]} row 2 column 'g': the group starting here holds 3 sequences of {padded} tokens (padded), "
               "more than the capacity 16; a group is packed whole into one pack (--too-long applies to single "
               "sequences only): raise --capacity, or keep each group within one optimizer step instead "
               "(--group-scope step with --dp-size)")
    assert str(packed.value) == message
    with pytest.raises(PackctlError) as what_if:
        input_stats([str(p) for p in inputs], [16], PackConfig(group_column="g", too_long=too_long))
    assert str(what_if.value) == message
    # at several capacities, one too small for the group is enough
    with pytest.raises(PackctlError, match="more than the capacity 16;"):
        input_stats([str(p) for p in inputs], [64, 16], PackConfig(group_column="g", too_long=too_long))
    proc = packctl("stats", *map(str, inputs), "--capacity", "16", "--group-column", "g", "--too-long", too_long)
    assert proc.code == 2 and proc.stderr.count("\n") == 1 and message in " ".join(proc.stderr.split())
    assert input_stats([str(p) for p in inputs], [64], PackConfig(group_column="g", too_long=too_long))["what_if"]


def test_unsorted_and_null_groups_are_packs_own_errors(tmp_path):
    rows = [[1, 2, 3]] * 6
    a = write_table(tmp_path / "u" / "a.parquet", {"input_ids": rows[:3], "g": [1, 1, 2]})
    b = write_table(tmp_path / "u" / "b.parquet", {"input_ids": rows[3:], "g": [3, 1, 4]})
    unsorted = (f"{b} row 1 column 'g': group value 1 appears again after other values (its group began at {a} "
                "row 0); rows of one group must be adjacent: sort the input by the group column")
    with pytest.raises(PackctlError) as info:
        read_lengths([str(tmp_path / "u")], group_column="g")
    assert str(info.value) == unsorted
    proc = packctl("stats", str(tmp_path / "u"), "--group-column", "g", "--capacity", "64")
    assert proc.code == 2 and unsorted in " ".join(proc.stderr.split())

    c = write_table(tmp_path / "n" / "c.parquet", {"input_ids": rows[:3], "g": pa.array([1, None, 2])})
    proc = packctl("stats", str(c), "--group-column", "g", "--capacity", "64")
    assert proc.code == 2 and f"{c} row 1 column 'g': null group value" in proc.stderr
    proc = packctl("stats", str(c), "--group-column", "nope", "--capacity", "64")
    assert proc.code == 2 and "no column 'nope' for --group-column" in proc.stderr


def test_what_pack_refuses_with_groups_stats_refuses(rollouts, tmp_path):
    proc = packctl("stats", str(rollouts), "--group-column", "group_id", "--max-seqs-per-bin", "4")
    assert proc.code == 2
    assert ("--max-seqs-per-bin cannot be combined with --group-column (the planner places whole groups); drop one "
            "of them") in " ".join(proc.stderr.split())
    split = "--algorithm split cannot be combined with --group-column (it cuts sequences across packs)"
    with pytest.raises(PackctlError, match="^" + re.escape(split)):
        input_stats([str(rollouts)], [4096], PackConfig(group_column="group_id"), algorithms=["bfd", "split"])
    config = tmp_path / "pack.toml"
    config.write_text('algorithm = "split"\ngroup-column = "group_id"\ncapacity = 4096\n')
    proc = packctl("stats", str(rollouts), "--config", str(config))
    assert proc.code == 2 and split in " ".join(proc.stderr.split())
    with pytest.raises(PackctlError, match="^" + re.escape(split)):
        pack_to(tmp_path, [rollouts], capacity=4096, group_column="group_id", algorithm="split")
    # a packed output's settings are its own
    _, out = pack_to(tmp_path, [rollouts], capacity=4096, group_column="group_id")
    proc = packctl("stats", str(out), "--group-column", "group_id")
    assert proc.code == 2 and "--group-column only apply to raw input" in proc.stderr

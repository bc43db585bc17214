"""Batch mode (padded micro-batches) and shape buckets. `packctl verify` runs here without its
attention checks (torch); tests/integration/training/test_verify_attention.py runs them on a batch
output."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.plan.algorithms import batch_lengths, choose_buckets
from packctl.plan.shapes import planned_item_lengths
from support.contract import check_contract
from support.adversary import packctl
from support.runs import pack_to
from support.profiles import examples


def brute_force_buckets(values, counts, k):
    from itertools import combinations

    distinct = sorted(set(values))
    best = None
    for m in range(1, min(k, len(distinct)) + 1):
        for chosen in combinations(distinct[:-1], m - 1):
            buckets = sorted(chosen) + [distinct[-1]]
            cost = sum(c * (min(b for b in buckets if b >= v) - v) for v, c in zip(values, counts))
            if best is None or cost < best:
                best = cost
    return best


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 5)), min_size=1, max_size=9), st.integers(1, 4))
def test_choose_buckets_is_optimal(pairs, k):
    values, counts = zip(*pairs)
    buckets = choose_buckets(values, counts, k)
    assert len(buckets) <= k and buckets[-1] == max(values)
    cost = sum(c * (int(buckets[np.searchsorted(buckets, v)]) - v) for v, c in zip(values, counts))
    assert cost == brute_force_buckets(list(values), list(counts), k)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=200), st.integers(50, 400),
       st.sampled_from([None, 3]), st.booleans())
def test_micro_batches_fit_the_budget(lengths, max_tokens, max_seqs, bucketed):
    buckets = choose_buckets(lengths, np.ones(len(lengths)), 3) if bucketed else None
    bins = batch_lengths(lengths, max_tokens, max_seqs_per_bin=max_seqs, buckets=buckets)
    lengths = np.asarray(lengths)
    assert sorted(bins.members.tolist()) == list(range(len(lengths)))
    for b in range(bins.num_bins):
        members = bins.members[bins.offsets[b]:bins.offsets[b + 1]]
        longest = lengths[members].max()
        row = longest if buckets is None else buckets[np.searchsorted(buckets, longest)]
        assert len(members) * row <= max_tokens
        assert max_seqs is None or len(members) <= max_seqs
        if buckets is not None:  # one shape per micro-batch
            assert len(set(buckets[np.searchsorted(buckets, lengths[members])].tolist())) == 1
    # longest first: every micro-batch starts with an item at least as long as anything after it
    firsts = lengths[bins.members[bins.offsets[:-1]]]
    assert (np.diff(firsts) <= 0).all()


def test_planned_item_lengths_follow_the_policy():
    lengths = np.array([3, 10, 25])
    assert sorted(planned_item_lengths(lengths, 8, 2, "split").tolist()) == [2, 2, 4, 8, 8, 8, 8]
    assert sorted(planned_item_lengths(lengths, 8, 1, "split").tolist()) == [1, 2, 3, 8, 8, 8, 8]
    assert sorted(planned_item_lengths(lengths, 8, 1, "truncate").tolist()) == [3, 8, 8]
    assert planned_item_lengths(lengths, 8, 1, "drop").tolist() == [3]


def _table(out):
    return pq.read_table(sorted(out.glob("data/train-*.parquet")))


def test_batch_output_layout_verify_and_padding_report(tmp_path, sample_data):
    result, out = pack_to(tmp_path, [sample_data], mode="batch", too_long="split", max_tokens=16384, seq_round=64)
    table = _table(out)
    padded_len = table["padded_len"].to_numpy()
    batch_size = table["batch_size"].to_numpy()
    lens = [np.array(x) for x in table["seq_lens"].to_pylist()]
    ids = table["input_ids"].to_pylist()
    for r in range(table.num_rows):
        assert len(ids[r]) == padded_len[r] * batch_size[r] <= 16384
        assert padded_len[r] % 64 == 0 and lens[r].max() <= padded_len[r] < lens[r].max() + 64
        grid = np.array(ids[r]).reshape(batch_size[r], padded_len[r])
        assert (grid[len(lens[r]):] == 0).all()  # empty rows, if any, are padding
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["layout"]["pad_to"] == "batch" and manifest["layout"]["capacity"] == 16384
    b = result.metrics["batching"]
    assert b["padding_fraction"] < b["naive"]["padding_fraction"]
    assert b["micro_batches"] == table.num_rows
    done = packctl("verify", out, "--source", sample_data, "--json", "--no-attention")
    assert done.code == 0, done.stdout + done.stderr
    checks = json.loads(done.stdout)["checks"]
    assert checks["structure"]["status"] == checks["conservation"]["status"] == "ok", checks
    stats = json.loads(packctl("stats", out, "--json").stdout)
    assert stats["batching"]["padding_fraction"] == pytest.approx(b["padding_fraction"])
    assert stats["batching"]["shapes"] == b["shapes"]


def test_batch_verify_catches_a_wrong_shape(tmp_path, sample_data):
    from packctl.verify import Layout, check_pack_rows
    from packctl.verify.shard_rules import rows_from_table

    _, out = pack_to(tmp_path, [sample_data], mode="batch", too_long="split", max_tokens=8192, seq_round=8)
    table = pq.read_table(sorted(out.glob("data/train-*.parquet"))[0])
    rows, problems = rows_from_table(table)
    assert problems == []
    layout = Layout.from_dict(json.loads((out / "_manifest.json").read_text())["layout"])
    padded_len = table["padded_len"].to_numpy().copy()
    batch_size = table["batch_size"].to_numpy()
    assert check_pack_rows(rows, layout, batch_shape=(padded_len, batch_size)) == []
    padded_len[0] += 8
    rules = {v.rule for v in check_pack_rows(rows, layout, batch_shape=(padded_len, batch_size))}
    assert "batch-shape" in rules


def test_shape_buckets_bound_the_shapes_in_batch_mode(tmp_path, sample_data):
    result, out = pack_to(tmp_path, [sample_data], mode="batch", too_long="split", max_tokens=16384, seq_round=64,
                          shape_buckets=3)
    table = _table(out)
    shapes = set(zip(table["batch_size"].to_pylist(), table["padded_len"].to_pylist()))
    assert len(shapes) <= 3 and result.metrics["batching"]["distinct_shapes"] == len(shapes)
    assert sorted({p for _, p in shapes}) == result.metrics["shape_buckets"]
    assert packctl("verify", out, "--source", sample_data, "--no-attention").code == 0


def test_shape_buckets_bound_pack_lengths_and_keep_the_contract(tmp_path, sample_data, contract):
    result, out = pack_to(tmp_path, [sample_data], too_long="split", pad_to="multiple", pack_multiple=64,
                          shape_buckets=2, algorithm="ffs")
    lengths = set(len(x) for x in _table(out)["input_ids"].to_pylist())
    assert len(lengths) <= 2 and sorted(lengths) == result.metrics["shape_buckets"]
    assert check_contract(contract, out, [sample_data]) == []


def test_batch_mode_with_balancing(tmp_path, sample_data):
    result, out = pack_to(tmp_path, [sample_data], mode="batch", too_long="split", max_tokens=16384, seq_round=64,
                          dp_size=2, micro_batches=2)
    table = _table(out)
    assert {"step", "dp_rank", "micro_batch", "padded_len", "batch_size"} <= set(table.column_names)
    assert result.metrics["balance"]["after"]["attention"]["weighted"] <= \
        result.metrics["balance"]["before"]["attention"]["weighted"] + 1e-9
    assert packctl("verify", out, "--source", sample_data, "--no-attention").code == 0


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "9000"], "apply to --mode batch"),
    (["--mode", "batch", "--max-tokens", "100"], "smaller than --capacity"),
    (["--mode", "batch", "--algorithm", "ffd"], "drop --algorithm"),
    (["--shape-buckets", "3"], "--pad-to multiple"),
    (["--warmup-shapes"], "--warmup-shapes needs --dp-size"),
    (["--mode", "stack"], "--mode 'stack'"),
])
def test_batch_option_errors(tmp_path, sample_data, args, message):
    done = packctl("pack", sample_data, "-o", tmp_path / "out", "--too-long", "split", *args)
    assert done.code == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("mode_options", [
    {"mode": "batch", "max_tokens": 16384, "seq_round": 64, "shape_buckets": 4},
    {"pad_to": "multiple", "pack_multiple": 256, "shape_buckets": 4, "algorithm": "concat", "balance_scope": "packs"},
])
def test_warmup_shapes_show_every_shape_to_every_rank_first(tmp_path, sample_data, mode_options):
    common = dict(too_long="split", dp_size=2, micro_batches=2, **mode_options)
    cold, _ = pack_to(tmp_path / "cold", [sample_data], **common)
    warm, out = pack_to(tmp_path / "warm", [sample_data], warmup_shapes=True, **common)
    shapes = warm.metrics["balance"]["shapes"]
    # k shapes x 2 ranks = 2k packs = the first ceil(2k / 4) steps of 2 ranks x 2 micro-batches
    assert 2 <= shapes["distinct"] <= 4 and shapes["all_seen_by_step"] <= -(-2 * shapes["distinct"] // 4) - 1
    assert shapes["all_seen_by_step"] <= cold.metrics["balance"]["shapes"]["all_seen_by_step"]
    assert packctl("verify", out, "--source", sample_data, "--no-attention").code == 0


def test_stats_what_if_plans_batch_mode_from_a_config_file(tmp_path, sample_data):
    """`--mode batch` from a pack TOML file: the what-if forms pack's micro-batches (one row, no
    algorithm to compare), with pack's `batching` report."""
    config = tmp_path / "batch.toml"
    config.write_text('mode = "batch"\nmax-tokens = 16384\ntoo-long = "truncate"\n')
    done = packctl("stats", sample_data, "--config", config, "--json")
    assert done.code == 0, done.stderr
    (row,) = json.loads(done.stdout)["what_if"]
    assert row["capacity"] == 16384 and row["capacity_flag"] == 4096 and "batching" in row

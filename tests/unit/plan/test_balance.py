"""Balancing packs over data-parallel ranks (plan/balance.py): invariants and figures."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.plan.balance import (BalanceSpec, balance_plan, balance_step, imbalance, imbalance_summary,
                                  kk_partition, lr_scales, piece_costs, round_robin, step_bounds)
from packctl.plan.windows import WindowOptions, plan_windows
from support.contract import check_contract
from support.adversary import packctl
from support.runs import pack_to
from support.profiles import examples


def test_kk_example_from_the_docstring():
    assert kk_partition([8, 7, 6, 5, 4], 2).tolist() == [1, 0, 1, 0, 0]
    costs = np.array([90, 10, 80, 20, 70, 30, 60, 40], dtype=float)
    parts = kk_partition(costs, 2, equal_counts=True)
    assert np.bincount(parts, weights=costs).tolist() == [200.0, 200.0]
    assert np.bincount(parts).tolist() == [4, 4]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=80), st.integers(1, 9), st.booleans())
def test_kk_parts_cover_every_item_with_equal_counts(costs, k, equal):
    parts = kk_partition(costs, k, equal_counts=equal)
    assert len(parts) == len(costs) and ((parts >= 0) & (parts < k)).all()
    if equal:
        counts = np.bincount(parts, minlength=k)
        assert counts.max() - counts.min() <= 1


def test_step_bounds_by_count_and_by_tokens():
    spec = BalanceSpec(dp_size=2, micro_batches=2, capacity=10)
    assert step_bounds(np.full(10, 5), np.array([0, 10]), spec).tolist() == [0, 4, 8, 10]
    assert step_bounds(np.full(10, 5), np.array([0, 3, 10]), spec).tolist() == [0, 3, 7, 10]
    by_tokens = BalanceSpec(dp_size=2, step_tokens=12, capacity=10)
    # 5+5+5 >= 12 after 3 packs, rounded up to 4 (a multiple of dp_size)
    assert step_bounds(np.full(10, 5), np.array([0, 10]), by_tokens).tolist() == [0, 4, 8, 10]


def _random_plan(data, capacity):
    lengths = np.array(data.draw(st.lists(st.integers(1, 2 * capacity), min_size=1, max_size=300)), dtype=np.int64)
    algorithm = data.draw(st.sampled_from(["concat", "ffd", "bfd", "ffs", "split"]))
    window = data.draw(st.integers(5, 400))
    return plan_windows(np.arange(len(lengths)), lengths, WindowOptions(capacity=capacity, align=1, algorithm=algorithm,
                                                                         too_long="split", window=window, seed=1)), lengths


@settings(max_examples=examples(120), deadline=None)
@given(st.data())
def test_every_pack_gets_exactly_one_slot_and_capacity_holds(data):
    capacity = data.draw(st.sampled_from([16, 64, 100]))
    plan, lengths = _random_plan(data, capacity)
    d = data.draw(st.integers(1, 6))
    by_tokens = data.draw(st.booleans())
    spec = BalanceSpec(dp_size=d, micro_batches=None if by_tokens else data.draw(st.integers(1, 4)),
                       step_tokens=data.draw(st.integers(1, 4 * capacity)) if by_tokens else None,
                       cost=data.draw(st.sampled_from(["tokens", "attention"])), attn_coeff=data.draw(st.sampled_from([0.0, 5.0])),
                       scope=data.draw(st.sampled_from(["packs", "sequences"])), equal_counts=data.draw(st.booleans()),
                       capacity=capacity, max_seqs_per_bin=data.draw(st.sampled_from([None, 3])),
                       grouping=data.draw(st.sampled_from(["cost", "order"])), seed=3)
    result = balance_plan(plan, spec)
    out = result.plan
    # every pack one (step, rank, micro-batch) slot, no slot twice
    slots = set(zip(result.step.tolist(), result.dp_rank.tolist(), result.micro_batch.tolist()))
    assert len(slots) == out.num_bins == len(result.step)
    assert ((result.dp_rank >= 0) & (result.dp_rank < d)).all()
    # steps in output order, micro-batches numbered 0.. per (step, rank)
    assert (np.diff(result.step) >= 0).all()
    for (s, r) in {(s, r) for s, r, _ in slots}:
        mine = np.sort(result.micro_batch[(result.step == s) & (result.dp_rank == r)])
        assert mine.tolist() == list(range(len(mine)))
    # capacity and max_seqs hold, no empty pack
    loads = out.loads(padded=True)
    assert loads.max() <= capacity and (np.diff(out.bin_offsets) >= 1).all()
    if spec.max_seqs_per_bin is not None and plan.num_bins:
        # the planner's own limit holds; balancing never adds a piece beyond it
        assert np.diff(out.bin_offsets).max() <= max(spec.max_seqs_per_bin, np.diff(plan.bin_offsets).max())
    # the same pieces, and the pieces of every split sample in order
    before = sorted(zip(plan.piece_gid.tolist(), plan.piece_start.tolist(), plan.piece_len.tolist()))
    after = sorted(zip(out.piece_gid.tolist(), out.piece_start.tolist(), out.piece_len.tolist()))
    assert before == after
    for g in plan.split_gids().tolist():
        starts = out.piece_start[out.piece_gid == g]
        assert (np.diff(starts) > 0).all()
    # equal counts when asked, except steps reported as unequal
    if spec.equal_counts:
        unequal = 0
        for s in np.unique(result.step).tolist():
            counts = np.bincount(result.dp_rank[result.step == s], minlength=d)
            unequal += counts.min() != counts.max()
        assert unequal == result.unequal_steps
    # windows: packs of a window stay in it
    assert out.num_windows == plan.num_windows


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_a_balanced_step_is_never_worse_than_round_robin(data):
    capacity = 64
    counts = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=24))
    padded = np.array(data.draw(st.lists(st.integers(1, 10), min_size=sum(counts), max_size=sum(counts))), np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    cost = data.draw(st.sampled_from(["tokens", "attention"]))
    costs = piece_costs(padded, cost, 0.0)
    d = data.draw(st.integers(1, 5))
    scope = data.draw(st.sampled_from(["packs", "sequences"]))
    spec = BalanceSpec(dp_size=d, micro_batches=4, cost=cost, scope=scope, equal_counts=False, capacity=capacity)
    result = balance_step(offsets, padded, costs, np.ones(len(padded), bool), spec)
    pack = np.repeat(np.arange(len(counts)), counts)
    rr_rank, _ = round_robin(len(counts), d)
    rr = np.bincount(rr_rank[pack], weights=costs, minlength=d).max()
    out_pack = np.repeat(np.arange(len(result.dp_rank)), np.diff(result.offsets))
    after = np.bincount(result.dp_rank[out_pack], weights=costs[result.pieces], minlength=d).max()
    assert after <= rr + 1e-9
    assert np.add.reduceat(padded[result.pieces], result.offsets[:-1]).max() <= capacity


def test_rl_longtail_attention_balance_over_8_ranks():
    rng = np.random.default_rng(0)
    n = 20_000
    lengths = (np.ceil(rng.lognormal(5.5, 0.6, n)) + np.minimum(np.ceil(rng.lognormal(7.0, 1.0, n)), 16384))
    plan = plan_windows(np.arange(n), lengths.astype(np.int64), WindowOptions(capacity=16384, align=1, algorithm="ffs",
                                                                               too_long="split", window=n, seed=0))
    result = balance_plan(plan, BalanceSpec(dp_size=8, micro_batches=2, capacity=16384))
    before = imbalance_summary(result.before_attention)
    after = imbalance_summary(result.after_attention)
    assert before["mean"] > 1.5
    assert after["mean"] <= 1.05 and after["weighted"] <= 1.05


def test_imbalance_and_lr_scales():
    grid = np.array([[9, 9], [16, 14], [7, 0]], dtype=float)
    assert imbalance(grid).round(4).tolist() == [1.0, 1.0667, 2.0]
    assert imbalance_summary(grid)["worst_step"] == 2
    assert lr_scales(np.array([512, 256, 1024]), 512, "linear").tolist() == [1.0, 0.5, 2.0]
    assert lr_scales(np.array([512, 256]), 512, "none").tolist() == [1.0, 1.0]


def test_balanced_pack_output_passes_contract_and_records_slots(tmp_path, sample_data, contract):
    result, out = pack_to(tmp_path, [sample_data], too_long="split", algorithm="ffs", dp_size=4, micro_batches=2,
                          lr_scaling="sqrt", batch_unit="sequences", window=500)
    assert check_contract(contract, out, [sample_data]) == []
    b = result.metrics["balance"]
    assert b["after"]["attention"]["mean"] < b["before"]["attention"]["mean"]
    table = pq.read_table(sorted(out.glob("data/train-*.parquet")))
    for name in ("step", "dp_rank", "micro_batch", "lr_scale"):
        assert name in table.column_names
    step = table["step"].to_numpy()
    assert (np.diff(step) >= 0).all() and step.max() + 1 == b["steps"]
    # lr_scale = sqrt(sequences in the step / the mean)
    seqs = np.bincount(step, weights=[len(x) for x in table["seq_lens"].to_pylist()])
    want = np.sqrt(seqs / seqs.mean())
    assert np.allclose(table["lr_scale"].to_numpy(), want[step], rtol=1e-6)
    assert np.allclose(b["per_step"]["sequences"], seqs)


@pytest.mark.torch
def test_balanced_output_feeds_packed_dataset(tmp_path, sample_data):
    torch_ = pytest.importorskip("torch")
    from packctl.torch import PackedDataset, read_lr_scales

    _, out = pack_to(tmp_path, [sample_data], too_long="split", dp_size=2, micro_batches=3, lr_scaling="linear")
    table = pq.read_table(sorted(out.glob("data/train-*.parquet")))
    seen = []
    for rank in range(2):
        ds = PackedDataset(out, dp_rank=rank)
        keys = [(int(p["step"]), int(p["micro_batch"])) for p in ds]
        assert keys == sorted(keys) and all(int(p["dp_rank"]) == rank for p in ds)
        seen += [int(p["index"]) for p in ds]
    assert sorted(seen) == list(range(table.num_rows))
    scales = read_lr_scales(out)
    assert scales is not None and len(scales) == int(table["step"].to_numpy().max()) + 1
    assert torch_ is not None


def test_stats_reports_dp_balance_with_round_robin(tmp_path, sample_data):
    _, out = pack_to(tmp_path, [sample_data], too_long="split", algorithm="ffs", dp_size=4, micro_batches=2)
    done = packctl("stats", str(out), "--json")
    assert done.code == 0, done.stderr
    dp = json.loads(done.stdout)["dp_balance"]
    recorded = json.loads((out / "_metrics.json").read_text())["balance"]
    assert dp["attention"]["mean"] == pytest.approx(recorded["after"]["attention"]["mean"])
    assert dp["round_robin"] == recorded["before"]


@pytest.mark.parametrize("args, message", [
    (["--micro-batches", "2"], "need --dp-size"),
    (["--dp-size", "4"], "exactly one of --micro-batches"),
    (["--dp-size", "4", "--micro-batches", "2", "--step-tokens", "9"], "exactly one of --micro-batches"),
    (["--dp-size", "0", "--micro-batches", "2"], "--dp-size 0"),
    (["--dp-size", "2", "--micro-batches", "2", "--balance", "flops"], "--balance 'flops'"),
    (["--dp-size", "2", "--micro-batches", "2", "--attn-coeff", "-1"], "--attn-coeff"),
    (["--lr-scaling", "sqrt"], "--lr-scaling need --dp-size"),
])
def test_balance_option_errors(tmp_path, sample_data, args, message):
    done = packctl("pack", str(sample_data), "-o", str(tmp_path / "out"), "--too-long", "split", *args)
    assert done.code == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

"""--group-scope step: a group is kept within one optimizer step, its members in any packs of it."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from support.contract import check_contract
from support.adversary import packctl
from support.runs import pack_to, packed_on_ranks
from support.data import write_table
from support.profiles import examples
from packctl import PackConfig, PackctlError
from packctl.plan.algorithms import KERNELS
from packctl.plan.align import round_up
from packctl.plan.balance import BalanceSpec, balance_plan
from packctl.plan.groups import GroupTooLong
from packctl.plan.windows import GroupTooBigForStep, WindowOptions, check_groups_fit_step, plan_windows
from packctl.sample import SampleSpec, write_sample
from packctl.verify import VerifyOptions, verify

ALGORITHMS = tuple(name for name, kernel in KERNELS.items() if not kernel.cuts_items)  # groups are never cut


def _ordered_groups(sizes, order):
    """gids and new_group for groups of `sizes` (consecutive gids) visited in `order`."""
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    gids = np.concatenate([np.arange(first[g], first[g] + sizes[g]) for g in order])
    new_group = np.concatenate([[True] + [False] * (sizes[g] - 1) for g in order])
    return first, gids, new_group


@settings(max_examples=examples(150), deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=30), data=st.data(),
       algorithm=st.sampled_from(ALGORITHMS), align=st.sampled_from([1, 4]), window=st.integers(1, 10),
       too_long=st.sampled_from(["error", "drop", "truncate"]), by_tokens=st.booleans(),
       dp=st.integers(1, 3), micro=st.integers(1, 4), shuffled=st.booleans())
def test_every_group_lies_in_one_step_and_every_step_fits(sizes, data, algorithm, align, window, too_long, by_tokens,
                                                          dp, micro, shuffled):
    capacity = 64
    n = sum(sizes)
    lengths = np.array(data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)), dtype=np.int64)
    singles = np.flatnonzero(np.array(sizes) == 1)
    first, gids, new_group = _ordered_groups(
        sizes, np.random.default_rng(n).permutation(len(sizes)) if shuffled else np.arange(len(sizes)))
    if too_long != "error" and len(singles):  # a group of one may be over-long: --too-long applies to it
        lengths[first[singles[0]]] = data.draw(st.integers(1, 200))
    step_packs = None if by_tokens else dp * micro
    options = WindowOptions(capacity=capacity, align=align, algorithm=algorithm, too_long=too_long, window=window,
                            step_packs=step_packs, step_tokens=capacity * micro if by_tokens else None)
    padded = round_up(lengths, align)
    try:
        check_groups_fit_step(gids, lengths[gids], new_group, options)
    except GroupTooLong as exc:  # a member of a group of two or more over the capacity
        members = np.arange(exc.gid, exc.gid + exc.members)
        assert exc.members > 1 and (padded[members] > capacity).any()
        return
    except GroupTooBigForStep as exc:
        assert step_packs is not None and exc.members > 1 and exc.packs > step_packs
        return
    if too_long == "error" and (padded > capacity).any():
        return  # check_too_long names it before planning
    plan = plan_windows(gids, lengths[gids], options, new_group=new_group)
    assert (plan.loads(padded=True) <= capacity).all()
    kept = np.setdiff1d(gids, plan.dropped)
    assert np.array_equal(np.sort(plan.piece_gid), kept)  # every sequence once
    # steps: inside windows, never empty, at most dp x micro packs
    steps = plan.step_bins
    assert steps[0] == 0 and steps[-1] == plan.num_bins and (np.diff(steps) > 0).all()
    assert np.isin(plan.window_bins, steps).all()
    if step_packs is not None:
        assert (np.diff(steps) <= step_packs).all()
    step_of_pack = np.repeat(np.arange(len(steps) - 1), np.diff(steps))
    pack_of_piece = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    group_of = {int(g): k for k, (lo, s) in enumerate(zip(first, sizes)) for g in range(lo, lo + s)}
    step_of_group = {}
    for gid, pack_index in zip(plan.piece_gid.tolist(), pack_of_piece.tolist()):
        assert step_of_group.setdefault(group_of[gid], step_of_pack[pack_index]) == step_of_pack[pack_index]
    # steps follow the order of the groups: each opens with the first group still waiting, and
    # later groups only join it to fill its room
    ordinal = {int(g): k for k, g in enumerate(gids[new_group].tolist())}
    opened = {}
    for k, step in step_of_group.items():
        opened[step] = min(opened.get(step, n), ordinal[int(first[k])])
    assert list(opened[s] for s in sorted(opened)) == sorted(opened.values())
    for k, step in step_of_group.items():
        assert opened[step] <= ordinal[int(first[k])]

    # the balancer takes the planned steps as they are: each group stays within one step
    spec = BalanceSpec(dp_size=dp, micro_batches=None if by_tokens else micro,
                       step_tokens=capacity * micro if by_tokens else None, capacity=capacity, seed=3)
    balanced = balance_plan(plan, spec)
    new_pack = np.repeat(np.arange(balanced.plan.num_bins), np.diff(balanced.plan.bin_offsets))
    seen = {}
    for gid, pack_index in zip(balanced.plan.piece_gid.tolist(), new_pack.tolist()):
        step = int(balanced.step[pack_index])
        assert seen.setdefault(group_of[gid], step) == step
    assert (balanced.plan.loads(padded=True) <= capacity).all()
    assert np.array_equal(np.sort(balanced.plan.piece_gid), kept)


def test_steps_fill_with_whole_groups_and_give_back_what_does_not_fit():
    """The docstring's example of plan_window_steps, and its output order."""
    lengths = np.array([5, 3, 6, 4, 4, 7])
    new_group = np.array([True, False, True, True, False, True])
    options = WindowOptions(capacity=8, align=1, algorithm="bfd", too_long="error", window=100, step_packs=2)
    plan = plan_windows(np.arange(6), lengths, options, new_group=new_group)
    assert plan.step_bins.tolist() == [0, 2, 4]
    packs = [plan.piece_gid[a:b].tolist() for a, b in zip(plan.bin_offsets[:-1], plan.bin_offsets[1:])]
    assert sorted(map(sorted, packs[:2])) == [[0, 1], [2]] and sorted(map(sorted, packs[2:])) == [[3, 4], [5]]


def _rollouts(path, sequences=1200, size=8, max_length=1500, shards=3):
    write_sample(path, SampleSpec(sequences=sequences, groups="rollout", group_size=size, shards=shards,
                                  max_length=max_length))
    return path


def _step_groups(out):
    table = pq.read_table(out / "data", columns=["step", "sample_ids", "group_ids"])
    steps = {}
    for step, groups in zip(table.column("step").to_pylist(), table.column("group_ids").to_pylist()):
        for g in groups:
            steps.setdefault(g, set()).add(step)
    return steps, table


def test_groups_larger_than_a_pack_train_within_one_step(tmp_path, contract):
    corpus = _rollouts(tmp_path / "in")
    common = dict(capacity=2048, group_column="group_id", dp_size=2, micro_batches=4)
    with pytest.raises(PackctlError, match="--group-scope step"):  # a pack cannot hold a group of 8
        pack_to(tmp_path, [corpus], **common)
    result, out = pack_to(tmp_path, [corpus], group_scope="step", **common)
    steps, table = _step_groups(out)
    assert len(steps) == 150 and all(len(s) == 1 for s in steps.values())
    spread = [len({p for p, gs in enumerate(table.column("group_ids").to_pylist()) if g in gs}) for g in steps]
    assert max(spread) > 1  # the point: a group spreads over several packs of its step
    per_step = np.bincount(table.column("step").to_numpy())
    assert per_step.max() == 8 and np.mean(per_step == 8) > 0.9  # steps of D x M packs, nearly all full
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["config"]["group_scope"] == "step"
    report = result.metrics["groups"]
    assert report["scope"] == "step" and report["groups"] == 150 and report["members"] == {"mean": 8.0, "max": 8}
    assert report["packs_per_group"]["max"] == max(spread) and report["packs_per_group"]["over_one_pack"] == sum(
        s > 1 for s in spread)
    assert check_contract(contract, out, [corpus]) == []
    assert verify(out, VerifyOptions(attention=False), ).ok


def test_pack_scope_writes_the_bytes_it_wrote_before(tmp_path):
    """--group-scope pack is the default: it leaves no trace in the config (same bytes, same resume)."""
    corpus = _rollouts(tmp_path / "in", sequences=200, size=2, max_length=300)
    result, out = pack_to(tmp_path, [corpus], capacity=2048, group_column="group_id")
    assert "group_scope" not in json.loads((out / "_manifest.json").read_text())["config"]
    report = result.metrics["groups"]
    assert report["scope"] == "pack" and report["groups"] == 100 and report["packs_per_group"]["over_one_pack"] == 0


def test_steps_by_tokens_keep_groups_whole(tmp_path, contract):
    corpus = _rollouts(tmp_path / "in", sequences=800, size=4)
    _, out = pack_to(tmp_path, [corpus], capacity=2048, group_column="group_id", group_scope="step", dp_size=2,
                     step_tokens=6000, order="shuffle", window=60)
    steps, table = _step_groups(out)
    assert all(len(s) == 1 for s in steps.values())
    assert check_contract(contract, out, [corpus]) == []
    assert verify(out, VerifyOptions(attention=False)).ok


@pytest.mark.parametrize("ranks, order, extra", [
    (2, "input", {"micro_batches": 2}),
    (3, "shuffle", {"micro_batches": 3, "token_transfer": "exchange", "algorithm": "ffs"}),
    (4, "curriculum", {"step_tokens": 5000, "token_transfer": "read"}),
])
def test_ranks_write_the_single_process_bytes_with_step_groups(tmp_path, contract, ranks, order, extra):
    corpus = _rollouts(tmp_path / "in", sequences=900, size=6, max_length=700, shards=5)
    many = packed_on_ranks(tmp_path, ranks, inputs=[str(corpus)], capacity=2048, group_column="group_id",
                           group_scope="step", dp_size=2, order=order, window=40, shard_rows=20, **extra)
    assert check_contract(contract, many, [corpus]) == []
    assert verify(many, VerifyOptions(attention=False)).ok


def test_verify_finds_a_group_cut_across_steps(tmp_path):
    corpus = _rollouts(tmp_path / "in", sequences=400, size=4)
    _, out = pack_to(tmp_path, [corpus], capacity=2048, group_column="group_id", group_scope="step", dp_size=2,
                     micro_batches=2)
    assert verify(out, VerifyOptions(attention=False)).ok
    shard = next((out / "data").glob("*.parquet"))
    table = pq.read_table(shard)
    groups = table.column("group_ids").to_pylist()
    steps = table.column("step").to_numpy().copy()
    # a pack holding only part of its group moves to another step
    spread = next(r for r, gs in enumerate(groups)
                  if any(sum(g in other for other in groups) > 1 for g in gs))
    steps[spread] = steps.max() + 1
    pq.write_table(table.set_column(table.column_names.index("step"), "step", pa.array(steps, pa.int32())), shard)
    report = verify(out, VerifyOptions(attention=False))
    assert not report.ok and "group-step" in {v.rule for v in report.violations}


def _grouped(path, lengths, values):
    return write_table(path / "p.parquet", {"input_ids": [[1 + k % 7 for k in range(n)] for n in lengths],
                                            "g": values})


def test_a_group_too_big_for_a_step_is_named(tmp_path):
    inputs = [_grouped(tmp_path / "in", [30, 30, 60, 60, 60, 60, 60, 10], [1, 1, 2, 2, 2, 2, 2, 3])]
    result = packctl("pack", *map(str, inputs), "-o", str(tmp_path / "out"), "--capacity", "64",
                     "--group-column", "g", "--group-scope", "step", "--dp-size", "2", "--micro-batches", "2")
    assert result.code == 2
    assert "p.parquet row 2 column 'g'" in result.stderr and "5 packs" in result.stderr
    assert "--micro-batches" in result.stderr and "Traceback" not in result.stderr


def test_a_member_over_the_capacity_is_named_whatever_too_long_says(tmp_path):
    inputs = [_grouped(tmp_path / "in", [30, 30, 10, 90, 10], [1, 1, 2, 2, 3])]
    result = packctl("pack", *map(str, inputs), "-o", str(tmp_path / "out"), "--capacity", "64",
                     "--group-column", "g", "--group-scope", "step", "--dp-size", "2", "--micro-batches", "4",
                     "--too-long", "drop")
    assert result.code == 2
    assert "p.parquet row 2 column 'g'" in result.stderr and "longer than the capacity 64" in result.stderr


@pytest.mark.parametrize("options, shown", [
    ({}, "needs --dp-size"),
    ({"dp_size": 2, "micro_batches": 2, "too_long": "split"}, "--too-long split"),
    ({"dp_size": 2, "micro_batches": 2, "warmup_shapes": True}, "--warmup-shapes"),
])
def test_options_that_cannot_keep_steps_are_refused(tmp_path, options, shown):
    with pytest.raises(PackctlError, match=shown):
        PackConfig(inputs=["x"], output=str(tmp_path / "o"), group_column="g", group_scope="step",
                   **options).validate()


def test_a_scope_without_a_group_column_is_refused(tmp_path):
    with pytest.raises(PackctlError, match="needs --group-column"):
        PackConfig(inputs=["x"], output=str(tmp_path / "o"), group_scope="step", dp_size=2,
                   micro_batches=1).validate()


def test_epochs_keep_groups_within_steps_for_any_rank_count(tmp_path, contract):
    corpus = _rollouts(tmp_path / "in", sequences=600, size=6, max_length=700, shards=3)
    many = packed_on_ranks(tmp_path, 2, inputs=[str(corpus)], capacity=2048, group_column="group_id",
                           group_scope="step", dp_size=2, micro_batches=2, order="shuffle", epochs=2, window=30)
    for epoch in ("epoch-00000", "epoch-00001"):
        steps, _ = _step_groups(many / epoch)
        assert len(steps) == 100 and all(len(s) == 1 for s in steps.values())
        assert check_contract(contract, many / epoch, [corpus]) == []
        assert verify(many / epoch, VerifyOptions(attention=False)).ok
    first, second = (_step_groups(tmp_path / "one" / e)[1].column("sample_ids").to_pylist()
                     for e in ("epoch-00000", "epoch-00001"))
    assert first != second  # each epoch its own order of groups and steps

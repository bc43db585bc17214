"""--group-column: groups (a run of rows with one value, in global input order) packed whole into
one pack, members adjacent and in input order; `group_ids` in the output, the verify rules, grouped
sample corpora, MPI byte-identity and the torch batches."""
from __future__ import annotations

from types import SimpleNamespace

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
from packctl import PackctlError
from packctl.plan.algorithms import KERNELS
from packctl.plan.align import round_up
from packctl.plan.groups import GroupTooLong
from packctl.plan.windows import WindowOptions, plan_windows
from packctl.sample import SampleSpec, generate, write_sample
from packctl.verify import VerifyOptions, verify
from packctl.verify.groups import GroupRule

ALGORITHMS = tuple(name for name, kernel in KERNELS.items() if not kernel.cuts_items)  # groups are never cut


def _groups_of(new_group, gids):
    """{first gid of a group: [its gids in order]} from the order given to the planner."""
    groups, current = {}, None
    for gid, starts in zip(gids.tolist(), new_group.tolist()):
        if starts:
            current = gid
            groups[current] = []
        groups[current].append(gid)
    return groups


@settings(max_examples=examples(150), deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=40), data=st.data(),
       algorithm=st.sampled_from(ALGORITHMS), align=st.sampled_from([1, 4]), window=st.integers(1, 12),
       too_long=st.sampled_from(["error", "drop", "truncate", "split"]), shuffled=st.booleans())
def test_every_group_lies_whole_in_one_pack_adjacent_in_input_order(sizes, data, algorithm, align, window, too_long,
                                                                    shuffled):
    capacity = 64
    n = sum(sizes)
    lengths = np.array(data.draw(st.lists(st.integers(1, 14), min_size=n, max_size=n)), dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    singles = first[np.array(sizes) == 1]
    if too_long != "error" and len(singles):  # groups of one may be over-long: --too-long applies to them
        lengths[singles[:3]] = data.draw(st.lists(st.integers(1, 200), min_size=min(3, len(singles)),
                                                  max_size=min(3, len(singles))))
    group_order = np.random.default_rng(len(sizes)).permutation(len(sizes)) if shuffled else np.arange(len(sizes))
    gids = np.concatenate([np.arange(first[g], first[g] + sizes[g]) for g in group_order])
    new_group = np.concatenate([[True] + [False] * (sizes[g] - 1) for g in group_order])
    group_padded = np.add.reduceat(round_up(lengths, align), first)
    options = WindowOptions(capacity=capacity, align=align, algorithm=algorithm, too_long=too_long, window=window)
    over_groups = (np.array(sizes) > 1) & (group_padded > capacity)
    if over_groups.any() or (too_long == "error" and (round_up(lengths, align) > capacity).any()):
        with pytest.raises((GroupTooLong, ValueError)):
            plan_windows(gids, lengths[gids], options, new_group=new_group)
        return
    plan = plan_windows(gids, lengths[gids], options, new_group=new_group)
    pack_of = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    assert (plan.loads(padded=True) <= capacity).all()
    # every sequence exactly once (pieces of a split group of one follow each other)
    kept = np.setdiff1d(gids, plan.dropped)
    assert np.array_equal(np.unique(plan.piece_gid), np.sort(kept))
    if too_long != "split":
        assert len(plan.piece_gid) == len(kept)
    window_of_pack = np.repeat(np.arange(plan.num_windows), np.diff(plan.window_bins))
    for group_first, members in _groups_of(new_group, gids).items():
        members = [g for g in members if g in set(kept.tolist())]
        if len(members) < 2:
            continue
        at = np.flatnonzero(np.isin(plan.piece_gid, members))
        assert len(at) == len(members) and len(set(pack_of[at].tolist())) == 1  # whole, in one pack
        assert np.array_equal(np.diff(at), np.ones(len(at) - 1)) and plan.piece_gid[at].tolist() == members
    # windows count groups: window w holds groups [w * window, (w + 1) * window) of the order
    ordinal = np.cumsum(new_group) - 1
    for gid, pack in zip(plan.piece_gid.tolist(), pack_of.tolist()):
        assert window_of_pack[pack] == ordinal[np.flatnonzero(gids == gid)[0]] // window
    # whole groups are the items: never fewer bins than the items' lower bound
    items = np.add.reduceat(plan.piece_padded, np.flatnonzero(np.diff(np.concatenate([[-1], pack_of])) != 0))
    assert plan.num_bins >= -(-int(items.sum()) // capacity)


def _grouped_corpus(path, values, lengths=None, files=2):
    """Rows with the given group values (split over `files` files), token lists of `lengths`."""
    lengths = lengths or [3 + (i * 7) % 11 for i in range(len(values))]
    rows = [[1 + (i + k) % 50 for k in range(n)] for i, n in enumerate(lengths)]
    bounds = np.linspace(0, len(values), files + 1).astype(int)
    return [write_table(path / f"p{f}.parquet", {"input_ids": rows[lo:hi], "g": values[lo:hi]})
            for f, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]


def _packs(out):
    table = pq.read_table(out / "data")
    return table.column("sample_ids").to_pylist(), table.column("group_ids").to_pylist()


@pytest.mark.parametrize("order", ["input", "shuffle", "curriculum"])
def test_pack_keeps_groups_whole_across_files_and_writes_group_ids(tmp_path, contract, order):
    values = [5, 5, 5, 1, 7, 2, 2, 9, 9, 9, 9, 3]
    inputs = _grouped_corpus(tmp_path / "in", values, files=3)
    _, out = pack_to(tmp_path, inputs, capacity=64, group_column="g", order=order, window=2)
    samples, groups = _packs(out)
    expected = {0: [0, 1, 2], 3: [3], 4: [4], 5: [5, 6], 7: [7, 8, 9, 10], 11: [11]}
    seen = {}
    for s, g in zip(samples, groups):
        for gid, group in zip(s, g):
            seen.setdefault(group, []).append(gid)
        assert all(s[i:i + len(expected[x])] == expected[x] for i, x in enumerate(g) if i == g.index(x))
    assert seen == expected
    assert check_contract(contract, out, [tmp_path / "in"]) == []
    assert verify(out, VerifyOptions(attention=False)).ok


def test_group_column_reads_strings(tmp_path):
    inputs = _grouped_corpus(tmp_path / "in", ["a", "a", "b", "c", "c"], files=1)
    _, out = pack_to(tmp_path, inputs, capacity=32, group_column="g")
    samples, groups = _packs(out)
    assert sorted(x for g in groups for x in g) == [0, 0, 2, 3, 3]


def test_a_value_found_again_is_named_with_both_rows(tmp_path):
    inputs = _grouped_corpus(tmp_path / "in", [1, 1, 2, 3, 1, 4], files=2)
    with pytest.raises(PackctlError) as info:
        pack_to(tmp_path, inputs, capacity=64, group_column="g")
    assert str(info.value) == (f"{inputs[1]} row 1 column 'g': group value 1 appears again after other values "
                               f"(its group began at {inputs[0]} row 0); rows of one group must be adjacent: "
                               "sort the input by the group column")
    proc = packctl("pack", *map(str, inputs), "-o", str(tmp_path / "cli"), "--capacity", "64", "--group-column", "g")
    assert proc.code == 2 and f"{inputs[1]} row 1 column 'g': group value 1 appears again" in proc.stderr


def test_a_null_group_value_is_named(tmp_path):
    path = write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[1, 2]] * 3, "g": pa.array([1, None, 2])})
    with pytest.raises(PackctlError, match=f"^{path} row 1 column 'g': null group value"):
        pack_to(tmp_path, [path], capacity=16, group_column="g")


@pytest.mark.parametrize("too_long", ["error", "drop", "truncate", "split"])
def test_a_group_over_the_capacity_is_named_whatever_too_long_says(tmp_path, too_long):
    # rows 2-4 form a group of 3 x 8 tokens = 24 > 16; row 5 alone is over-long (--too-long applies)
    inputs = _grouped_corpus(tmp_path / "in", [1, 1, 2, 2, 2, 3], lengths=[3, 3, 8, 8, 20 if too_long != "error"
                                                                             else 8, 4], files=2)
    with pytest.raises(PackctlError) as info:
        pack_to(tmp_path, inputs, capacity=16, group_column="g", too_long=too_long)
    padded = 36 if too_long != "error" else 24
    assert str(info.value) == (f"{inputs[0]} row 2 column 'g': the group starting here holds 3 sequences of "
                               f"{padded} tokens (padded), more than the capacity 16; a group is packed whole "
                               "into one pack (--too-long applies to single sequences only): raise --capacity, "
                               "or keep each group within one optimizer step instead (--group-scope step with "
                               "--dp-size)")


def test_too_long_applies_to_groups_of_one(tmp_path):
    inputs = _grouped_corpus(tmp_path / "in", [1, 1, 2, 3], lengths=[3, 3, 40, 4], files=1)
    result, out = pack_to(tmp_path, inputs, capacity=16, group_column="g", too_long="split")
    assert result.counts["sequences_split"] == 1
    assert verify(out, VerifyOptions(attention=False)).ok
    with pytest.raises(PackctlError, match="row 2 column 'input_ids': sequence of 40 tokens"):
        pack_to(tmp_path, inputs, capacity=16, group_column="g")


@pytest.mark.parametrize("flag, value, shown", [("algorithm", "split", "--algorithm split"),
                                                ("max_seqs_per_bin", 4, "--max-seqs-per-bin"),
                                                ("group_column", "input_ids", "--group-column 'input_ids'")])
def test_options_that_cut_groups_are_refused(tmp_path, flag, value, shown):
    inputs = _grouped_corpus(tmp_path / "in", [1, 1, 2], files=1)
    with pytest.raises(PackctlError, match=f"^{shown}"):
        pack_to(tmp_path, inputs, capacity=64, **{"group_column": "g", flag: value})


def test_verify_rules_catch_groups_cut_or_out_of_order():
    def rule_hits(packs):
        rule = GroupRule()
        for shard, pack_list in enumerate(packs):
            samples = [s for s, _ in pack_list]
            offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])])
            table = pa.table({"group_ids": pa.array([g for _, g in pack_list], pa.list_(pa.int64()))})
            rows = SimpleNamespace(seq_offsets=offsets, num_rows=len(samples),
                                   sample_ids=np.concatenate(samples).astype(np.int64))
            assert rule.add(table, rows, f"s{shard}") == []
        return sorted({v.rule for v in rule.check()})

    good = [[([8, 2, 3, 4], [8, 2, 2, 2])], [([0, 1, 5], [0, 0, 5])]]
    assert rule_hits(good) == []
    assert rule_hits([[([8, 2, 3], [8, 2, 2])], [([4, 0, 1, 5], [2, 0, 0, 5])]]) == ["group-whole"]
    assert rule_hits([[([3, 2, 4], [2, 2, 2]), ([0, 1], [0, 0])]]) == ["group-adjacent"]
    assert rule_hits([[([2, 9, 3], [2, 9, 2]), ([0, 1], [0, 0])]]) == ["group-adjacent"]
    assert rule_hits([[([0, 1, 2], [0, 0, 2]), ([3, 4], [2, 4])]]) == ["group-whole"]
    assert rule_hits([[([0, 1, 2], [0, 0, 0]), ([3], [1])]]) == ["group-ids"]


def test_verify_finds_a_tampered_output(tmp_path):
    inputs = _grouped_corpus(tmp_path / "in", [1, 1, 2, 2, 3, 3, 3, 4], files=1)
    _, out = pack_to(tmp_path, inputs, capacity=32, group_column="g")
    assert verify(out, VerifyOptions(attention=False)).ok
    shard = next((out / "data").glob("*.parquet"))
    table = pq.read_table(shard)
    groups = table.column("group_ids").to_pylist()
    groups[0][0] = groups[-1][-1] + 1  # a member given a group id of its own
    table = table.set_column(table.column_names.index("group_ids"), "group_ids",
                             pa.array(groups, pa.list_(pa.int64())))
    pq.write_table(table, shard)
    report = verify(out, VerifyOptions(attention=False))
    assert not report.ok and "group-ids" in {v.rule for v in report.violations}


@pytest.mark.parametrize("ranks, order, extra", [
    (2, "input", {}),
    (3, "shuffle", {"dp_size": 2, "micro_batches": 2, "token_transfer": "exchange"}),
    (4, "curriculum", {"token_transfer": "read"}),
])
def test_ranks_write_the_single_process_bytes_with_groups(tmp_path, contract, ranks, order, extra):
    corpus = tmp_path / "in"
    write_sample(corpus, SampleSpec(sequences=900, groups="rollout", group_size=5, shards=5, max_length=400))
    many = packed_on_ranks(tmp_path, ranks, inputs=[str(corpus)], capacity=2048, group_column="group_id",
                           order=order, window=40, shard_rows=20, **extra)
    assert check_contract(contract, many, [corpus]) == []
    assert verify(many, VerifyOptions(attention=False)).ok


def test_balanced_steps_keep_groups_whole(tmp_path):
    corpus = tmp_path / "in"
    write_sample(corpus, SampleSpec(sequences=600, groups="preference", shards=2, max_length=900))
    _, out = pack_to(tmp_path, [corpus], capacity=2048, group_column="group_id", dp_size=4, micro_batches=2,
                     balance_scope="sequences")
    assert verify(out, VerifyOptions(attention=False)).ok  # group-whole, group-adjacent over moved sequences


@pytest.mark.parametrize("kind, size", [("preference", 2), ("rollout", 3)])
def test_sample_groups_share_a_masked_prompt(kind, size):
    spec = SampleSpec(sequences=301, groups=kind, group_size=size, shards=2, seed=5)
    tables = generate(spec)
    assert all(a.equals(b) for a, b in zip(tables, generate(spec)))
    rows = pa.concat_tables(tables).to_pylist()
    assert [r["group_id"] for r in rows] == [i // size for i in range(301)]
    for k in range(0, 300 - size, size):
        group = rows[k:k + size]
        prompt = sum(1 for x in group[0]["labels"] if x == -100)
        assert prompt >= 1 and all(r["input_ids"][:prompt] == group[0]["input_ids"][:prompt] for r in group)
        assert all(r["labels"][:prompt] == [-100] * prompt and r["labels"][prompt:] == r["input_ids"][prompt:]
                   for r in group)


@pytest.mark.torch
def test_torch_batches_carry_group_ids(tmp_path):
    torch = pytest.importorskip("torch")
    from packctl.torch import PackedDataset, collate_hf, split_loss_fields

    inputs = _grouped_corpus(tmp_path / "in", [1, 1, 2, 2, 2, 3], files=1)
    _, out = pack_to(tmp_path, inputs, capacity=32, group_column="g")
    dataset = PackedDataset(out)
    packs = [dataset[i] for i in range(len(dataset))]
    assert all(len(p["group_ids"]) == len(p["sample_ids"]) for p in packs)
    batch = collate_hf(packs, loss_counts=True)
    fields = split_loss_fields(batch)
    assert fields["group_ids"].dtype == torch.int64
    assert fields["group_ids"].tolist() == [g for p in packs for g in p["group_ids"].tolist()]
    assert "group_ids" not in batch


def test_epochs_keep_groups_whole_in_every_epoch_for_any_rank_count(tmp_path, contract):
    corpus = tmp_path / "in"
    write_sample(corpus, SampleSpec(sequences=600, groups="rollout", group_size=4, shards=3, max_length=400))
    many = packed_on_ranks(tmp_path, 3, inputs=[str(corpus)], capacity=2048, group_column="group_id",
                           order="shuffle", epochs=2, window=30, shard_rows=20)
    orders = []
    for epoch in ("epoch-00000", "epoch-00001"):
        assert check_contract(contract, many / epoch, [corpus]) == []
        samples, groups = _packs(tmp_path / "one" / epoch)
        for pack_samples, pack_groups in zip(samples, groups):  # whole groups of 4, adjacent, in input order
            assert pack_groups == [g for g in dict.fromkeys(pack_groups) for _ in range(4)]
            assert pack_samples == [g + k for g in dict.fromkeys(pack_groups) for k in range(4)]
        orders.append([g for pack_groups in groups for g in pack_groups])
        assert verify(many / epoch, VerifyOptions(attention=False)).ok
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]

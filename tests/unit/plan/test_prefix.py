"""plan/prefix.py: the worked examples of its docstrings, and each function against a few-line
reference over random groups."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from packctl.plan.prefix import (common_with_previous, expand_shared, prefix_pieces, run_prefixes, shared_of,
                                 sharing_counts, stored_padded, tree_parents)
from support.profiles import examples


def test_the_docstring_examples():
    rows = [[1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 9], [5]]
    offsets = np.cumsum([0] + [len(r) for r in rows])
    flat = np.concatenate(rows).astype(np.int32)
    assert common_with_previous(offsets, flat, flat, None).tolist() == [-1, 4, 0]
    assert common_with_previous(offsets, flat, flat, (np.array([1, 2]), np.array([1, 2]))).tolist() == [2, 4, 0]
    first, p = run_prefixes(np.array([-1, 4, 0, 9]), np.arange(4), np.array([0, 0, 2, 2]))
    assert first.tolist() == [0, 2] and p.tolist() == [4, 9]
    assert shared_of(np.array([4, 1, 9]), np.array([2, 2, 1])).tolist() == [3, 0, 0]
    rows_of, starts, lens, opens = expand_shared(np.array([6, 5, 3]), np.array([3, 3, 0]),
                                                 np.array([True, False, True]))
    assert (rows_of.tolist(), starts.tolist(), lens.tolist(), opens.tolist()) == (
        [0, 0, 1, 2], [0, 3, 3, 0], [3, 3, 2, 3], [True, False, False, True])
    assert stored_padded(lambda n: n, np.array([6, 5]), np.array([3, 3]), np.array([True, False])).tolist() == [6, 2]
    assert tree_parents(np.array([0, 5]), np.array([0, 0, 3, 3, 0]), np.ones(5, bool)).tolist() == [-1, -1, 1, 1, -1]
    parents = np.array([-1, 0, 0, -1, -1])
    prefix = prefix_pieces(np.array([0, 3, 5]), parents)
    assert prefix.tolist() == [True, False, False, False, False]
    assert sharing_counts(np.array([0, 3, 3, 0, 0]), np.array([3, 3, 2, 4, 1]), parents, prefix) == {
        "groups_shared": 1, "tokens_saved": 3, "attention_flat": 21 + 15 + 10 + 1, "attention_tree": 30 + 10 + 1}


@settings(max_examples=examples(200), deadline=None)
@given(groups=st.lists(st.tuples(st.lists(st.integers(1, 3), max_size=6), st.integers(1, 4)), min_size=1,
                       max_size=8),
       data=st.data())
def test_the_shared_tokens_are_the_common_prefix_of_every_group_as_a_loop_finds_it(groups, data):
    rows, group = [], []
    for g, (prompt, size) in enumerate(groups):
        for _ in range(size):
            rows.append(prompt + data.draw(st.lists(st.integers(1, 3), min_size=0 if prompt else 1, max_size=4)))
            group.append(g)
    group_of = np.array(group)
    gids = np.arange(len(rows))
    first_gid = np.array([np.flatnonzero(group_of == g)[0] for g in group_of])
    offsets = np.cumsum([0] + [len(r) for r in rows])
    flat = np.concatenate(rows).astype(np.int32)
    _, p = run_prefixes(common_with_previous(offsets, flat, flat, None), gids, first_gid)
    for k, g in enumerate(np.unique(group_of)):
        members = [rows[i] for i in np.flatnonzero(group_of == g)]
        n = 0  # the reference: the longest prefix every member has
        while all(len(m) > n for m in members) and len({m[n] for m in members}) == 1:
            n += 1
        assert p[k] == (n if len(members) > 1 else np.iinfo(np.int64).max)


def test_balance_counts_the_prefix_a_branch_attends_to():
    """A pack of one shared group (prefix 3, branches 3 and 2) costs its branches' pairs with the
    prefix beside their own: 2 * b * 3 more per branch under --balance attention (a = 0)."""
    from packctl.plan.balance import BalanceSpec, balance_plan
    from packctl.plan.windows import WindowOptions, plan_windows

    lengths, shared = np.array([6, 5, 4]), np.array([3, 3, 0])
    new_group = np.array([True, False, True])
    plan = plan_windows(np.arange(3), lengths, WindowOptions(capacity=16, align=1, algorithm="concat",
                                                             too_long="error", window=10), new_group=new_group,
                        shared=shared)
    spec = BalanceSpec(dp_size=1, micro_batches=1, capacity=16, attn_coeff=0.0)
    context = np.where(plan.piece_start > 0, plan.piece_start, 0).astype(np.float64)
    flat = balance_plan(plan, spec).before_attention.sum()
    tree = balance_plan(plan, spec, context=context).before_attention.sum()
    assert flat == 9 + 9 + 4 + 16 and tree == flat + 2 * 3 * 3 + 2 * 2 * 3

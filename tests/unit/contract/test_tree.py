"""The tree layout of shared-prefix packs: ancestry, rebuilt rows and visibility, against the
layout's worked example and a brute-force reading of its rule over random trees."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packctl.contract.tree import (ancestor_sums, ancestry, chains, check_parents, continued, depths, flat_parents,
                                   offset_in_segment, roots, row_positions, segment_of, visible)
from support.profiles import examples
from support.trees import Group, Row, random_items, rows_of, tree_pack

I = -100


def example_pack(**kw):
    return tree_pack([Group([Row(5, [1, 2, 3, 4, 7, 8], [I, I, I, I, 7, 8]),
                             Row(6, [1, 2, 3, 4, 9], [I, I, I, I, 9])], p=4)], **kw)


def test_the_layouts_worked_example():
    pack = example_pack()
    assert pack["input_ids"].tolist() == [1, 2, 3, 4, 7, 8, 4, 9]
    assert pack["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 3, 4]
    assert pack["seq_lens"].tolist() == [3, 3, 2]
    assert pack["parent_segments"].tolist() == [-1, 0, 0]
    assert pack["sample_ids"].tolist() == [-1, 5, 6]
    assert pack["labels"].tolist() == [I, I, I, I, 7, 8, I, 9]
    rows = row_positions(pack["parent_segments"], pack["seq_lens"], pack["cu_seqlens_padded"], pack["sample_ids"])
    assert rows.segments.tolist() == [1, 2]
    assert rows.row(0).tolist() == [0, 1, 2, 3, 4, 5]
    assert rows.row(1).tolist() == [0, 1, 2, 6, 7]
    drawn = """
        1 . . . . . . .
        1 1 . . . . . .
        1 1 1 . . . . .
        1 1 1 1 . . . .
        1 1 1 1 1 . . .
        1 1 1 1 1 1 . .
        1 1 1 . . . 1 .
        1 1 1 . . . 1 1"""
    expected = np.array([[c == "1" for c in line.split()] for line in drawn.strip().splitlines()])
    assert (visible(pack["parent_segments"], pack["seq_lens"], pack["seq_lens_padded"]) == expected).all()


def test_padding_is_never_seen_and_a_flat_pack_is_block_causal():
    # align 4: prefix [1 2 3 0], branch 5 [4 7 8 0], branch 6 [4 9 0 0]
    pack = example_pack(align=4)
    seen = visible(pack["parent_segments"], pack["seq_lens"], pack["seq_lens_padded"])
    real = np.array([1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0], bool)
    assert not seen[real][:, ~real].any()  # no true token sees padding
    assert seen[8, :3].all() and not seen[8, 4:8].any()  # branch 6 sees the prefix, not branch 5
    flat = visible([-1, -1], [2, 3], [2, 3])
    assert flat.tolist() == np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                      [0, 0, 1, 1, 1]], bool).tolist()


def test_helpers_follow_chains():
    parents = [-1, 0, 1, 0, -1, 4]
    assert roots(parents).tolist() == [0, 0, 0, 0, 4, 4]
    assert depths(parents).tolist() == [0, 1, 2, 1, 0, 1]
    above = ancestry(parents)
    assert [np.flatnonzero(r).tolist() for r in above] == [[], [0], [0, 1], [0], [], [4]]
    assert chains(parents).tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 3, -1], [4, -1, -1], [4, 5, -1]]
    assert ancestor_sums(parents, [3, 3, 2, 1, 5, 4]).tolist() == [0, 3, 6, 3, 0, 5]
    assert continued(parents).tolist() == [True, True, False, False, True, False]
    # two packs end to end; the second pack's parent 5 is out of place and read as -1
    assert flat_parents([0, 3, 6], [-1, 0, 0, -1, 0, 5]).tolist() == [-1, 0, 0, -1, 3, -1]
    assert segment_of([3, 0, 2]).tolist() == [0, 0, 0, 2, 2]
    assert offset_in_segment([3, 2]).tolist() == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("parents, message", [
    ([-1, 1], "segment 1 names itself as its parent"),
    ([-1, 2, 1], "segment 1 names the later segment 2"),
    ([-1, -2], "segment 1 has parent -2"),
])
def test_cycles_and_forward_parents_are_refused(parents, message):
    with pytest.raises(ValueError, match=message):
        check_parents(parents)
    with pytest.raises(ValueError, match=message):
        visible(parents, [1] * len(parents), [1] * len(parents))


# ---- random trees, against the rule read literally ---------------------------------------------


@st.composite
def trees(draw):
    """A random forest of segments (any depth), each with a true length and padding; a segment
    holds a row when it has no child, or sometimes anyway."""
    count = draw(st.integers(1, 9))
    parents = [-1] + [draw(st.integers(-1, s - 1)) for s in range(1, count)]
    lens = [draw(st.integers(1, 4)) for _ in range(count)]
    padded = [n + draw(st.integers(0, 2)) for n in lens]
    has_child = set(p for p in parents if p >= 0)
    ids = [s if s not in has_child or draw(st.booleans()) else -1 for s in range(count)]
    return parents, lens, padded, ids


def chain_of(parents, s):
    chain = [s]
    while parents[chain[-1]] >= 0:
        chain.append(parents[chain[-1]])
    return chain[::-1]


@settings(max_examples=examples(300), deadline=None)
@given(trees())
def test_visibility_is_the_rule(tree):
    parents, lens, padded, _ = tree
    starts = np.concatenate([[0], np.cumsum(padded)])
    seen = visible(parents, lens, padded)
    for q in range(int(starts[-1])):
        s = int(np.searchsorted(starts, q, side="right") - 1)
        ancestors = chain_of(parents, s)[:-1]
        for k in range(int(starts[-1])):
            t = int(np.searchsorted(starts, k, side="right") - 1)
            i, j = q - starts[s], k - starts[t]
            assert seen[q, k] == ((t == s and j <= i) or (t in ancestors and j < lens[t])), (q, k)


@settings(max_examples=examples(300), deadline=None)
@given(trees())
def test_chains_answer_ancestry_in_one_lookup(tree):
    parents = tree[0]
    table, depth, above = chains(parents), depths(parents), ancestry(parents)
    for s in range(len(parents)):
        for t in range(len(parents)):
            assert (table[s, depth[t]] == t) == (t == s or above[s, t])


@settings(max_examples=examples(300), deadline=None)
@given(trees())
def test_rows_are_their_chains(tree):
    parents, lens, padded, ids = tree
    starts = np.concatenate([[0], np.cumsum(padded)])
    rows = row_positions(parents, lens, starts, ids)
    assert rows.segments.tolist() == [s for s in range(len(ids)) if ids[s] >= 0]
    for k, s in enumerate(rows.segments):
        expected = [int(starts[t]) + j for t in chain_of(parents, int(s)) for j in range(lens[t])]
        assert rows.row(k).tolist() == expected


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_packs_of_groups_give_back_their_rows(seed, align):
    items = random_items(np.random.default_rng(seed))
    pack = tree_pack(items, align=align)
    rows = row_positions(pack["parent_segments"], pack["seq_lens"], pack["cu_seqlens_padded"], pack["sample_ids"])
    source = rows_of(items)
    assert pack["sample_ids"][rows.segments].tolist() == [r.gid for r in source]
    for k, row in enumerate(source):
        at = rows.row(k)
        assert pack["input_ids"][at].tolist() == row.tokens
        assert pack["labels"][at].tolist() == row.packed_labels
        assert pack["position_ids"][at].tolist() == list(range(len(row.tokens)))
    seen = visible(pack["parent_segments"], pack["seq_lens"], pack["seq_lens_padded"])
    for k in range(len(source)):  # a row's tokens see exactly the earlier tokens of the same row
        at = rows.row(k)
        assert (seen[np.ix_(at, at)] == np.tri(len(at), dtype=bool)).all()
        others = np.setdiff1d(np.arange(len(pack["input_ids"])), at)
        assert not seen[np.ix_(at, others)].any()


def _pack_rows(packs):
    """PackRows of `tree_pack` dicts laid end to end (what the writer and verify count over)."""
    from packctl.arrays import offsets_of
    from packctl.contract.thd import PackRows

    def cat(name):
        return np.concatenate([p[name] for p in packs])

    return PackRows(token_offsets=offsets_of([len(p["input_ids"]) for p in packs]), input_ids=cat("input_ids"),
                    labels=cat("labels"), position_ids=cat("position_ids"),
                    seq_offsets=offsets_of([len(p["seq_lens"]) for p in packs]), seq_lens=cat("seq_lens"),
                    seq_lens_padded=cat("seq_lens_padded"), sample_ids=cat("sample_ids"),
                    cu_offsets=offsets_of([len(p["cu_seqlens"]) for p in packs]), cu_seqlens=cat("cu_seqlens"),
                    cu_seqlens_padded=cat("cu_seqlens_padded"), num_tokens=np.array([p["num_tokens"] for p in packs]),
                    parent_segments=cat("parent_segments"))


@settings(max_examples=examples(150), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_the_loss_columns_of_trees_are_those_of_their_rows_packed_flat(seed, align):
    """A tree's seq_loss_tokens holds its row's targets on each row's segment (0 on a prefix):
    summed, they are the loss tokens of the same rows packed flat; its attention cost is the
    balance's (a branch of L tokens after c: L^2 + 2 L c)."""
    from packctl.contract.thd import loss_columns

    rng = np.random.default_rng(seed)
    items = [random_items(rng, first_gid=100 * k) for k in range(2)]
    trees = [tree_pack(its, align=align) for its in items]
    flats = [tree_pack(rows_of(its), align=align) for its in items]
    counted = loss_columns(_pack_rows(trees))
    flat = loss_columns(_pack_rows(flats))
    assert counted.num_loss_tokens.tolist() == flat.num_loss_tokens.tolist()
    rows = np.concatenate([p["sample_ids"] for p in trees]) >= 0
    assert counted.seq_loss_tokens[rows].tolist() == flat.seq_loss_tokens.tolist()
    assert not counted.seq_loss_tokens[~rows].any()
    for got, pack in zip(counted.sum_sq_seqlen.tolist(), trees):
        assert got == pack["sum_sq_seqlen"]  # the builder's L^2 + 2 L c
    assert [c.tolist() for c in (counted.seq_loss_tokens, counted.num_loss_tokens)] == [
        np.concatenate([p["seq_loss_tokens"] for p in trees]).tolist(), [p["num_loss_tokens"] for p in trees]]

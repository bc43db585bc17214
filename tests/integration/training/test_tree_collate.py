"""collate_tree and its losses on shared-prefix packs built by hand (tests/support/trees.py): the
batch rebuilds every row, the masks follow the tree rule, and tree_loss / row_logprobs over random
logits equal the losses of each row read at its own positions by a reference written here."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

from packctl.contract.tree import visible  # noqa: E402
from packctl.errors import PackctlError  # noqa: E402
from packctl.torch import (collate_flash_attn, collate_hf, collate_thd, collate_tree, loss_fn, row_logprobs, tree_attention_mask,  # noqa: E402
                           tree_block_mask, tree_loss)
from support.profiles import examples  # noqa: E402
from support.trees import Group, Row, random_items, rows_of, tree_pack  # noqa: E402

I = -100


def example_items():
    return [Group([Row(5, [1, 2, 3, 4, 7, 8], [I, I, I, I, 7, 8]), Row(6, [1, 2, 3, 4, 9], [I, I, I, I, 9])], p=4)]


def example_pack():
    return tree_pack(example_items())


def test_the_docstring_example():
    batch = collate_tree([example_pack()])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 7, 8, 4, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4]]
    assert batch["row_positions"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7]
    assert batch["row_targets"].tolist() == [I, I, I, 7, 8, I, I, I, I, 9, I]
    assert batch["row_offsets"].tolist() == [0, 6, 11]
    assert batch["row_sample_ids"].tolist() == [5, 6]
    assert batch["row_loss_tokens"].tolist() == [2, 1]
    assert batch["num_loss_tokens"] == 3
    assert batch["row_group_ids"].tolist() == [5, 5]


def batch_of(seed: int, packs: int, align: int):
    rng = np.random.default_rng(seed)
    items, gid = [], 0
    for _ in range(packs):
        items.append(random_items(rng, first_gid=gid))
        gid += sum(len(rows_of([it])) for it in items[-1])
    # every other pack holds 4 tokens of tail padding past its padded segments
    built = [tree_pack(it, align=align, length=None if k % 2 else 4 + len(tree_pack(it, align=align)["input_ids"]))
             for k, it in enumerate(items)]
    return items, built


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 4))
def test_every_row_comes_back_with_its_targets(seed, packs, align):
    items, built = batch_of(seed, packs, align)
    batch = collate_tree(built)
    source = [row for it in items for row in rows_of(it)]
    tokens, labels = batch["input_ids"][0], batch["labels"][0]
    offsets = batch["row_offsets"].tolist()
    assert batch["row_sample_ids"].tolist() == [r.gid for r in source]
    for k, row in enumerate(source):
        at = batch["row_positions"][offsets[k]:offsets[k + 1]]
        assert tokens[at].tolist() == row.tokens
        assert labels[at].tolist() == row.packed_labels
        assert batch["position_ids"][0][at].tolist() == list(range(len(row.tokens)))
        assert batch["row_targets"][offsets[k]:offsets[k + 1]].tolist() == row.packed_labels[1:] + [I]
        assert batch["row_loss_tokens"][k] == sum(v != I for v in row.packed_labels[1:])


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 4))
def test_the_dense_mask_is_each_packs_rule_on_the_diagonal(seed, packs, align):
    _, built = batch_of(seed, packs, align)
    batch = collate_tree(built)
    blocks = [visible(p["parent_segments"], p["seq_lens"], p["seq_lens_padded"]) for p in built]
    expected = np.zeros((sum(len(b) for b in blocks),) * 2, bool)
    at = 0
    for b in blocks:
        expected[at:at + len(b), at:at + len(b)] = b
        at += len(b)
    mask = tree_attention_mask(batch)
    assert mask.shape == (1, 1, *expected.shape) and mask.dtype == torch.bool
    assert (mask[0, 0].numpy() == expected).all()
    additive = tree_attention_mask(batch, dtype=torch.float32)[0, 0]
    assert (additive[torch.from_numpy(expected)] == 0).all()
    assert (additive[torch.from_numpy(~expected)] == torch.finfo(torch.float32).min).all()


def test_the_block_mask_is_the_dense_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    _, built = batch_of(3, 2, 2)
    batch = collate_tree(built)
    block = tree_block_mask(batch, block_size=16)
    dense = tree_attention_mask(batch)[0, 0]
    total = dense.shape[-1]
    q, k = torch.meshgrid(torch.arange(total), torch.arange(total), indexing="ij")
    assert torch.equal(block.mask_mod(0, 0, q, k), dense)
    # a block the BlockMask skips holds no visible pair
    blocks = block.to_dense()[0, 0].bool()
    assert not (dense & ~blocks.repeat_interleave(16, 0).repeat_interleave(16, 1)[:total, :total]).any()


def reference_losses(logits: torch.Tensor, items, built) -> list[torch.Tensor]:
    """Each row's target losses, its positions in the batch found from the items' structure: a
    group's row is the prefix segment's tokens and then its own branch."""
    out, base = [], 0
    for its, pack in zip(items, built):
        starts = np.asarray(pack["cu_seqlens_padded"])[:-1] + base
        segment = 0
        for item in its:
            if isinstance(item, Row):
                parts = [(segment, len(item.tokens))]
                groups = [(item, parts)]
                segment += 1
            else:
                prefix, segment = segment, segment + 1
                groups = []
                for row in sorted(item.rows, key=lambda r: r.gid):
                    groups.append((row, [(prefix, item.p - 1), (segment, len(row.tokens) - item.p + 1)]))
                    segment += 1
            for row, parts in groups:
                at = torch.cat([torch.arange(n) + int(starts[s]) for s, n in parts])
                targets = torch.tensor(row.packed_labels[1:], dtype=torch.long)
                valid = targets != I
                out.append(torch.nn.functional.cross_entropy(logits[at[:-1]][valid], targets[valid],
                                                             reduction="none"))
        base += len(pack["input_ids"])
    return out


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 4))
def test_losses_are_each_rows_own(seed, packs, align):
    items, built = batch_of(seed, packs, align)
    batch = collate_tree(built)
    logits = torch.randn(1, batch["input_ids"].shape[1], 50, generator=torch.Generator().manual_seed(seed))
    per_row = reference_losses(logits[0], items, built)
    total = sum(len(r) for r in per_row)
    flat = torch.cat(per_row)
    assert torch.allclose(tree_loss(logits, batch), flat.sum() / max(total, 1), atol=1e-6)
    means = [r.mean() for r in per_row if len(r)]
    expected_row = torch.stack(means).sum() / len(means) if means else torch.tensor(0.0)
    assert torch.allclose(tree_loss(logits, batch, "row"), expected_row, atol=1e-6)
    sums, counts = row_logprobs(logits, batch)
    assert counts.tolist() == [len(r) for r in per_row]
    assert torch.allclose(sums, torch.stack([-r.sum() for r in per_row]), atol=1e-5)


def test_a_flat_pack_has_loss_fns_loss():
    rows = [Row(0, [5, 6, 7, 8], [I, I, 7, 8]), Row(1, [9, 3, 4]), Row(2, [2])]
    pack = tree_pack(rows, align=4)
    del pack["parent_segments"]  # a pack of an output without shared groups
    logits = torch.randn(1, len(pack["input_ids"]), 20, generator=torch.Generator().manual_seed(0))
    batch = collate_tree([pack])
    assert torch.allclose(tree_loss(logits, batch), loss_fn(logits, collate_flash_attn([pack])))
    assert torch.allclose(tree_loss(logits, batch, "row"), loss_fn(logits, collate_flash_attn([pack]), "sequence"))


def test_weights_and_denominator():
    pack = example_pack()
    pack["seq_weights"] = np.array([0.0, 2.0, 0.5])  # the prefix's weight is never used
    logits = torch.randn(1, 8, 20, generator=torch.Generator().manual_seed(1))
    batch = collate_tree([pack])
    losses = reference_losses(logits[0], [example_items()], [pack])
    assert torch.allclose(tree_loss(logits, batch, denominator=10),
                          (2.0 * losses[0].sum() + 0.5 * losses[1].sum()) / 10)
    assert torch.allclose(tree_loss(logits, batch, "row"), (2.0 * losses[0].mean() + 0.5 * losses[1].mean()) / 2)


def test_the_step_counts_travel_and_normalize_the_loss():
    """With --dp-size each pack carries its step's counts (of rows): collate_tree passes them on
    and tree_loss divides by them, as loss_fn does; `denominator` still wins."""
    steps = {"step": 3, "micro_batch": 1, "step_loss_tokens": 12, "step_loss_sequences": 5}
    pack = {**example_pack(), **steps}
    logits = torch.randn(1, 8, 20, generator=torch.Generator().manual_seed(2))
    batch = collate_tree([pack])
    assert {k: batch[k] for k in steps} == steps
    losses = reference_losses(logits[0], [example_items()], [pack])
    assert torch.allclose(tree_loss(logits, batch), (losses[0].sum() + losses[1].sum()) / 12)
    assert torch.allclose(tree_loss(logits, batch, "row"), (losses[0].mean() + losses[1].mean()) / 5)
    assert torch.allclose(tree_loss(logits, batch, denominator=4), (losses[0].sum() + losses[1].sum()) / 4)
    with pytest.raises(ValueError, match="packs of steps \\[3, 4\\]"):
        collate_tree([pack, {**pack, "step": 4}])


def test_a_forward_parent_names_the_pack_and_segment():
    good, bad = example_pack(), example_pack()
    bad["parent_segments"] = np.array([-1, 2, 0], np.int32)
    with pytest.raises(ValueError, match="pack 1 of the batch: parent_segments: segment 1 names the later segment 2"):
        collate_tree([good, bad])
    with pytest.raises(ValueError, match="mode 'sequence'"):
        tree_loss(torch.zeros(1, 8, 20), collate_tree([good]), "sequence")


@pytest.mark.parametrize("collate", [collate_flash_attn, collate_hf, collate_thd])
def test_the_flat_collates_refuse_a_tree_pack(collate):
    flat = tree_pack([Row(0, [5, 6, 7]), Row(1, [8, 9])])  # parent_segments [-1, -1]: collates
    assert collate([flat])["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    with pytest.raises(PackctlError, match="shared-prefix pack .* collate it with collate_tree"):
        collate([flat, example_pack()])

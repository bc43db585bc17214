"""Proof on a real model that training on shared-prefix packs equals training on the rows unshared:
a Hugging Face Llama (random weights, fp32, CPU) over tree packs built per the layout
(tests/support/trees.py), with collate_tree's 4-D mask, gives every row the logits, the SFT loss
and the gradients of a DPO and a GRPO loss that it gets when it runs each row alone.

The packs mix DPO pairs (a prompt, then a chosen and a rejected answer), a GRPO group of six
rollouts of one prompt, and flat rows; prompts are masked (-100 labels), one group's prompt is
not, so the target at the prefix's last position (shared by every branch) counts once per row.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from packctl.torch import (collate_flash_attn, collate_tree, loss_fn, row_logprobs, tree_block_mask,  # noqa: E402
                           tree_loss)
from support.tiny_llama import (ATTENTION, TOLERANCE, alone as run_alone, assert_close, assert_same_grads,  # noqa: E402
                                dpo_loss, grads, grpo_loss, packed_logits, tiny_llama,
                                unshared_logps as unshared_row_logps)
from support.trees import IGNORE_INDEX, Group, Row, rows_of, tree_pack  # noqa: E402

VOCAB = 300

pytestmark = pytest.mark.slow  # a proof on a real model (tiny Llama, CPU); transformers loads in seconds


def prompt_rows(rng, first_gid: int, rows: int, prompt: int, *, masked: bool = True) -> Group:
    """`rows` answers of 1..12 tokens to one prompt; the prompt's labels -100 when `masked`."""
    shared = rng.integers(1, VOCAB, prompt).tolist()
    out = []
    for k in range(rows):
        tokens = shared + rng.integers(1, VOCAB, int(rng.integers(1, 13))).tolist()
        labels = [IGNORE_INDEX] * prompt + tokens[prompt:] if masked else None
        out.append(Row(first_gid + k, tokens, labels))
    return Group(out, prompt)


def corpus():
    """Two packs (align 4, the second with tail padding): DPO pairs, a GRPO group, flat rows."""
    rng = np.random.default_rng(7)
    first = [prompt_rows(rng, 0, 2, 9), Row(2, rng.integers(1, VOCAB, 11).tolist()), prompt_rows(rng, 3, 2, 5),
             prompt_rows(rng, 5, 2, 7, masked=False)]
    second = [prompt_rows(rng, 7, 6, 13), Row(13, rng.integers(1, VOCAB, 4).tolist()), prompt_rows(rng, 14, 2, 3)]
    items = [first, second]
    packs = [tree_pack(first, align=4), tree_pack(second, align=4, length=160)]
    return items, packs


@pytest.fixture(scope="module")
def data():
    items, packs = corpus()
    return [row for its in items for row in rows_of(its)], collate_tree(packs), packs


def alone(model, row: Row):
    """The row run by itself: (logits [n, V], per-target log p, valid [n-1])."""
    return run_alone(model, row.tokens, row.packed_labels)


@pytest.mark.parametrize("attn, mask_dtype", ATTENTION)
def test_every_row_gets_its_own_logits_and_sft_loss(data, attn, mask_dtype):
    rows, batch, _ = data
    assert len(rows) == 16 and batch["num_loss_tokens"] > 0
    model = tiny_llama(0, attn)
    logits = packed_logits(model, batch, mask_dtype)
    offsets = batch["row_offsets"].tolist()
    for k, row in enumerate(rows):
        at = batch["row_positions"][offsets[k]:offsets[k + 1]]
        own = alone(model, row)[0]
        assert float((logits[0, at] - own).abs().max()) <= TOLERANCE * max(1.0, float(own.abs().max())), row.gid
    for mode in ("token", "row"):
        packed = tree_loss(packed_logits(model, batch, mask_dtype), batch, mode)
        packed.backward()
        packed_grads = grads(model)
        parts = [-alone(model, row)[1] for row in rows]
        if mode == "token":
            unshared = torch.cat(parts).sum() / sum(len(p) for p in parts)
        else:
            means = [p.mean() for p in parts if len(p)]
            unshared = torch.stack(means).sum() / len(means)
        unshared.backward()
        assert_close(packed, unshared)
        assert_same_grads(packed_grads, grads(model))


def unshared_logps(model, rows) -> tuple[torch.Tensor, torch.Tensor]:
    return unshared_row_logps(model, [(row.tokens, row.packed_labels) for row in rows])


@pytest.mark.parametrize("attn, mask_dtype", ATTENTION)
def test_dpo_and_grpo_gradients_equal_those_of_the_unshared_rows(data, attn, mask_dtype):
    rows, batch, _ = data
    model, reference = tiny_llama(0, attn), tiny_llama(1, attn)
    gids = [row.gid for row in rows]
    assert batch["row_sample_ids"].tolist() == gids
    pairs = [(gids.index(c), gids.index(r)) for c, r in ((0, 1), (3, 4), (5, 6), (14, 15))]
    group = [gids.index(g) for g in range(7, 13)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
    with torch.no_grad():
        ref_packed = row_logprobs(packed_logits(reference, batch, mask_dtype), batch)[0]
        ref_alone = unshared_logps(reference, rows)[0]
    assert float((ref_packed - ref_alone).abs().max()) <= TOLERANCE * float(ref_alone.abs().max())

    logps, counts = row_logprobs(packed_logits(model, batch, mask_dtype), batch)
    assert counts.tolist() == unshared_logps(model, rows)[1].tolist()
    packed_dpo = dpo_loss(logps, ref_packed, pairs)
    packed_grpo = grpo_loss(logps, counts, group, rewards)
    packed_dpo.backward(retain_graph=True)
    dpo_grads = grads(model)
    packed_grpo.backward()
    grpo_grads = grads(model)

    logps_alone, counts_alone = unshared_logps(model, rows)
    dpo = dpo_loss(logps_alone, ref_alone, pairs)
    dpo.backward(retain_graph=True)
    assert_close(packed_dpo, dpo)
    assert_same_grads(dpo_grads, grads(model))
    grpo = grpo_loss(logps_alone, counts_alone, group, rewards)
    grpo.backward()
    assert_close(packed_grpo, grpo)
    assert_same_grads(grpo_grads, grads(model))


def test_the_flat_shift_over_a_tree_pack_is_wrong(data):
    """Read as flat packs (block-causal over the stored segments, loss_fn's shift: what a reader
    that ignores parent_segments does, and why collate_flash_attn refuses them), tree packs give
    another loss: the tree needs its own mask and gather."""
    rows, batch, packs = data
    model = tiny_llama(0, "sdpa")
    tree = tree_loss(packed_logits(model, batch, torch.bool), batch)
    flat = collate_flash_attn([{k: v for k, v in p.items() if k != "parent_segments"} for p in packs])
    blocks = torch.block_diag(*[torch.tril(torch.ones(n, n, dtype=torch.bool))
                                for n in np.diff(flat["cu_seqlens"].numpy())])
    logits = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"], attention_mask=blocks[None, None],
                   use_cache=False).logits
    unshared = torch.stack([-alone(model, row)[1].sum() for row in rows]).sum() / batch["num_loss_tokens"]
    assert_close(tree, unshared)
    assert abs(float(loss_fn(logits, flat)) - float(unshared)) > 1e-3


def test_flex_attention_with_the_block_mask_is_each_row_alone(data):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    rows, batch, _ = data
    total = batch["input_ids"].shape[1]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, total, 16, generator=generator) for _ in range(3))
    try:
        out = flex.flex_attention(q, k, v, block_mask=tree_block_mask(batch, block_size=32))
    except Exception as exc:  # noqa: BLE001 (a torch without a CPU FlexAttention path)
        pytest.skip(f"FlexAttention does not run on this CPU torch {torch.__version__}: {exc}")
    offsets = batch["row_offsets"].tolist()
    for r in range(len(rows)):
        at = batch["row_positions"][offsets[r]:offsets[r + 1]]
        alone_out = torch.nn.functional.scaled_dot_product_attention(q[:, :, at], k[:, :, at], v[:, :, at],
                                                                     is_causal=True)
        assert float((out[:, :, at] - alone_out).abs().max()) <= TOLERANCE


def pairs_corpus():
    """One pack of four preference pairs (chosen first), prompts of 3 to 9 tokens."""
    rng = np.random.default_rng(11)
    groups = [prompt_rows(rng, 2 * k, 2, prompt) for k, prompt in enumerate((9, 3, 6, 4))]
    return [row for g in groups for row in g.rows], collate_tree([tree_pack(groups, align=4)])


def test_the_documented_recipes_run_and_equal_the_unshared_losses():
    """The `tree-sft` and `tree-dpo` blocks of docs/training.md as written (an optimizer with
    lr 0, so their last loss is comparable with the unshared one)."""
    from support.docs import run_docs_block

    rows, batch = pairs_corpus()
    model, reference = tiny_llama(0, "sdpa"), tiny_llama(1, "sdpa")
    namespace = {"torch": torch, "loader": [batch], "model": model, "ref_model": reference,
                 "optimizer": torch.optim.SGD(model.parameters(), lr=0.0)}
    sft = run_docs_block("tree-sft", dict(namespace))["loss"]
    parts = [-alone(model, row)[1] for row in rows]
    assert_close(sft, torch.cat(parts).sum() / sum(len(p) for p in parts))
    dpo = run_docs_block("tree-dpo", dict(namespace))["loss"]
    with torch.no_grad():
        ref = unshared_logps(reference, rows)[0]
        unshared = dpo_loss(unshared_logps(model, rows)[0], ref, [(0, 1), (2, 3), (4, 5), (6, 7)])
    assert_close(dpo, unshared)

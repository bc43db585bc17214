"""Shared-prefix packs as `packctl pack --share-prefix` writes them, read back and trained on: the
packs PackedDataset yields are the ones tests/support/trees.py builds by hand from the same groups,
and a tiny Llama over `packctl tokenize` -> pack -> PackedDataset -> collate_tree gives every row
its own logits, the gradients of a DPO loss and of a GRPO loss of the rows run alone, and per step
the loss of the rows packed flat (the loss columns of a tree count rows: docs/format.md).
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from packctl.torch import (PackedDataset, collate_flash_attn, collate_tree, loss_fn, row_logprobs,  # noqa: E402
                           tree_loss)
from support.adversary import packctl  # noqa: E402
from support.data import write_table  # noqa: E402
from support.runs import pack_to  # noqa: E402
from support.tiny_llama import (TOLERANCE, alone, assert_close, assert_same_grads, dpo_loss, grads,  # noqa: E402
                                grpo_loss, packed_logits, tiny_llama, unshared_logps)
from support.tokenizers import tokenizer_dir  # noqa: E402
from support.trees import IGNORE_INDEX, Group, Row, common_prefix, tree_pack  # noqa: E402

VOCAB = 512  # the test tokenizer's ids (a BPE of 400 and its special tokens) fit
ALIGN = 4


# ---------------------------------------------------------------- pack output == hand-built packs


def _dpo_corpus(rng, pairs: int) -> dict[str, list]:
    """Preference pairs: a masked prompt, two answers; some answers begin alike (their common
    prefix runs past the prompt), so `prompt_length` bounds what the pair shares; flat rows between."""
    ids, labels, group, prompt_length = [], [], [], []
    for k in range(pairs):
        prompt = rng.integers(1, 300, int(rng.integers(2, 12))).tolist()
        alike = rng.integers(1, 300, int(rng.integers(0, 3))).tolist()
        for _ in range(2):
            tokens = prompt + alike + rng.integers(1, 300, int(rng.integers(1, 9))).tolist()
            ids.append(tokens), labels.append([IGNORE_INDEX] * len(prompt) + tokens[len(prompt):])
            group.append(2 * k), prompt_length.append(len(prompt))
        if k % 3 == 0:  # a group of one, stored flat
            tokens = rng.integers(1, 300, int(rng.integers(1, 15))).tolist()
            ids.append(tokens), labels.append(tokens), group.append(2 * k + 1), prompt_length.append(0)
    return {"input_ids": ids, "labels": labels, "g": group, "prompt_length": prompt_length}


def _grpo_corpus(rng, groups: int) -> dict[str, list]:
    """Groups of 3 to 6 rollouts of one prompt, every third prompt trained on (labels are tokens)."""
    ids, labels, group = [], [], []
    for k in range(groups):
        prompt = rng.integers(1, 300, int(rng.integers(2, 20))).tolist()
        for _ in range(int(rng.integers(3, 7))):
            tokens = prompt + rng.integers(1, 300, int(rng.integers(1, 10))).tolist()
            ids.append(tokens), group.append(k)
            labels.append(tokens if k % 3 == 0 else [IGNORE_INDEX] * len(prompt) + tokens[len(prompt):])
    return {"input_ids": ids, "labels": labels, "g": group}


def _expected_pack(pack, corpus, bound) -> dict[str, np.ndarray]:
    """The pack tests/support/trees.py builds of the groups `pack` holds, in its order, each with
    the prefix its rows share (at most `bound`, --prefix-column), from the corpus alone."""
    rows_of_group: dict[int, list[Row]] = {}
    for gid, (tokens, labels, g) in enumerate(zip(corpus["input_ids"], corpus["labels"], corpus["g"])):
        rows_of_group.setdefault(g, []).append(Row(gid, tokens, labels))
    group_of = {row.gid: g for g, rows in rows_of_group.items() for row in rows}
    items, seen = [], set()
    for sid in pack["sample_ids"].tolist():
        if sid < 0 or group_of[sid] in seen:
            continue
        seen.add(group_of[sid])
        rows = rows_of_group[group_of[sid]]
        p = common_prefix(rows) if len(rows) > 1 else 0
        if bound is not None and len(rows) > 1:
            p = min(p, min(bound[r.gid] for r in rows))
        items += [Group(rows, p)] if len(rows) > 1 and p >= 2 else rows
    return tree_pack(items, align=ALIGN, length=len(pack["input_ids"]))


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_pack_share_prefix_reads_back_as_the_packs_built_by_hand(tmp_path, kind):
    rng = np.random.default_rng(5)
    corpus = _dpo_corpus(rng, 24) if kind == "dpo" else _grpo_corpus(rng, 10)
    src = write_table(tmp_path / "in.parquet", corpus)
    bound = corpus.get("prompt_length")
    _, out = pack_to(tmp_path, [src], capacity=160, group_column="g", share_prefix=True, seq_multiple=ALIGN,
                     prefix_column="prompt_length" if bound else None)
    dataset = PackedDataset(out)
    packs = [dataset[i] for i in range(len(dataset))]
    assert sum(int((p["parent_segments"] >= 0).sum()) for p in packs) >= 10  # branches, not only flat rows
    seen = []
    for pack in packs:
        expected = _expected_pack(pack, corpus, bound)
        for name, values in expected.items():
            assert np.array_equal(np.asarray(pack[name]), values), (pack["index"], name)
        seen += [s for s in pack["sample_ids"].tolist() if s >= 0]
    assert sorted(seen) == list(range(len(corpus["input_ids"])))


# ---------------------------------------------------------------- tokenize -> pack -> collate_tree -> model


def _tokenized(tmp_path, records: list[dict], *options: str):
    """`packctl tokenize` of JSONL records: (its folder, its rows: input_ids, labels, ... by sample id)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "tokenized"
    tok = tokenizer_dir(tmp_path / "tok")
    result = packctl("tokenize", raw, "-o", out, "--tokenizer", tok, "--workers", "1", "-q", *options)
    assert result.code == 0, result.stderr
    files = sorted((out / "data").glob("*.parquet"))  # sample ids follow the files in path order
    rows = {name: [v for f in files for v in pq.read_table(f).column(name).to_pylist()]
            for name in pq.read_schema(files[0]).names}
    assert max(max(ids) for ids in rows["input_ids"]) < VOCAB
    return out, rows


def _row(rows, gid: int) -> tuple[list[int], list[int]]:
    """Sample `gid` unshared: its tokens and its labels as a pack holds them (first -100)."""
    return rows["input_ids"][gid], [IGNORE_INDEX] + rows["labels"][gid][1:]


def _assert_rows_see_their_own_logits(model, batch, rows):
    logits = packed_logits(model, batch, torch.bool)
    offsets = batch["row_offsets"].tolist()
    for k, gid in enumerate(batch["row_sample_ids"].tolist()):
        own = alone(model, *_row(rows, gid))[0]
        at = batch["row_positions"][offsets[k]:offsets[k + 1]]
        assert float((logits[0, at] - own).abs().max()) <= TOLERANCE * max(1.0, float(own.abs().max())), gid


PREFERENCES = [{"prompt": [{"role": "user", "content": f"is {i} even? answer in one word, then say why"}],
                "chosen": [{"role": "assistant", "content": "yes, it is" if i % 2 == 0 else "no, it is odd"}],
                "rejected": [{"role": "assistant", "content": "yes, the sky is blue" if i % 2 else "no"}]}
               for i in range(12)]


@pytest.mark.slow
def test_tokenized_preference_pairs_train_with_the_dpo_gradients_of_the_rows_alone(tmp_path):
    tokenized, rows = _tokenized(tmp_path, PREFERENCES)
    assert rows["chosen"] == [True, False] * len(PREFERENCES)
    _, out = pack_to(tmp_path, [tokenized], capacity=256, group_column="record_id", share_prefix=True,
                     prefix_column="prompt_length", seq_multiple=ALIGN)
    verified = packctl("verify", out, "--source", tokenized)  # the worked example of docs/shared-prefix.md
    assert verified.code == 0 and "verdict: ok" in verified.stdout, verified.stdout + verified.stderr
    stats = packctl("stats", out)
    assert stats.code == 0 and "shared prefixes" in stats.stdout, stats.stdout + stats.stderr
    batch = collate_tree([p for p in PackedDataset(out)])
    gids = batch["row_sample_ids"].tolist()
    assert sorted(gids) == list(range(2 * len(PREFERENCES)))
    assert batch["num_loss_tokens"] == sum(sum(v != IGNORE_INDEX for v in labels[1:]) for labels in rows["labels"])
    assert int((batch["parent_segments"] >= 0).sum()) == len(gids)  # every pair shares its prompt
    model, reference = tiny_llama(0, "sdpa", VOCAB), tiny_llama(1, "sdpa", VOCAB)
    _assert_rows_see_their_own_logits(model, batch, rows)

    unshared = [_row(rows, gid) for gid in gids]
    pairs = [(gids.index(2 * r), gids.index(2 * r + 1)) for r in range(len(PREFERENCES))]  # chosen, rejected
    assert all(rows["record_id"][gids[c]] == rows["record_id"][gids[r]] and rows["chosen"][gids[c]]
               for c, r in pairs)
    with torch.no_grad():
        ref_packed = row_logprobs(packed_logits(reference, batch, torch.bool), batch)[0]
        ref_alone = unshared_logps(reference, unshared)[0]
    assert float((ref_packed - ref_alone).abs().max()) <= TOLERANCE * float(ref_alone.abs().max())
    logps, counts = row_logprobs(packed_logits(model, batch, torch.bool), batch)
    packed = dpo_loss(logps, ref_packed, pairs)
    packed.backward()
    packed_grads = grads(model)
    logps_alone, counts_alone = unshared_logps(model, unshared)
    assert counts.tolist() == counts_alone.tolist()
    expected = dpo_loss(logps_alone, ref_alone, pairs)
    expected.backward()
    assert_close(packed, expected)
    assert_same_grads(packed_grads, grads(model))


ROLLOUTS = [{"prompt": f"task {g}: name a color of the sea or the sky", "completion": f" try {k} {'blue' * (k % 3)}",
             "prompt_id": f"p{g}", "reward": float((g + k) % 3) / 2}
            for g in range(5) for k in range(4)]


@pytest.mark.slow
def test_tokenized_rollouts_train_with_the_grpo_gradients_and_the_step_loss_of_the_rows(tmp_path):
    # --loss-on all: the prompt is trained on too, so a row's targets reach into its shared prefix
    tokenized, rows = _tokenized(tmp_path, ROLLOUTS, "--group-column", "prompt_id", "--loss-on", "all")
    _, out = pack_to(tmp_path, [tokenized], capacity=96, group_column="prompt_id", share_prefix=True,
                     prefix_column="prompt_length", seq_multiple=ALIGN, dp_size=2, micro_batches=2)
    packs = list(PackedDataset(out))
    steps = ("step", "micro_batch", "step_loss_tokens", "step_loss_sequences")
    batch = collate_tree([{k: v for k, v in p.items() if k not in steps} for p in packs])  # every step at once
    gids = batch["row_sample_ids"].tolist()
    assert sorted(gids) == list(range(len(ROLLOUTS)))
    model = tiny_llama(0, "sdpa", VOCAB)
    _assert_rows_see_their_own_logits(model, batch, rows)

    # GRPO, a token mean per rollout, each prompt's group of four
    unshared = [_row(rows, gid) for gid in gids]
    rewards = torch.tensor([ROLLOUTS[gid]["reward"] for gid in gids])
    logps, counts = row_logprobs(packed_logits(model, batch, torch.bool), batch)
    groups = [[k for k, gid in enumerate(gids) if rows["prompt_id"][gid] == f"p{g}"] for g in range(5)]
    packed = sum(grpo_loss(logps, counts, group, rewards[group]) for group in groups)
    packed.backward()
    packed_grads = grads(model)
    logps_alone, counts_alone = unshared_logps(model, unshared)
    expected = sum(grpo_loss(logps_alone, counts_alone, group, rewards[group]) for group in groups)
    expected.backward()
    assert_close(packed, expected)
    assert_same_grads(packed_grads, grads(model))

    # per step: the tree's micro-batches, each divided by the step's counts, sum to the step's rows
    # packed flat under loss_fn (the step's flat counts: each row's targets, prefix included)
    assert max(sum(p["step"] == s for p in packs) for s in {p["step"] for p in packs}) > 1  # micro-batches
    for step in sorted({p["step"] for p in packs}):
        tree_packs = [p for p in packs if p["step"] == step]
        step_rows = [_row(rows, s) for p in tree_packs for s in p["sample_ids"].tolist() if s >= 0]
        flat = tree_pack([Row(k, tokens, labels) for k, (tokens, labels) in enumerate(step_rows)])
        assert all(p["step_loss_tokens"] == flat["num_loss_tokens"] for p in tree_packs)
        assert all(p["step_loss_sequences"] == int((flat["seq_loss_tokens"] > 0).sum()) for p in tree_packs)
        for mode, flat_mode in (("token", "token"), ("row", "sequence")):
            tree_sum = sum(tree_loss(packed_logits(model, collate_tree([p]), torch.bool), collate_tree([p]), mode)
                           for p in tree_packs)
            flat_batch = collate_flash_attn([flat])
            blocks = torch.block_diag(*[torch.tril(torch.ones(n, n, dtype=torch.bool))
                                        for n in np.diff(flat_batch["cu_seqlens"].numpy())])
            logits = model(input_ids=flat_batch["input_ids"], position_ids=flat_batch["position_ids"],
                           attention_mask=blocks[None, None], use_cache=False).logits
            assert_close(tree_sum, loss_fn(logits, flat_batch, flat_mode))

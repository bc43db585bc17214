"""Proof on a real model that packing changes nothing: a Hugging Face Llama (random weights, fp32,
CPU) trained on packs of sample_data gets the same per-token losses, loss and parameter gradients
as when it runs each sequence alone, read from the source Parquet. Also: the collate functions feed
it correctly, a THD batch split over context-parallel ranks sums to the same loss, and collates
that get the layout wrong (positions not reset, boundaries ignored) break the equality.

Two outputs: cp 1 with every pack padded to the capacity (tail padding), and cp 2 with each
sequence padded to a multiple of 4 (alignment padding). Both split the sequences longer than the
capacity, and sample_data masks a prompt in about half of its rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.runs import pack_to  # noqa: E402
from packctl.torch import (PackedDataset, block_causal_mask, collate_flash_attn, collate_hf,  # noqa: E402
                           collate_thd, cp_slice)
from support.torch_proof import (IGNORE_INDEX, Piece, Run, max_differences, packed_run, seq_starts_of,  # noqa: E402
                         source_pieces, tiny_llama, unpacked_run)

pytestmark = pytest.mark.slow  # a proof on a real model (tiny Llama, CPU)

TOLERANCE = 1e-5
LAYOUTS = {
    "cp1": dict(capacity=256, too_long="split"),
    "cp2": dict(capacity=256, cp_size=2, pad_to="multiple", too_long="split"),
}


@dataclass
class Case:
    name: str
    out: Path
    packs: list[dict]  # the packs collated into one batch
    pieces: list[Piece]  # their sequences, from the source, in pack order
    reference: Run  # each sequence alone


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return tiny_llama(seed=0)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def case(request, tmp_path_factory, sample_data, model) -> Case:
    _, out = pack_to(tmp_path_factory.mktemp(request.param), [sample_data], **LAYOUTS[request.param])
    dataset = PackedDataset(out)
    # two packs holding several sequences each: boundaries inside packs and between them
    chosen = [i for i in range(len(dataset)) if len(dataset[i]["seq_lens"]) >= 4][:2]
    pieces = [p for per_pack in source_pieces(out, chosen) for p in per_pack]
    return Case(request.param, out, [dataset[i] for i in chosen], pieces, unpacked_run(model, pieces))


def _assert_equal(run: Run, reference: Run):
    diff = max_differences(run, reference)
    assert max(diff.values()) <= TOLERANCE, diff
    return diff


def test_the_batches_cover_masked_prompts_split_pieces_and_padding(case):
    assert any((p.labels[1:] == IGNORE_INDEX).any() for p in case.pieces), "no masked prompt"
    assert any(p.start > 0 for p in case.pieces), "no later piece of a split sequence"
    padding = sum(len(p["input_ids"]) - p["num_tokens"] for p in case.packs)
    assert padding > 0
    if case.name == "cp2":
        inner = [p["seq_lens_padded"][:-1] - p["seq_lens"][:-1] for p in case.packs]
        assert any((gap > 0).any() for gap in inner), "no alignment padding between sequences"
        assert all((p["seq_lens_padded"] % 4 == 0).all() for p in case.packs)


def test_flash_attn_batch_equals_each_sequence_alone(case, model):
    """collate_flash_attn -> document-masked attention from its cu_seqlens (SDPA on CPU)."""
    batch = collate_flash_attn(case.packs)
    mask = block_causal_mask(batch["cu_seqlens"])[None, None]
    run = packed_run(model, {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                             "attention_mask": mask}, batch["labels"], seq_starts_of(case.packs))
    _assert_equal(run, case.reference)


def test_hf_padding_free_batch_equals_each_sequence_alone(case, model):
    """collate_hf passed whole to the model: boundaries come from position_ids (use_cache=False)."""
    batch = collate_hf(case.packs)
    run = packed_run(model, dict(batch, use_cache=False), batch["labels"], seq_starts_of(case.packs))
    _assert_equal(run, case.reference)
    assert abs(float(run.model_loss) - float(case.reference.loss)) <= TOLERANCE


def test_thd_batch_split_over_cp_ranks_sums_to_the_same_loss(case, model):
    """collate_thd's shifted labels and loss_mask, cut by cp_slice, give each rank its share of the loss."""
    batch = collate_thd(case.packs)
    mask = block_causal_mask(batch["cu_seqlens_padded"])[None, None]
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=mask).logits
    cp_size = 2 if case.name == "cp2" else 1
    total, count = torch.zeros(()), torch.zeros(())
    for rank in range(cp_size):
        part = cp_slice(dict(batch, logits=logits), cp_size, rank)
        assert part["tokens"].shape[1] == batch["tokens"].shape[1] // cp_size
        losses = torch.nn.functional.cross_entropy(part["logits"][0], part["labels"][0].clamp(min=0),
                                                   reduction="none")
        total += (losses * part["loss_mask"][0]).sum()
        count += part["loss_mask"].sum()
    assert int(count) == len(case.reference.per_token)
    assert abs(float(total / count) - float(case.reference.loss)) <= TOLERANCE


def test_wrong_collates_break_the_equality(case, model):
    """The proof can fail: positions that run on across sequences, or boundaries left out."""
    batch = collate_hf(case.packs)
    starts, length = seq_starts_of(case.packs), batch["input_ids"].shape[1]
    tokens = {"input_ids": batch["input_ids"]}
    runs = {
        "position_ids not reset": dict(tokens, position_ids=torch.arange(length)[None], use_cache=False),
        "cu_seqlens ignored": dict(tokens, position_ids=batch["position_ids"],
                                   attention_mask=block_causal_mask([0, length])[None, None]),
        # not a collate error but the pitfall docs/training.md warns of: with a KV cache the model
        # does not look for boundaries in position_ids
        "model cache left on": dict(batch, use_cache=True),
    }
    for name, inputs in runs.items():
        diff = max_differences(packed_run(model, inputs, batch["labels"], starts, backward=False), case.reference)
        assert diff["per_token"] > 1e-2 and diff["loss"] > 1e-4, (name, diff)


def test_collate_hf_is_what_the_hf_collator_gives(tmp_path, sample_data):
    """Without padding (cp 1, packs rounded to a multiple of 1), collate_hf over the packs equals
    transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True) over their sequences."""
    from transformers import DataCollatorWithFlattening

    _, out = pack_to(tmp_path, [sample_data], capacity=512, pad_to="multiple", too_long="split")
    dataset = PackedDataset(out)
    chosen = [i for i in range(len(dataset)) if len(dataset[i]["seq_lens"]) >= 3][:3]
    packs = [dataset[i] for i in chosen]
    assert all(len(p["input_ids"]) == p["num_tokens"] for p in packs)
    features = [{"input_ids": p.tokens.tolist(), "labels": p.labels.tolist()}
                for per_pack in source_pieces(out, chosen) for p in per_pack]
    expected = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features, return_tensors="pt")
    got = collate_hf(packs)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if torch.is_tensor(value):
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            assert torch.equal(got[name], value), name
        else:
            assert type(got[name]) is type(value) and got[name] == value, name
    assert np.array_equal(expected["cu_seq_lens_q"].numpy()[-1], sum(p["num_tokens"] for p in packs))

"""packctl.torch with an output packed with --limit: every item carries COL (per sequence) and
COL_sum (per pack), every collate function returns them per batch (COL int64 [S] aligned with
the sequences, COL_sum int64 [B]), and a plan reads as its materialized output."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from packctl.sample import SampleSpec, write_sample  # noqa: E402
from packctl.torch import (PackedDataset, collate_flash_attn, collate_hf, collate_thd, cp_slice,  # noqa: E402
                           split_limit_fields)
from support.adversary import packctl  # noqa: E402
from support.runs import pack_to  # noqa: E402

LIMITS = {"images": 4, "image_tokens": 1728}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm") / "in"
    write_sample(root, SampleSpec(sequences=400, shards=2, max_length=4096, modality="image", seed=7))
    return root


@pytest.fixture(scope="module")
def out(vlm, tmp_path_factory) -> Path:
    _, path = pack_to(tmp_path_factory.mktemp("out"), [vlm], capacity=4096, limits=LIMITS, too_long="drop",
                      cp_size=2, shard_rows=20)
    return path


def _source_values(vlm: Path) -> dict[str, np.ndarray]:
    """Each limited column of the input, by sample id (the files in name order)."""
    tables = [pq.read_table(p, columns=list(LIMITS)) for p in sorted(vlm.glob("*.parquet"))]
    return {c: np.concatenate([t.column(c).to_numpy() for t in tables]).astype(np.int64) for c in LIMITS}


def test_items_carry_each_limited_column_and_its_sum(out, vlm):
    dataset = PackedDataset(out)
    source = _source_values(vlm)
    assert dataset.limits == LIMITS
    for i in range(len(dataset)):
        item = dataset[i]
        for name, limit in LIMITS.items():
            values = item[name]
            assert values.dtype == np.int64 and len(values) == len(item["sample_ids"]) == len(item["seq_lens"])
            assert np.array_equal(values, source[name][item["sample_ids"]])  # the sample's own value
            assert isinstance(item[f"{name}_sum"], int) and item[f"{name}_sum"] == int(values.sum()) <= limit


@pytest.mark.parametrize("collate", [collate_flash_attn, collate_hf, collate_thd],
                         ids=["flash_attn", "hf", "thd"])
def test_every_collate_returns_the_limited_columns_per_batch(out, collate):
    dataset = PackedDataset(out)
    for lo in range(0, len(dataset) - 2, 3):
        packs = [dataset[lo], dataset[lo + 1], dataset[lo + 2]]
        batch = collate(packs)
        for name in LIMITS:
            want = torch.from_numpy(np.concatenate([p[name] for p in packs]).astype(np.int64))
            assert batch[name].dtype == torch.int64 and torch.equal(batch[name], want)
            assert torch.equal(batch[f"{name}_sum"], torch.tensor([p[f"{name}_sum"] for p in packs]))
            # one value per sequence: aligned with the segments of cu_seqlens_padded
            segments = batch.get("cu_seqlens_padded", batch.get("cu_seqlens", batch.get("cu_seq_lens_q")))
            assert batch[name].shape == (len(segments) - 1,)
            assert batch[f"{name}_sum"].shape == (3,)


def test_cp_slice_leaves_the_limited_columns_whole(out):
    dataset = PackedDataset(out)
    batch = collate_thd([dataset[0], dataset[1]])
    part = cp_slice(batch, 2, 1)
    for name in LIMITS:
        assert torch.equal(part[name], batch[name]) and torch.equal(part[f"{name}_sum"], batch[f"{name}_sum"])
    assert part["tokens"].shape[1] * 2 == batch["tokens"].shape[1]


def test_split_limit_fields_takes_them_out(out):
    dataset = PackedDataset(out)
    batch = collate_hf([dataset[0]])
    keys = set(batch)
    media = split_limit_fields(batch)
    assert set(media) == {"images", "images_sum", "image_tokens", "image_tokens_sum"}
    assert set(batch) == keys - set(media)
    assert split_limit_fields(batch) == {}


def test_an_output_without_limits_has_no_such_fields(vlm, tmp_path):
    _, plain = pack_to(tmp_path, [vlm], capacity=4096, too_long="drop")
    dataset = PackedDataset(plain)
    assert dataset.limits == {}
    batch = collate_flash_attn([dataset[0]])
    assert not any(k in batch for k in ("images", "images_sum", "image_tokens_sum"))


def test_a_balanced_rank_sees_its_packs_with_their_sums(vlm, tmp_path):
    _, balanced = pack_to(tmp_path, [vlm], capacity=4096, limits=LIMITS, too_long="drop", dp_size=2,
                          micro_batches=2, balance_cost="images")
    for rank in (0, 1):
        dataset = PackedDataset(balanced, dp_rank=rank, dp_size=2)
        for i in range(len(dataset)):
            item = dataset[i]
            assert item["dp_rank"] == rank and item["images_sum"] == int(item["images"].sum())


@pytest.mark.slow
def test_a_plan_with_limits_reads_as_its_materialized_output(vlm, tmp_path):
    plan, made = tmp_path / "plan", tmp_path / "made"
    args = ["--capacity", "4096", "--limit", "images=4", "--limit", "image_tokens=1728", "--too-long", "drop"]
    assert packctl("pack", str(vlm), "-o", str(plan), *args, "--plan-only").code == 0
    assert packctl("materialize", str(plan), "-o", str(made), "-q").code == 0
    a, b = PackedDataset(plan), PackedDataset(made)
    assert len(a) == len(b) > 0 and a.limits == b.limits == LIMITS
    for i in range(len(a)):
        x, y = a[i], b[i]
        for name in LIMITS:
            assert x[name].tobytes() == y[name].tobytes() and x[f"{name}_sum"] == y[f"{name}_sum"]
    got, want = collate_thd([a[0], a[1]]), collate_thd([b[0], b[1]])
    for name in (*LIMITS, *(f"{n}_sum" for n in LIMITS)):
        assert torch.equal(got[name], want[name])
    assert json.loads((made / "_manifest.json").read_text())["layout"]["limits"] == LIMITS

"""packctl.torch: PackedDataset (order, ranks, cheap len), the collate functions, the CP slice,
varlen attention and the learning-rate scale helpers."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from typing import Any
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from support.runs import pack_to  # noqa: E402
from packctl import PackctlError  # noqa: E402
from packctl.contract.schema import COLUMN  # noqa: E402
from packctl.torch import (PackedDataset, RowGroupShuffle, apply_lr_scale, block_causal_mask, collate_flash_attn,  # noqa: E402
                           collate_hf, collate_thd, cp_slice, read_lr_scales, varlen_attention)

IGNORE = -100


def _pack(input_ids, labels, seq_lens, seq_lens_padded, sample_ids):
    """A pack dict as PackedDataset gives it, built by hand (docs/format.md layout)."""
    cu = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    cu_padded = np.concatenate([[0], np.cumsum(seq_lens_padded)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in seq_lens_padded]).astype(np.int32)
    return {"input_ids": np.array(input_ids, np.int32), "labels": np.array(labels, np.int32),
            "position_ids": positions, "seq_lens": np.array(seq_lens, np.int32),
            "seq_lens_padded": np.array(seq_lens_padded, np.int32), "cu_seqlens": cu,
            "cu_seqlens_padded": cu_padded, "sample_ids": np.array(sample_ids, np.int64),
            "num_tokens": int(sum(seq_lens))}


# The two packs of the packctl.torch docstring: a = 1 2 3, b = 4 5 6 7, c = 11..16, pad 0.
PACK_0 = _pack([1, 2, 3, 0, 4, 5, 6, 7], [IGNORE, 2, 3, IGNORE, IGNORE, 5, 6, 7], [3, 4], [4, 4], [7, 3])
PACK_1 = _pack([11, 12, 13, 14, 15, 16, 0, 0], [IGNORE, 12, 13, 14, 15, 16, IGNORE, IGNORE], [6], [8], [9])


@pytest.fixture(scope="module")
def packed(tmp_path_factory, sample_data):
    """sample_data packed small: capacity 512, cp 2 (align 4), shards of 300 packs."""
    _, out = pack_to(tmp_path_factory.mktemp("loaders"), [sample_data], capacity=512, cp_size=2,
                     too_long="split", shard_rows=300)
    return out


def test_collate_flash_attn_lays_packs_end_to_end():
    batch = collate_flash_attn([PACK_0, PACK_1])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3, IGNORE, IGNORE, 5, 6, 7, IGNORE, 12, 13, 14, 15, 16,
                                         IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert batch["cu_seqlens"].tolist() == [0, 4, 8, 16] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 8 and type(batch["max_seqlen"]) is int
    for name in ("input_ids", "labels", "position_ids"):
        assert batch[name].dtype == torch.int64 and batch[name].shape == (1, 16)


def test_split_tail_keeps_the_padding_out_of_max_seqlen():
    # a tail of 20 pad tokens after a 3-token sequence: by default the last segment is 23 long
    tail = _pack([1, 2, 3, 4, 5, 6, 7] + [0] * 21, [IGNORE, 2, 3, 4, IGNORE, 6, 7] + [IGNORE] * 21,
                 [4, 3], [4, 24], [0, 1])
    assert collate_flash_attn([tail, PACK_0])["max_seqlen"] == 24
    batch = collate_flash_attn([tail, PACK_0], split_tail=True)
    # segments 4, 3 | pad 21 as 4 4 4 4 4 1 | pack 0: 4 then its last sequence 4 (no padding after it)
    assert batch["cu_seqlens"].tolist() == [0, 4, 7, 11, 15, 19, 23, 27, 28, 32, 36]
    assert batch["max_seqlen"] == 4
    hf = collate_hf([tail], split_tail=True)
    assert hf["max_length_q"] == hf["max_length_k"] == 4
    # the true tokens attend exactly as with the pack's own boundaries
    torch.manual_seed(0)
    q, k, v = (torch.randn(36, 2, 8) for _ in range(3))
    plain = collate_flash_attn([tail, PACK_0])
    full = varlen_attention(q, k, v, plain["cu_seqlens"], plain["max_seqlen"], backend="sdpa")
    split = varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], backend="sdpa")
    true_tokens = batch["labels"][0] != IGNORE
    torch.testing.assert_close(split[true_tokens], full[true_tokens])


def test_collate_hf_keys_and_types():
    batch = collate_hf([PACK_0, PACK_1])
    assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                          "max_length_q", "max_length_k"}
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 4, 8, 16]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 8 and type(batch["max_length_k"]) is int


def test_collate_thd_shifts_labels_before_any_split():
    batch = collate_thd([PACK_0, PACK_1])
    assert batch["tokens"].tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, IGNORE, IGNORE, 5, 6, 7, IGNORE, 12, 13, 14, 15, 16, IGNORE,
                                         IGNORE, IGNORE]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 13]  # true lengths 3, 4, 6
    assert batch["cu_seqlens_padded"].tolist() == [0, 4, 8, 16]
    assert batch["max_seqlen"] == 8 and batch["qkv_format"] == "thd"
    assert batch["cu_seqlens"].dtype == batch["cu_seqlens_padded"].dtype == torch.int32


def test_cp_slice_gives_each_rank_its_chunks():
    batch = collate_thd([PACK_0, PACK_1])  # padded lengths 4, 4, 8: multiples of 2*cp = 4
    ranks = [cp_slice(batch, 2, r) for r in range(2)]
    # chunks of 1, 1, 2 tokens: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2 of every sequence
    assert ranks[0]["tokens"].tolist() == [[1, 0, 4, 7, 11, 12, 0, 0]]
    assert ranks[1]["tokens"].tolist() == [[2, 3, 5, 6, 13, 14, 15, 16]]
    for r in ranks:
        assert r["cu_seqlens_padded"].tolist() == [0, 4, 8, 16] and r["max_seqlen"] == 8
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            assert r[name].shape == (1, 8)
    kept = sorted(ranks[0]["tokens"][0].tolist() + ranks[1]["tokens"][0].tolist())
    assert kept == sorted(batch["tokens"][0].tolist())
    assert float(ranks[0]["loss_mask"].sum() + ranks[1]["loss_mask"].sum()) == float(batch["loss_mask"].sum())
    with pytest.raises(PackctlError, match="--cp-size 4"):
        cp_slice(batch, 4, 0)


def test_collate_refuses_a_pack_whose_offsets_do_not_span_it():
    broken = dict(PACK_0, cu_seqlens_padded=np.array([0, 4, 6], np.int32))
    with pytest.raises(ValueError, match="does not span its 8 tokens"):
        collate_flash_attn([broken])


def test_dataset_reads_the_packs_of_the_manifest(packed):
    manifest = json.loads((packed / "_manifest.json").read_text())
    assert len(manifest["shards"]) > 1
    dataset = PackedDataset(packed)
    assert len(dataset) == sum(s["rows"] for s in manifest["shards"]) == manifest["counts"]["packs"]
    assert not dataset._cache  # len() read no data
    for shard_index, shard in enumerate(manifest["shards"][:2]):
        table = pq.read_table(packed / shard["path"]).to_pylist()
        first = sum(s["rows"] for s in manifest["shards"][:shard_index])
        for local in (0, len(table) - 1):
            item, row = dataset[first + local], table[local]
            assert item["index"] == first + local
            for name, value in row.items():
                got = item["seq_lens_padded" if name == "seq_lengths" else name]  # the same values
                assert (got.tolist() if isinstance(got, np.ndarray) else got) == value, name
    assert PackedDataset(packed / "_manifest.json")[5]["sample_ids"].tolist() == dataset[5]["sample_ids"].tolist()
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_an_item_carries_every_declared_column_the_output_has(tmp_path, sample_data):
    """Per-pack columns as Python numbers, list columns as arrays of their declared type
    (packctl.contract.schema.COLUMNS): here the batch shape and the learning-rate scale too."""
    _, out = pack_to(tmp_path, [sample_data], mode="batch", too_long="truncate", dp_size=2, micro_batches=2,
                     lr_scaling="sqrt")
    (shard,) = sorted(out.glob("data/*.parquet"))
    table = pq.read_table(shard)
    assert {"padded_len", "batch_size", "lr_scale", "seq_lengths", "step_loss_tokens"} <= set(table.column_names)
    item = PackedDataset(out)[3]
    assert set(item) == {*table.column_names, "index"}
    row = table.slice(item["index"], 1).to_pylist()[0]
    for name in table.column_names:
        column = COLUMN[name]
        if column.is_list:
            assert isinstance(item[name], np.ndarray) and item[name].dtype == np.dtype(column.value), name
            assert item[name].tolist() == row[name], name
        else:
            assert type(item[name]) is (float if column.value.startswith("float") else int), name
            assert item[name] == row[name], name


def test_dataset_in_a_dataloader(packed):
    dataset = PackedDataset(packed)
    dataset[0]
    restored = pickle.loads(pickle.dumps(dataset))  # what DataLoader workers receive
    assert not restored._cache and len(restored) == len(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=collate_flash_attn)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (1, sum(len(dataset[i]["input_ids"]) for i in range(3)))


def _items_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


def test_random_access_gives_the_items_of_in_order_access(packed):
    """Items read in a shuffled order, one decoded row group cached, are those read in order."""
    dataset = PackedDataset(packed)
    in_order = [dataset[i] for i in range(len(dataset))]
    shuffled = PackedDataset(packed, cache_row_groups=1)
    for i in np.random.default_rng(0).permutation(len(shuffled))[:150]:
        assert _items_equal(shuffled[int(i)], in_order[int(i)]), int(i)


def test_each_shard_is_checked_once_per_process(packed, monkeypatch):
    """Random access reads row groups; the whole-shard sha256 runs once a shard in a process (and
    again in a process that receives the dataset pickled, as a DataLoader worker does)."""
    import packctl.contract.reader as reader

    checks: list[int] = []
    check = reader.check_shard_bytes
    monkeypatch.setattr(reader, "check_shard_bytes", lambda data, entry, *a, **k: checks.append(entry.rows) or
                        check(data, entry, *a, **k))
    dataset = PackedDataset(packed, cache_row_groups=1)
    rows = np.random.default_rng(1).permutation(len(dataset))[:150]
    shards = len(set(np.searchsorted(dataset._shard_offsets, rows, side="right").tolist()))
    for i in rows:
        dataset[int(i)]
    assert len(checks) == shards > 2
    worker = pickle.loads(pickle.dumps(dataset))
    worker[0]
    assert len(checks) == shards + 1


def test_row_group_shuffle_gives_every_item_once_and_decodes_each_row_group_once(packed, monkeypatch):
    """Row groups of 128 packs (shards of 300: 128, 128, 44) shuffled, items shuffled within
    windows of 2 row groups: with 2 cached, each row group is read once an epoch."""
    dataset = PackedDataset(packed, cache_row_groups=2)
    sampler = RowGroupShuffle(dataset, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(len(dataset))) and order != sorted(order)
    reads: list[tuple[int, int]] = []
    read = dataset.output.read_row_group
    monkeypatch.setattr(dataset.output, "read_row_group", lambda k, g, c: reads.append((k, g)) or read(k, g, c))
    for i in order:
        dataset[i]
    assert len(reads) == len(set(reads)) == sum(len(dataset.output.row_group_index(k).rows)
                                                for k in range(len(dataset.output.shards)))
    sampler.set_epoch(1)
    assert list(sampler) != order and sorted(sampler) == sorted(order)
    assert list(RowGroupShuffle(dataset, seed=3)) == order  # deterministic


def test_row_group_shuffle_follows_a_ranks_items(packed):
    dataset = PackedDataset(packed, dp_rank=1, dp_size=3)
    assert sorted(RowGroupShuffle(dataset, window=1)) == list(range(len(dataset)))


def _flip_byte_in_row_group(path, group: int) -> None:
    """One byte of the input_ids of row group `group` changed in place (same size)."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    with open(path, "r+b") as fh:
        fh.seek(chunk.data_page_offset + chunk.total_compressed_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_tampered_shard_is_refused_at_the_first_read_of_any_of_its_row_groups(tmp_path, packed):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(packed, out)
    shard = sorted(out.glob("data/*.parquet"))[0]
    assert pq.ParquetFile(shard).metadata.num_row_groups == 3  # 300 packs: 128, 128, 44
    _flip_byte_in_row_group(shard, 2)
    with pytest.raises(PackctlError, match=r"train-00000\.parquet: sha256 differs"):
        PackedDataset(out)[0]  # row group 0, whose bytes are intact


def test_a_shard_changed_after_its_check_is_refused_at_the_next_row_group_read(tmp_path, packed):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(packed, out)
    dataset = PackedDataset(out, cache_row_groups=1)
    first = dataset[0]  # shard 0 checked, row group 0 read
    _flip_byte_in_row_group(sorted(out.glob("data/*.parquet"))[0], 1)
    with pytest.raises(PackctlError, match=r"train-00000\.parquet: row group 1 differs .* changed after"):
        dataset[200]
    assert _items_equal(dataset[0], first)  # row group 0, intact and checked, still reads


@pytest.mark.parametrize("num_packs, dp_size", [(7, 3), (9, 3), (2, 4), (10, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_stride_like_distributed_sampler(tmp_path, num_packs, dp_size, drop_last):
    from torch.utils.data.distributed import DistributedSampler

    out = _fake_output(tmp_path, num_packs)
    for rank in range(dp_size):
        ours = PackedDataset(out, dp_rank=rank, dp_size=dp_size, drop_last=drop_last)
        sampler = DistributedSampler(range(num_packs), num_replicas=dp_size, rank=rank, shuffle=False,
                                     drop_last=drop_last)
        assert [ours[i]["index"] for i in range(len(ours))] == list(sampler)
        assert len(ours) == len(sampler)


def test_rank_arguments_are_checked(tmp_path):
    out = _fake_output(tmp_path, 4)
    with pytest.raises(PackctlError, match="pass both dp_rank and dp_size"):
        PackedDataset(out, dp_rank=0)
    with pytest.raises(PackctlError, match=r"dp_rank 3 is not in \[0, dp_size=2\)"):
        PackedDataset(out, dp_rank=3, dp_size=2)
    with pytest.raises(PackctlError, match="nowhere: no such output directory"):
        PackedDataset(tmp_path / "nowhere")


def test_balanced_output_is_read_in_step_order(tmp_path):
    # step, dp_rank, micro_batch of 8 packs written in an order that is not step order
    balance = {"step": [1, 0, 0, 1, 0, 1, 0, 1], "dp_rank": [0, 1, 0, 1, 0, 0, 1, 1],
               "micro_batch": [0, 0, 1, 1, 0, 1, 1, 0]}
    out = _fake_output(tmp_path, 8, extra=balance, shard_rows=3)
    expected = {0: [4, 2, 0, 5], 1: [1, 6, 7, 3]}  # (step, micro_batch) order of each rank
    for rank, rows in expected.items():
        dataset = PackedDataset(out, dp_rank=rank, dp_size=2)
        assert [dataset[i]["index"] for i in range(len(dataset))] == rows
        assert [dataset[i]["step"] for i in range(len(dataset))] == [0, 0, 1, 1]
    everything = PackedDataset(out)
    assert [everything[i]["index"] for i in range(8)] == [4, 2, 1, 6, 0, 5, 7, 3]
    with pytest.raises(PackctlError, match="balanced over 2 data-parallel ranks, not dp_size=1"):
        PackedDataset(out, dp_rank=0, dp_size=1)


def test_lr_scale_is_read_when_recorded(tmp_path, packed):
    assert read_lr_scales(packed) is None
    out = _fake_output(tmp_path / "column", 4, extra={"step": [0, 0, 1, 1], "dp_rank": [0, 1, 0, 1],
                                                      "micro_batch": [0, 0, 0, 0],
                                                      "lr_scale": pa.array([1.0, 1.0, 0.5, 0.5], pa.float32())})
    assert read_lr_scales(out) == {0: 1.0, 1: 0.5}
    assert PackedDataset(out, dp_rank=1, dp_size=2)[1]["lr_scale"] == 0.5
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(manifest, lr_scale=[0.25, 2.0])))
    assert read_lr_scales(out) == {0: 0.25, 1: 2.0}

    # only param_groups matter (a real torch.optim optimizer's first construction costs seconds of imports)
    optimizer = SimpleNamespace(param_groups=[{"params": [], "lr": 0.1}, {"params": [], "lr": 0.01}])
    base = [g["lr"] for g in optimizer.param_groups]
    apply_lr_scale(optimizer, 0.5, base)
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.005]
    apply_lr_scale(optimizer, 1.0, base)
    assert [g["lr"] for g in optimizer.param_groups] == base


def test_block_causal_mask_draws_the_segments():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                   [0, 0, 1, 1, 1]]


def test_varlen_attention_equals_each_sequence_alone():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    out = varlen_attention(q, k, v, cu, 8, backend="sdpa")
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).repeat_interleave(2, 0),
            v[s:e].transpose(0, 1).repeat_interleave(2, 0), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[s:e], alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_varlen_attention_bidirectional_and_scaled_is_each_sequence_alone(backend):
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    out = varlen_attention(q, k, v, cu, 6, causal=False, softmax_scale=0.3, backend=backend)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).expand(4, -1, -1), v[s:e].transpose(0, 1).expand(4, -1, -1),
            scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[s:e], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn needs a CUDA GPU")
def test_flash_attn_varlen_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    cu = torch.tensor([0, 64, 200, 256], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(256, 4, 64, device="cuda") for _ in range(3))
    reference = varlen_attention(q, k, v, cu, 136, backend="sdpa")  # fp32
    half = [t.bfloat16() for t in (q, k, v)]
    flash = varlen_attention(*half, cu, 136, backend="flash-attn").float()
    plain = varlen_attention(*half, cu, 136, backend="sdpa").float()
    # flash-attn's own rule: no worse than twice a plain bf16 implementation, plus a small atol
    assert (flash - reference).abs().max() <= 2 * (plain - reference).abs().max() + 1e-5


def test_missing_torch_names_the_install_line():
    code = "import sys; sys.modules['torch'] = None; import packctl.torch"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "packctl.torch needs the 'torch' package, which is not installed: pip install 'packctl[torch]'" \
        in result.stderr


def _fake_output(tmp_path, num_packs: int, extra: dict | None = None, shard_rows: int = 4):
    """A small output directory by hand: pack i holds one sequence of 4 tokens [i, i, i, i]; a
    version-1 layout with the manifest and shard metadata every reader checks."""
    from packctl.contract.manifest import sha256_file
    from support.outputs import LAYOUT, tiny_packs

    tmp_path.mkdir(parents=True, exist_ok=True)
    layout = {k: v for k, v in LAYOUT.items() if k != "sequence_parallel"}
    shards = []
    for first in range(0, num_packs, shard_rows):
        rows = range(first, min(first + shard_rows, num_packs))
        table = tiny_packs(first, len(rows), layout, version=1)
        for name, values in (extra or {}).items():
            chunk = values[first:first + len(rows)]
            table = table.append_column(name, chunk if isinstance(chunk, pa.Array) else pa.array(chunk, pa.int32()))
        name = f"part-{len(shards):05d}.parquet"
        pq.write_table(table, tmp_path / name)
        shards.append({"path": name, "rows": len(rows), "tokens": 4 * len(rows),
                       "sha256": sha256_file(tmp_path / name)})
    counts = {"sequences_in": num_packs, "sequences_packed": num_packs, "sequences_dropped": 0,
              "sequences_truncated": 0, "sequences_split": 0, "tokens_in": 4 * num_packs,
              "tokens_packed": 4 * num_packs, "tokens_dropped": 0, "tokens_truncated": 0, "packs": num_packs}
    manifest = {"format_version": 1, "layout": layout, "shards": shards, "counts": counts}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))  # a version-1 output
    return tmp_path


def _fake_megatron(monkeypatch):
    import dataclasses
    import types

    @dataclasses.dataclass
    class PackedSeqParams:  # the fields of megatron.core.packed_seq_params.PackedSeqParams
        qkv_format: str = None
        cu_seqlens_q: Any = None
        cu_seqlens_kv: Any = None
        cu_seqlens_q_padded: Any = None
        cu_seqlens_kv_padded: Any = None
        max_seqlen_q: Any = None
        max_seqlen_kv: Any = None
        pad_between_seqs: Any = None

    names = ["megatron", "megatron.core", "megatron.core.packed_seq_params"]
    modules = {name: types.ModuleType(name) for name in names}
    modules["megatron.core.packed_seq_params"].PackedSeqParams = PackedSeqParams
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_packed_seq_params_tells_transformer_engine_whether_sequences_are_padded(monkeypatch):
    """TE takes `cu_seqlens_q_padded is cu_seqlens_q` to mean no padding between sequences (and
    only then keeps FlashAttention): equal boundaries must be the same tensor."""
    from packctl.torch import packed_seq_params

    _fake_megatron(monkeypatch)
    unpadded = {"cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32),
                "cu_seqlens_padded": torch.tensor([0, 3, 5], dtype=torch.int32), "max_seqlen": 3}
    p = packed_seq_params(unpadded)
    assert p.cu_seqlens_q_padded is p.cu_seqlens_q and p.cu_seqlens_kv_padded is p.cu_seqlens_kv
    assert p.pad_between_seqs is False
    padded = {"cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32),
              "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32), "max_seqlen": 3}
    p = packed_seq_params(padded)
    assert p.cu_seqlens_q_padded is not p.cu_seqlens_q and p.pad_between_seqs is True
    assert p.qkv_format == "thd" and p.max_seqlen_q == 3
    megatron_style = packed_seq_params(padded, padded_boundaries=True)
    assert megatron_style.cu_seqlens_q.tolist() == [0, 4, 8] and megatron_style.pad_between_seqs is False
    assert megatron_style.cu_seqlens_q_padded is megatron_style.cu_seqlens_q and megatron_style.max_seqlen_q == 4

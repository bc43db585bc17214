"""`packctl.torch.thd_batch` builds, from the rollouts themselves and the online plan, the very
micro-batch `collate_flash_attn` makes of the packs `pack` writes for the same sequences."""
from __future__ import annotations

import numpy as np
import pytest
torch = pytest.importorskip("torch")

import packctl
from packctl import PackctlError
from packctl.torch import PackedDataset, collate_flash_attn, thd_batch
from support.data import write_table
from support.runs import pack_to

RNG = np.random.default_rng(5)
LENGTHS = RNG.integers(1, 90, 60)
TOKENS = [RNG.integers(1, 1000, n) for n in LENGTHS]
# a masked prompt: the first third of each sequence takes no loss
LABELS = [np.where(np.arange(n) < n // 3, -100, t) for n, t in zip(LENGTHS, TOKENS)]


@pytest.mark.parametrize("too_long", ["error", "split"])
def test_thd_batch_is_collate_flash_attn_of_pack_s_output(tmp_path, too_long):
    capacity = 200 if too_long == "error" else 64
    source = write_table(tmp_path / "rollouts.parquet", {"input_ids": [t.tolist() for t in TOKENS],
                                                         "labels": [lab.tolist() for lab in LABELS]})
    _, out = pack_to(tmp_path, [source], order="input", window=10_000, capacity=capacity, cp_size=2,
                     too_long=too_long)
    dataset = PackedDataset(out)
    packs = packctl.plan_packs(LENGTHS, capacity, align=4, too_long=too_long)
    assert packs.num_packs == len(dataset)
    for batch in ([0, 1, 2], [len(dataset) - 1]):
        expected = collate_flash_attn([dataset[i] for i in batch])
        got = thd_batch([torch.from_numpy(t) for t in TOKENS], packs, batch,
                        labels=[torch.from_numpy(lab) for lab in LABELS], pad_to=capacity)
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_loss_tokens", "seq_index"):
            assert torch.equal(got[key], expected[key]), key
        assert got["max_seqlen"] == expected["max_seqlen"]
        assert got["num_loss_tokens"] == expected["num_loss_tokens"]


def test_thd_batch_drawn_example_and_shift():
    batch = thd_batch([torch.tensor([11, 12, 13]), torch.tensor([21, 22])], packctl.plan_packs([3, 2], 8), pad_to=8)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 12, 13, -100, 22, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 8] and batch["max_seqlen"] == 5
    assert batch["seq_loss_tokens"].tolist() == [2, 1] and batch["num_loss_tokens"] == 3
    shifted = thd_batch([torch.tensor([11, 12, 13]), torch.tensor([21, 22])], packctl.plan_packs([3, 2], 8),
                        shift_labels=True)
    assert shifted["labels"].tolist() == [[12, 13, -100, 22, -100]]
    assert shifted["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]


def test_thd_batch_refuses_sequences_the_plan_was_not_made_of():
    packs = packctl.plan_packs([3, 2], 8)
    with pytest.raises(PackctlError, match=r"sequences\[1\] has 4 tokens, the plan 2"):
        thd_batch([torch.arange(3), torch.arange(4)], packs)
    with pytest.raises(PackctlError, match="pad_to 4 is less than a pack's 5 tokens"):
        thd_batch([torch.arange(3), torch.arange(2)], packs, pad_to=4)
    with pytest.raises(PackctlError, match=r"pack_ids \[1\] are not all in \[0, 1\)"):
        thd_batch([torch.arange(3), torch.arange(2)], packs, [1])
    with pytest.raises(PackctlError, match="pack_ids is empty"):
        thd_batch([torch.arange(3), torch.arange(2)], packs, [])
    with pytest.raises(PackctlError, match="the plan has sequence 1 and 1 sequences came"):
        thd_batch([torch.arange(3)], packs)
    with pytest.raises(PackctlError, match="labels must hold one tensor per sequence"):
        thd_batch([torch.arange(3), torch.arange(2)], packs, labels=[torch.arange(3)])

"""The training recipes of docs/training.md, run as written on a small packed output (CPU, tiny
random models, no downloads): the quickstart loop with a Hugging Face model, the flash-attn style
loop, Hugging Face `Trainer` (and its data-parallel loader), and Megatron's `forward_step` with
context-parallel slicing. The TRL recipe is run by tests/integration/training/test_trl.py.

What each block needs from the reader's own code (`model`, `optimizer`, Megatron's `loss_func`)
is given to it; settings a CPU run needs (`use_cpu`, a few steps) are added to the arguments the
block builds, nothing else is changed.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.runs import pack_to  # noqa: E402
from support.docs import run_docs_block  # noqa: E402
from packctl.torch import PackedDataset, collate_thd, varlen_attention  # noqa: E402
from support.torch_proof import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_data) -> Path:
    """16 rows of sample_data (one of 1,305 tokens, split at the capacity 1024): 7 packs, so the
    loops of the recipes run 4 and 2 steps."""
    path = tmp_path_factory.mktemp("recipes-corpus") / "small.parquet"
    pq.write_table(pq.read_table(sorted(sample_data.glob("*.parquet"))[0]).slice(0, 16), path)
    return path


@pytest.fixture(scope="module")
def packed(tmp_path_factory, corpus) -> Path:
    """A cp-2 output (every sequence padded to a multiple of 4), so the Megatron recipe can slice it."""
    return pack_to(tmp_path_factory.mktemp("recipes"), [corpus], capacity=1024, cp_size=2, pad_to="multiple",
                   too_long="split")[1]


@pytest.fixture
def in_run_dir(packed, tmp_path, monkeypatch) -> Path:
    """The working directory of a recipe: the output is there as `packed`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "packed").symlink_to(packed, target_is_directory=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return tmp_path


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(model, before) -> bool:
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_quickstart(in_run_dir):
    model = tiny_llama(seed=0)
    before = _snapshot(model)
    calls = []
    forward = model.forward

    def counted(*args, **kwargs):
        output = forward(*args, **kwargs)
        calls.append(float(output.loss))
        return output

    model.forward = counted
    run_docs_block("quickstart", {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert len(calls) == math.ceil(len(PackedDataset("packed")) / 2)
    assert all(math.isfinite(x) for x in calls) and _changed(model, before)


def test_row_group_shuffle_loop(in_run_dir):
    """Three epochs of the documented sampler: every pack once an epoch, each epoch its own order."""
    batches: list[int] = []  # each batch's sum of token ids, in the order trained
    run_docs_block("row-group-shuffle", {"train_step": lambda batch: batches.append(int(batch["input_ids"].sum()))})
    per_epoch = math.ceil(len(PackedDataset("packed")) / 2)
    epochs = [batches[e * per_epoch:(e + 1) * per_epoch] for e in range(3)]
    assert len(batches) == 3 * per_epoch
    assert sum(epochs[0]) == sum(epochs[1]) == sum(epochs[2]) and epochs[0] != epochs[1]


class TinyVarlenLM(torch.nn.Module):
    """A flash-attn style model: forward(input_ids [1, T], position_ids [1, T], cu_seqlens, max_seqlen)
    -> logits [1, T, V], attention through packctl.torch.varlen_attention (SDPA on CPU)."""

    def __init__(self, vocab: int = 32000, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(4096, dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, *, cu_seqlens, max_seqlen):
        x = self.embed(input_ids[0]) + self.pos(position_ids[0])
        q, k, v = self.qkv(x).view(len(x), 3, self.heads, -1).unbind(1)
        return self.out(x + varlen_attention(q, k, v, cu_seqlens, max_seqlen).reshape(len(x), -1))[None]


@pytest.mark.slow
def test_flash_attn_loop(in_run_dir, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # the block moves tensors to a GPU
    torch.manual_seed(0)
    model = TinyVarlenLM()
    before = _snapshot(model)
    namespace = run_docs_block("flash-attn-loop", {"model": model})
    assert namespace["step"] == math.ceil(len(PackedDataset("packed")) / 4) - 1  # every batch was a step
    assert math.isfinite(float(namespace["loss"])) and _changed(model, before)
    assert namespace["lr_scales"] is None


@pytest.fixture
def cpu_training_arguments(monkeypatch):
    import transformers

    real = transformers.TrainingArguments
    monkeypatch.setattr(transformers, "TrainingArguments", lambda **kw: real(
        **kw, use_cpu=True, report_to="none", max_steps=3, save_strategy="no", logging_steps=1))


@pytest.mark.slow
def test_hf_trainer_and_its_data_parallel_loader(in_run_dir, cpu_training_arguments):
    namespace = run_docs_block("hf-trainer", {"model": tiny_llama(seed=0)})
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 3
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)

    run_docs_block("hf-trainer-dp", namespace)
    ranked = namespace["PackedTrainer"](model=namespace["model"], args=namespace["args"])
    ranked.args = SimpleNamespace(process_index=1, world_size=2, per_device_train_batch_size=2)
    seen = [int(i) for batch in ranked.get_train_dataloader() for i in [len(batch["input_ids"][0])]]
    mine = PackedDataset("packed", dp_rank=1, dp_size=2)
    expected = [sum(len(mine[j]["input_ids"]) for j in range(i, min(i + 2, len(mine))))
                for i in range(0, len(mine), 2)]
    assert seen == expected  # rank 1's packs, two per batch, in order


class TinyGPT(torch.nn.Module):
    """Megatron's GPT forward signature; with labels it returns the per-token losses [1, T] (no
    attention across tokens, so context-parallel ranks need not talk to each other)."""

    def __init__(self, vocab: int = 32000, dim: int = 16):
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
        self.seen = []

    def forward(self, tokens, position_ids, attention_mask, *, labels, packed_seq_params):
        self.seen.append(packed_seq_params)
        logits = self.out(self.embed(tokens))
        return torch.nn.functional.cross_entropy(logits[0], labels[0].clamp(min=0), reduction="none")[None]


def loss_func(loss_mask, output):
    """The reader's Megatron loss function: summed masked loss and the count of targets."""
    mask = loss_mask.reshape(-1).float()
    return (output.reshape(-1).float() * mask).sum(), mask.sum()


@pytest.mark.slow
def test_megatron_forward_step_with_context_parallel_slices(in_run_dir, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    rank = {"cp": 0}
    for name, value in (("get_data_parallel_rank", lambda: 0), ("get_data_parallel_world_size", lambda: 1),
                        ("get_context_parallel_world_size", lambda: 2),
                        ("get_context_parallel_rank", lambda: rank["cp"])):
        monkeypatch.setattr(ps, name, value)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    torch.manual_seed(0)
    model = TinyGPT()
    namespace = run_docs_block("megatron", {"loss_func": loss_func})
    full = collate_thd([PackedDataset("packed")[0]])
    expected, count = loss_func(full["loss_mask"], model(full["tokens"], full["position_ids"], None,
                                                          labels=full["labels"], packed_seq_params=None))
    total = torch.zeros(()), torch.zeros(())
    for rank["cp"] in (0, 1):
        output, reduce = namespace["forward_step"](iter(namespace["loader"]), model)
        assert output.shape[1] == full["tokens"].shape[1] // 2  # this rank's half of the pack
        total = tuple(a + b for a, b in zip(total, reduce(output)))
    assert int(total[1]) == int(count) and abs(float(total[0] - expected)) <= 1e-4 * float(expected)
    params = model.seen[-1]
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert int(params.cu_seqlens_q_padded[-1]) == full["tokens"].shape[1]  # boundaries stay global
    assert np.array_equal(params.cu_seqlens_q.numpy(), full["cu_seqlens"].numpy())

"""TRL's SFTTrainer on a packctl output, as docs/training.md shows it: padding-free, pre-packed.

TRL keeps `input_ids`, `labels` and `seq_lengths` of each row and its collator rebuilds
`position_ids` (hence the sequence boundaries the model attends within) from `seq_lengths`. packctl
writes `seq_lengths` (= `seq_lens_padded`), so TRL's batches must give every sequence the losses and
gradients it gets alone (read from the source Parquet, tiny random Llama, fp32, CPU); without the
column TRL treats each pack as one document and the equality breaks.
"""
from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from support.runs import pack_to  # noqa: E402
from support.docs import run_docs_block  # noqa: E402
from packctl.torch import PackedDataset  # noqa: E402
from support.torch_proof import max_differences, packed_run, seq_starts_of, source_pieces, tiny_llama, unpacked_run  # noqa: E402

pytestmark = pytest.mark.slow  # TRL and datasets load in seconds, and each test builds an SFTTrainer

TOLERANCE = 1e-5
LAYOUTS = {
    # tail padding to the capacity, held by each pack's last sequence
    "cp1-capacity": dict(capacity=1024, too_long="split"),
    # every sequence padded to a multiple of 4, packs to a multiple of 4
    "cp2-multiple": dict(capacity=1024, cp_size=2, pad_to="multiple", too_long="split"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_data) -> Path:
    """40 rows of sample_data (masked prompts on about half of them; some longer than the capacity)."""
    path = tmp_path_factory.mktemp("trl-corpus") / "small.parquet"
    pq.write_table(pq.read_table(sorted(sample_data.glob("*.parquet"))[0]).slice(0, 40), path)
    return path


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def out(request, tmp_path_factory, corpus) -> Path:
    return pack_to(tmp_path_factory.mktemp(request.param), [corpus], **LAYOUTS[request.param])[1]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def small_out(request, tmp_path_factory, corpus) -> Path:
    """The layouts at capacity 256: a training step of TRL over 2 packs computes the log-probabilities
    of 512 tokens over the 32,000 ids of the vocabulary rather than 2,048."""
    options = dict(LAYOUTS[request.param], capacity=256)
    return pack_to(tmp_path_factory.mktemp(f"{request.param}-256"), [corpus], **options)[1]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    """A tokenizer object for SFTTrainer's pad-token bookkeeping (the data is already tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>", unk_token="<unk>")


def _cpu_config(output_dir, **overrides):
    from trl import SFTConfig

    return SFTConfig(output_dir=str(output_dir), bf16=False, use_cpu=True, report_to="none", **overrides)


def _first_batch(out: Path, model, tokenizer, tmp_path, *, drop: tuple[str, ...] = ()):
    from trl import SFTTrainer

    dataset = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    if drop:
        dataset = dataset.remove_columns(list(drop))
    args = _cpu_config(tmp_path / "run", padding_free=True, max_length=None, per_device_train_batch_size=2,
                       train_sampling_strategy="sequential")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    return trainer, next(iter(trainer.get_train_dataloader()))


def test_trl_padding_free_batch_equals_each_sequence_alone(out, model, tokenizer, tmp_path):
    trainer, batch = _first_batch(out, model, tokenizer, tmp_path)
    assert set(trainer.train_dataset.column_names) >= {"input_ids", "labels", "seq_lengths"}
    packs = [PackedDataset(out)[i] for i in (0, 1)]
    # TRL's batch is packctl's two packs laid end to end, with packctl's positions and labels
    for name in ("input_ids", "position_ids", "labels"):
        expected = torch.cat([torch.tensor(p[name], dtype=torch.long) for p in packs])
        assert torch.equal(batch[name][0], expected), name
    pieces = [p for per_pack in source_pieces(out, [0, 1]) for p in per_pack]
    assert len(pieces) >= 3, "the first two packs must hold several sequences for the proof to mean anything"
    reference = unpacked_run(model, pieces)
    diff = max_differences(packed_run(model, dict(batch), batch["labels"], seq_starts_of(packs)), reference)
    assert max(diff.values()) <= TOLERANCE, diff
    loss = trainer.compute_loss(model, dict(batch))
    assert abs(float(loss.detach()) - float(reference.loss)) <= TOLERANCE


def test_without_seq_lengths_trl_attends_across_sequences(out, model, tokenizer, tmp_path):
    """The proof can fail: with the column removed TRL numbers each pack 0..n-1 as one document."""
    _, batch = _first_batch(out, model, tokenizer, tmp_path, drop=("seq_lengths",))
    packs = [PackedDataset(out)[i] for i in (0, 1)]
    pieces = [p for per_pack in source_pieces(out, [0, 1]) for p in per_pack]
    run = packed_run(model, dict(batch), batch["labels"], seq_starts_of(packs), backward=False)
    diff = max_differences(run, unpacked_run(model, pieces))
    assert diff["per_token"] > 1e-2 and diff["loss"] > 1e-4, diff


def test_docs_trl_recipe_trains(small_out, tokenizer, tmp_path, monkeypatch):
    """The SFTTrainer block of docs/training.md, run as written on an output named `packed` (the
    config only gains the CPU settings and a few steps); it trains with finite losses."""
    import trl

    monkeypatch.chdir(tmp_path)
    (tmp_path / "packed").symlink_to(small_out, target_is_directory=True)
    real_config = trl.SFTConfig
    monkeypatch.setattr(trl, "SFTConfig", lambda **kw: real_config(**kw, bf16=False, use_cpu=True, report_to="none",
                                                                    logging_steps=1, max_steps=3, save_strategy="no"))
    trainer = run_docs_block("trl", {"model": tiny_llama(seed=1), "tokenizer": tokenizer})["trainer"]
    assert trainer.state.global_step == 3
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)

"""Proof on a real model that `packctl.torch.loss_fn` makes the gradient of an optimizer step
independent of packing: a tiny Hugging Face Llama (random weights, fp32, CPU), a corpus packed with
--dp-size 2 --micro-batches 2, one step run as 2 simulated data-parallel ranks x 2 micro-batches
(gradients accumulated over micro-batches and summed over ranks, as an all-reduce SUM does),
against the same sequences run one by one, read from the source Parquet by sample id:

    token mode     reference loss = sum of every token's loss / number of loss tokens
    sequence mode  reference loss = mean over sequences of (the sequence's mean token loss)

for every packing algorithm; and with --weight-column, each sequence's term multiplied by its
weight in the source. The naive loss (each micro-batch's own mean, averaged over
micro-batches and ranks: Hugging Face's default without num_items_in_batch) gives another
gradient, so the test can fail.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.runs import pack_to  # noqa: E402
from support.data import write_table  # noqa: E402
from packctl.plan.algorithms import KERNELS  # noqa: E402
from packctl.torch import PackedDataset, block_causal_mask, collate_flash_attn, loss_fn  # noqa: E402
from support.torch_proof import IGNORE_INDEX, _grads, source_pieces, tiny_llama, token_losses  # noqa: E402

ALGORITHMS = list(KERNELS)  # every algorithm
DP_SIZE, MICRO_BATCHES = 2, 2
TOLERANCE = 1e-5
NAIVE_MARGIN = 1e-3  # the naive loss must move some gradient by more than this
MEASURED: dict[str, float] = {}

pytestmark = pytest.mark.slow  # a proof on a real model (tiny Llama, CPU)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """20 sequences of 6 to 70 tokens; every other one has a masked prompt."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(6, 71, size=20)
    tokens = [rng.integers(1, 32000, size=n).tolist() for n in lengths]
    labels = [[IGNORE_INDEX] * (int(n) // 3 if i % 2 else 0) + t[int(n) // 3 if i % 2 else 0:]
              for i, (n, t) in enumerate(zip(lengths, tokens))]
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    weights = rng.uniform(0.25, 4.0, size=len(lengths))  # used by the weighted test only
    return write_table(path, {"input_ids": tokens, "labels": labels, "weight": weights})


def _source_weights(corpus: Path) -> np.ndarray:
    import pyarrow.parquet as pq

    return pq.read_table(corpus, columns=["weight"]).column("weight").to_numpy()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return tiny_llama(seed=0)


def _step_zero(out: Path) -> dict[int, list[dict]]:
    """Each rank's packs of step 0, in micro-batch order."""
    per_rank = {}
    for rank in range(DP_SIZE):
        dataset = PackedDataset(out, dp_rank=rank, dp_size=DP_SIZE)
        per_rank[rank] = [p for p in (dataset[i] for i in range(len(dataset))) if p["step"] == 0]
    return per_rank


def _packed_step(model, per_rank: dict[int, list[dict]], loss) -> dict[str, torch.Tensor]:
    """Gradient of one step: every micro-batch's loss backpropagated, summed over ranks."""
    model.zero_grad(set_to_none=True)
    for packs in per_rank.values():
        for pack in packs:  # one pack per micro-batch
            batch = collate_flash_attn([pack])
            mask = block_causal_mask(batch["cu_seqlens"])[None, None]
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           attention_mask=mask).logits
            loss(logits, batch).backward()
    return _grads(model)


def _unpacked_step(model, pieces, mode: str, weights: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """Each sequence alone at positions 0..n-1, with the reference loss of `mode` (each sequence's
    term multiplied by `weights[sample id]` when given)."""
    model.zero_grad(set_to_none=True)
    sums, counts = [], []
    for piece in pieces:
        logits = model(input_ids=torch.from_numpy(piece.tokens.astype(np.int64))[None]).logits[0]
        losses, valid = token_losses(logits, torch.from_numpy(piece.labels.astype(np.int64)))
        sums.append(losses.sum())
        counts.append(int(valid.sum()))
    sums, counts = torch.stack(sums), torch.tensor(counts)
    if weights is not None:
        sums = sums * torch.tensor([float(weights[piece.sample_id]) for piece in pieces])
    if mode == "token":
        loss = sums.sum() / counts.sum()
    else:
        has = counts > 0
        loss = (sums[has] / counts[has]).mean()
    loss.backward()
    return _grads(model)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module", params=ALGORITHMS)
def step(request, tmp_path_factory, corpus):
    _, out = pack_to(tmp_path_factory.mktemp(request.param), [corpus], algorithm=request.param, capacity=96,
                     dp_size=DP_SIZE, micro_batches=MICRO_BATCHES)
    per_rank = _step_zero(out)
    rows = [p["index"] for packs in per_rank.values() for p in packs]
    pieces = [piece for per_pack in source_pieces(out, rows) for piece in per_pack]
    return request.param, per_rank, pieces


def test_the_step_spreads_several_sequences_over_ranks_and_micro_batches(step):
    _, per_rank, pieces = step
    assert all(len(packs) == MICRO_BATCHES for packs in per_rank.values())
    assert any(len(p["seq_lens"]) > 1 for packs in per_rank.values() for p in packs)
    counts = [int(c) for packs in per_rank.values() for p in packs for c in p["seq_loss_tokens"]]
    assert len(set(counts)) > 2  # sequences of different weights in token and sequence mode
    assert any((piece.labels[1:] == IGNORE_INDEX).any() for piece in pieces)  # a masked prompt


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_step_gradient_equals_the_unpacked_gradient(step, model, mode):
    name, per_rank, pieces = step
    packed = _packed_step(model, per_rank, lambda logits, batch: loss_fn(logits, batch, mode))
    diff = _max_diff(packed, _unpacked_step(model, pieces, mode))
    MEASURED[f"{name} {mode}"] = diff
    assert diff <= TOLERANCE, (name, mode, diff)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_weighted_step_gradient_equals_the_weighted_unpacked_gradient(corpus, tmp_path, model, mode):
    """--weight-column: each sequence's term multiplied by its source weight, found by sample id."""
    _, out = pack_to(tmp_path, [corpus], capacity=96, dp_size=DP_SIZE, micro_batches=MICRO_BATCHES,
                     weight_column="weight")
    per_rank = _step_zero(out)
    rows = [p["index"] for packs in per_rank.values() for p in packs]
    pieces = [piece for per_pack in source_pieces(out, rows) for piece in per_pack]
    weights = _source_weights(corpus)
    packed = _packed_step(model, per_rank, lambda logits, batch: loss_fn(logits, batch, mode))
    diff = _max_diff(packed, _unpacked_step(model, pieces, mode, weights))
    assert diff <= TOLERANCE, (mode, diff)
    unweighted = _unpacked_step(model, pieces, mode)
    assert _max_diff(packed, unweighted) > NAIVE_MARGIN  # the weights did change the gradient


def test_the_naive_per_micro_batch_mean_does_not_match(step, model):
    """Each micro-batch's own mean, averaged over micro-batches (gradient accumulation) and ranks
    (DDP): tokens of a pack with few loss tokens weigh more than the others."""
    name, per_rank, pieces = step

    def naive(logits, batch):
        return loss_fn(logits, batch, "token", denominator=batch["num_loss_tokens"]) / (DP_SIZE * MICRO_BATCHES)

    diff = _max_diff(_packed_step(model, per_rank, naive), _unpacked_step(model, pieces, "token"))
    MEASURED[f"{name} naive"] = diff
    assert diff > NAIVE_MARGIN, (name, diff)


def test_the_documented_loop_steps_once_per_step(corpus, tmp_path, monkeypatch):
    """docs/training.md's loss_fn block as written, on rank 0 of a --dp-size 2 output."""
    from support.docs import run_docs_block

    pack_to(tmp_path, [corpus], capacity=96, dp_size=DP_SIZE, micro_batches=MICRO_BATCHES)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "packed").symlink_to(tmp_path / "out", target_is_directory=True)
    model = tiny_llama(seed=1)
    steps = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step = lambda: steps.append(1)
    run_docs_block("loss-fn", {"model": model, "optimizer": optimizer, "rank": 0})
    dataset = PackedDataset(tmp_path / "out", dp_rank=0, dp_size=DP_SIZE)
    assert len(steps) == sum(dataset[i]["micro_batch"] == MICRO_BATCHES - 1 for i in range(len(dataset))) > 0


def test_every_collate_gives_loss_fn_the_same_loss(corpus, tmp_path):
    """Unshifted labels (collate_flash_attn, collate_hf) and shifted ones (collate_thd, also cut over
    2 context-parallel ranks by cp_slice) give the same loss in both modes, equal to the loss
    computed by hand from the labels."""
    from packctl.torch import collate_hf, collate_thd, cp_slice, split_loss_fields

    _, out = pack_to(tmp_path, [corpus], capacity=128, cp_size=2, pad_to="multiple", dp_size=DP_SIZE,
                     micro_batches=MICRO_BATCHES)
    packs = _step_zero(out)[0]
    flash = collate_flash_attn(packs)
    torch.manual_seed(0)
    logits = torch.randn(1, flash["input_ids"].shape[1], 32000)
    losses, valid = token_losses(logits[0], flash["labels"][0])
    seq_of = flash["seq_index"][0, 1:]
    sums = torch.zeros(len(flash["seq_loss_tokens"])).index_add_(0, seq_of, losses)
    counts = torch.zeros(len(sums)).index_add_(0, seq_of, valid.float())
    assert torch.equal(counts.long(), flash["seq_loss_tokens"])
    share = {"token": losses.sum() / flash["step_loss_tokens"],
             "sequence": (sums[counts > 0] / counts[counts > 0]).sum() / flash["step_loss_sequences"]}

    hf = collate_hf(packs, loss_counts=True)
    fields = split_loss_fields(hf)
    assert hf.keys() == collate_hf(packs).keys() and set(fields) >= {"seq_loss_tokens", "seq_index"}
    thd = collate_thd(packs)
    for mode, expected in share.items():
        assert abs(float(loss_fn(logits, flash, mode)) - float(expected)) < 1e-6
        assert abs(float(loss_fn(logits, {**hf, **fields}, mode)) - float(expected)) < 1e-6
        assert abs(float(loss_fn(logits, thd, mode)) - float(expected)) < 1e-6
        ranks = [cp_slice(dict(thd, logits=logits), 2, r) for r in range(2)]
        total = sum(float(loss_fn(part["logits"], part, mode)) for part in ranks)
        assert abs(total - float(expected)) < 1e-6
    own = float(loss_fn(logits, flash, "token", denominator=flash["num_loss_tokens"]))
    assert abs(own - float(losses.sum() / valid.sum())) < 1e-6


def test_a_batch_across_two_steps_is_refused(step):
    _, per_rank, _ = step
    later = dict(per_rank[0][0], step=1)
    with pytest.raises(ValueError, match="steps \\[0, 1\\]"):
        collate_flash_attn([per_rank[0][0], later])


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_groups_kept_within_a_step_give_the_unpacked_gradient_of_whole_groups(corpus, tmp_path, model, mode):
    """--group-scope step: groups of 3 sequences (larger than a pack of 96) spread over the packs of
    one step; step 0 holds whole groups, and its gradient is that of those groups unpacked."""
    import pyarrow.parquet as pq

    table = pq.read_table(corpus)
    grouped = write_table(tmp_path / "grouped.parquet", {"input_ids": table.column("input_ids").to_pylist(),
                                                         "labels": table.column("labels").to_pylist(),
                                                         "g": [i // 3 for i in range(table.num_rows)]})
    _, out = pack_to(tmp_path, [grouped], capacity=96, dp_size=DP_SIZE, micro_batches=MICRO_BATCHES,
                     group_column="g", group_scope="step")
    per_rank = _step_zero(out)
    rows = [p["index"] for packs in per_rank.values() for p in packs]
    pieces = [piece for per_pack in source_pieces(out, rows) for piece in per_pack]
    members = sorted(piece.sample_id for piece in pieces)
    groups = {s // 3 for s in members}
    assert members == [s for s in range(table.num_rows) if s // 3 in groups]  # whole groups only
    assert any(len({p["index"] for packs in per_rank.values() for p in packs
                    if any(int(s) // 3 == g for s in p["sample_ids"])}) > 1 for g in groups)  # spread over packs
    packed = _packed_step(model, per_rank, lambda logits, batch: loss_fn(logits, batch, mode))
    diff = _max_diff(packed, _unpacked_step(model, pieces, mode))
    assert diff <= TOLERANCE, (mode, diff)

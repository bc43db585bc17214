"""`pack --plan-only` moves no token: a plan's loss columns are counted from what scan learned (a
Megatron pair's `.idx` alone), and every column of the plan is the same column of the packed output,
with and without a labels column, for sequences cut by --too-long split, --algorithm split and
--too-long truncate, with --cp-size, --dp-size and --epochs, on 1 and 3 in-process ranks
(tests/mpi/test_mpi.py: the same under mpiexec -n 3)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack
from packctl.contract.schema import NUM_LOSS_TOKENS, SEQ_LOSS_TOKENS, SEQ_STARTS, TOKEN_COLUMNS
from packctl.source import megatron
from packctl.source.blocks import DecodedBlock
from support.data import sample_corpus
from support.megatron import build_with_megatron, random_documents
from support.threadcomm import run_ranks

CONFIGS = {
    "split": dict(too_long="split"),
    "algorithm-split": dict(algorithm="split", too_long="split", seq_multiple=8),
    "truncate": dict(too_long="truncate", pad_to="multiple", seq_multiple=8),
    "cp2": dict(too_long="split", cp_size=2),
    "steps": dict(too_long="split", dp_size=2, micro_batches=2, order="shuffle"),
    "epochs": dict(too_long="split", order="shuffle", epochs=2),
}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """labels: prompt-masked labels (-100 inside sequences the capacity cuts); no-labels: the same
    tokens without that column; megatron: pairs megatron-core writes, with tokens equal to the pad
    id 0 (they are data: their labels carry loss)."""
    root = tmp_path_factory.mktemp("plan-counts")
    labels = sample_corpus(root / "labels", sequences=300, distribution="lognormal", shards=2, seed=3,
                           max_length=700)
    (root / "no-labels").mkdir()
    for path in sorted(labels.glob("*.parquet")):
        pq.write_table(pq.read_table(path).drop(["labels"]), root / "no-labels" / path.name, row_group_size=40)
    for k, dtype in enumerate((np.uint16, np.int32)):
        documents = random_documents(30 + k, 120, high=8, max_length=300)  # ids below 8: many equal 0
        build_with_megatron(root / "megatron" / f"m{k}", documents, dtype)
    return {"labels": labels, "no-labels": root / "no-labels", "megatron": root / "megatron"}


def assert_plan_is_packs_without_tokens(plan: Path, packs: Path) -> None:
    shards = sorted(p.relative_to(packs) for p in packs.rglob("*.parquet"))
    assert shards and shards == sorted(p.relative_to(plan) for p in plan.rglob("*.parquet"))
    for rel in shards:
        packed, planned = pq.read_table(packs / rel), pq.read_table(plan / rel)
        assert planned.column_names == [n for n in packed.column_names if n not in TOKEN_COLUMNS] + [SEQ_STARTS]
        for column in planned.column_names[:-1]:
            assert planned.column(column).equals(packed.column(column)), (rel, column)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["labels", "no-labels", "megatron"])
def test_a_plan_counts_its_loss_tokens_without_moving_a_token(corpora, tmp_path, monkeypatch, kind, name, ranks):
    def no_tokens(*args, **kwargs):
        raise AssertionError("a plan gathered tokens")

    with monkeypatch.context() as patched:  # the plan: no token gathered, no .bin read
        patched.setattr(DecodedBlock, "gather_into", no_tokens)
        patched.setattr(DecodedBlock, "gather", no_tokens)
        patched.setattr(megatron.IndexedPair, "tokens", no_tokens)
        plan = tmp_path / "plan"
        config = dict(inputs=[str(corpora[kind])], capacity=256, shard_rows=60, **CONFIGS[name])
        if ranks == 1:
            pack(PackConfig(output=str(plan), plan_only=True, **config))
        else:
            run_ranks(ranks, lambda comm: pack(PackConfig(output=str(plan), plan_only=True, **config), comm=comm))
    packs = tmp_path / "packs"
    pack(PackConfig(output=str(packs), **config))
    assert_plan_is_packs_without_tokens(plan, packs)
    if name != "truncate":  # sequences were cut: pieces that start inside them were counted
        starts = [pq.read_table(p).column(SEQ_STARTS).combine_chunks().flatten() for p in plan.rglob("*.parquet")]
        assert any((np.asarray(s) > 0).any() for s in starts)
    metrics = json.loads((plan / "_metrics.json").read_text())["throughput"]
    if kind == "megatron":  # the .bin was not read: its tokens equal to the pad id are not counted
        assert metrics["tokens_equal_to_pad_id"] is None
    else:
        assert metrics["tokens_equal_to_pad_id"] == json.loads(
            (packs / "_metrics.json").read_text())["throughput"]["tokens_equal_to_pad_id"]


def test_labels_masked_inside_a_cut_sequence_are_counted_in_each_piece(tmp_path):
    """One sequence of 10 tokens cut at capacity 4 into [0:4] [4:8] [8:10], labels -100 at 1, 5, 6
    and 9: each piece's first label is masked too, so its loss tokens are 2, 1 and 0."""
    import pyarrow as pa

    (tmp_path / "in").mkdir()
    labels = [0, -100, 2, 3, 4, -100, -100, 7, 8, -100]
    pq.write_table(pa.table({"input_ids": [list(range(10))], "labels": [labels]}), tmp_path / "in" / "a.parquet")
    for plan_only in (True, False):
        out = tmp_path / ("plan" if plan_only else "packs")
        pack(PackConfig(inputs=[str(tmp_path / "in")], output=str(out), capacity=4, too_long="split",
                        algorithm="concat", plan_only=plan_only))
        table = pq.read_table(out / "data" / "train-00000.parquet")
        assert table.column(SEQ_LOSS_TOKENS).to_pylist() == [[2], [1], [0]]
        assert table.column(NUM_LOSS_TOKENS).to_pylist() == [2, 1, 0]

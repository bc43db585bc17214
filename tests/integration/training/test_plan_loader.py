"""packctl.torch.PackedDataset on a plan (`pack --plan-only`) yields what it yields on the output
`packctl materialize` writes of it: the same keys, the same arrays byte for byte (dtype, values,
read-only), the same batches from every collate function, for every pack, rank and epoch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support.adversary import packctl  # noqa: E402
from support.data import sample_corpus  # noqa: E402
from packctl import PackctlError  # noqa: E402
from packctl.torch import PackedDataset, collate_flash_attn, collate_hf, collate_thd  # noqa: E402

pytestmark = pytest.mark.torch

BASE = ["--capacity", "256", "--too-long", "split", "--shard-rows", "150", "-q"]
CONFIGS = {
    "split": ([], [{}]),
    "cp2": (["--cp-size", "2"], [{}]),
    "steps": (["--dp-size", "2", "--micro-batches", "2"], [{"dp_rank": 0, "dp_size": 2}, {"dp_rank": 1}, {}]),
    "shuffle": (["--order", "shuffle", "--seed", "5"], [{"dp_rank": 1, "dp_size": 3}, {}]),
    "epochs": (["--order", "shuffle", "--epochs", "2"], [{"epoch": 0}, {"epoch": 1}]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sample_corpus(tmp_path_factory.mktemp("corpus") / "corpus", sequences=300, distribution="lognormal",
                         shards=2, seed=2, max_length=600)


def assert_same_items(a: PackedDataset, b: PackedDataset) -> None:
    assert len(a) == len(b) and len(a) > 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert list(x) == list(y), i
        for key in x:
            if isinstance(y[key], np.ndarray):
                assert x[key].dtype == y[key].dtype and x[key].tobytes() == y[key].tobytes(), (i, key)
                assert x[key].flags.writeable == y[key].flags.writeable, (i, key)
            else:
                assert type(x[key]) is type(y[key]) and x[key] == y[key], (i, key)
    for collate in (collate_flash_attn, collate_hf, collate_thd):
        for lo in range(0, len(a) - 1, 8):  # batches of 2 from an even pack: one step with --micro-batches 2
            got, want = collate([a[lo], a[lo + 1]]), collate([b[lo], b[lo + 1]])
            assert list(got) == list(want)
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
                else:
                    assert got[key] == value, key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_plan_reads_as_its_materialized_output(tmp_path, corpus, name):
    options, views = CONFIGS[name]
    plan, made = tmp_path / "plan", tmp_path / "made"
    assert packctl("pack", corpus, "-o", plan, *BASE, *options, "--plan-only").code == 0
    assert packctl("materialize", plan, "-o", made, "-q").code == 0
    for view in views:
        assert_same_items(PackedDataset(plan, **view), PackedDataset(made, **view))
    # a small block cache decodes blocks again: the same items
    assert_same_items(PackedDataset(plan, source_cache_bytes=1, **views[0]), PackedDataset(made, **views[0]))


def test_the_dataset_of_a_plan_pickles_without_its_blocks(tmp_path, corpus):
    import pickle

    plan = tmp_path / "plan"
    assert packctl("pack", corpus, "-o", plan, *BASE, "--plan-only").code == 0
    dataset = PackedDataset(plan)
    first = dataset[0]
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._blocks.held == 0 and copy[0]["input_ids"].tobytes() == first["input_ids"].tobytes()


def test_a_plan_whose_source_changed_is_refused(tmp_path, corpus):
    import shutil

    source = tmp_path / "corpus"
    shutil.copytree(corpus, source)
    plan = tmp_path / "plan"
    assert packctl("pack", source, "-o", plan, *BASE, "--plan-only").code == 0
    first = sorted(source.glob("*.parquet"))[0]
    first.rename(tmp_path / "moved.parquet")
    with pytest.raises(PackctlError, match=f"{first}: source of the plan .* is missing"):
        PackedDataset(plan)


def test_a_plan_of_megatron_pairs_reads_as_its_materialized_output(tmp_path):
    """The loader on a plan of `.bin/.idx` pairs (uint16 and int32) gathers each pack's tokens
    from the pairs: the items and batches of the materialized output."""
    from support.megatron import random_documents, write_pair

    for k, dtype in enumerate((np.uint16, np.int32)):
        write_pair(tmp_path / "pairs" / f"part-{k}", random_documents(5 + k, 150, high=60000, max_length=90), dtype)
    options = ["--capacity", "256", "--too-long", "split", "--order", "shuffle", "--shard-rows", "16", "-q"]
    plan, packed = tmp_path / "plan", tmp_path / "packed"
    assert packctl("pack", str(tmp_path / "pairs"), "-o", str(plan), "--plan-only", *options).code == 0
    assert packctl("pack", str(tmp_path / "pairs"), "-o", str(packed), *options).code == 0
    assert_same_items(PackedDataset(str(plan)), PackedDataset(str(packed)))

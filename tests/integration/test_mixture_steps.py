"""`pack --source` with `--dp-size`: each source's share of every optimizer step, measured from
the shards' `step` and `source_ids` columns against `_metrics.json`'s `worst_step_deviation`,
and the bound docs/mixtures.md states: a blend's step is planned from a run of consecutive uses,
so under every algorithm and step grouping it holds the window tolerance at its own size."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack
from support.data import write_table

SOURCES = {"web": (3000, 120, 0.45), "code": (300, 400, 0.25), "math": (600, 60, 0.15), "chat": (200, 250, 0.1),
           "tiny": (50, 20, 0.05)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture-steps")
    for seed, (name, (rows, longest, _)) in enumerate(SOURCES.items()):
        lengths = np.random.default_rng(seed).integers(1, longest + 1, rows)
        write_table(root / name / "p.parquet", {"input_ids": pa.array([[seed] * int(n) for n in lengths],
                                                                      pa.list_(pa.int32()))})
    return {name: root / name for name in SOURCES}


def _steps(paths, out: Path, names: list[str], **options) -> tuple[np.ndarray, np.ndarray, dict]:
    total = sum(SOURCES[n][2] for n in names)
    weights = np.array([SOURCES[n][2] / total for n in names])
    sources = {n: {"path": str(paths[n]), "weight": SOURCES[n][2], "max-repeat": 50.0} for n in names}
    result = pack(PackConfig(output=str(out), sources=sources, capacity=512, window=300, dp_size=2,
                             micro_batches=2, tokens=60_000, order="shuffle", **options))
    table = pq.read_table(out / "data", columns=["seq_lens", "source_ids", "step"])
    per_pack = np.array([len(x) for x in table.column("seq_lens").to_pylist()])
    lens = np.concatenate(table.column("seq_lens").to_numpy(zero_copy_only=False))
    source = np.concatenate(table.column("source_ids").to_numpy(zero_copy_only=False))
    step = np.repeat(table.column("step").to_numpy(), per_pack)
    steps, at = np.unique(step, return_inverse=True)
    tokens = np.zeros((len(steps), len(names)))
    np.add.at(tokens, (at, source), lens)
    return tokens, weights, result.metrics["mixture"]


@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("algorithm", ["concat", "ffd", "bfd", "ffs", "pool"])
@pytest.mark.parametrize("grouping", ["cost", "order"])
def test_every_step_within_the_stated_bound(tmp_path, paths, count, algorithm, grouping):
    names = list(SOURCES)[:count]
    tokens, weights, mixture = _steps(paths, tmp_path / "out", names, algorithm=algorithm, step_grouping=grouping)
    shares = tokens / tokens.sum(axis=1, keepdims=True)
    worst = np.abs(shares - weights).max(axis=0)
    assert worst == pytest.approx([s["worst_step_deviation"] for s in mixture["sources"]])
    realized = np.array([s["realized"] for s in mixture["sources"]])
    longest = np.array([SOURCES[n][1] for n in names])
    step_tokens = tokens.sum(axis=1, keepdims=True)
    bound = longest + realized * longest.sum() + np.abs(realized - weights) * step_tokens
    assert (np.abs(tokens - weights * step_tokens) <= bound + 1e-6).all()


def test_a_sequence_split_over_more_packs_than_a_step_is_refused_in_one_line(tmp_path, paths):
    from support.adversary import assert_clean_error, packctl

    result = packctl("pack", "--source", f"web={paths['web']}:0.5", "--source", f"code={paths['code']}:0.5",
                     "--capacity", "128", "--too-long", "split", "--dp-size", "1", "--micro-batches", "2",
                     "-q", "-o", tmp_path / "out")
    assert_clean_error(result, 2, "code/p.parquet row", "packs, more than the 2 packs of an optimizer step",
                       "--micro-batches")

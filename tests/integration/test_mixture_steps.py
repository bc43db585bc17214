"""`pack --source` with `--dp-size`: each source's share of every optimizer step, measured from
the shards' `step` and `source_ids` columns against `_metrics.json`'s `worst_step_deviation`,
and the bounds docs/mixtures.md states: with --algorithm concat and --step-grouping order a step
is a run of consecutive uses and holds the window tolerance at its own size; any other planner
sorts or regroups a window's sequences, and a step may hold one source only."""
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
    assert (worst <= np.maximum(weights, 1 - weights) + 1e-9).all()  # the bound that holds for every planner
    if algorithm == "concat" and grouping == "order":
        realized = np.array([s["realized"] for s in mixture["sources"]])
        longest = np.array([SOURCES[n][1] for n in names])
        step_tokens = tokens.sum(axis=1, keepdims=True)
        bound = longest + realized * longest.sum() + np.abs(realized - weights) * step_tokens
        assert (np.abs(tokens - weights * step_tokens) <= bound + 1e-6).all()


@pytest.mark.parametrize("count", [2, 3, 5])
@pytest.mark.parametrize("algorithm", ["concat", "ffd", "ffs", "pool"])
def test_step_grouping_source_keeps_each_step_nearer_the_blend(tmp_path, paths, count, algorithm):
    """--step-grouping source takes, window by window, the planner's order or the packs dealt by
    source, whichever holds the blend better: never worse in any window than the planner's
    consecutive steps (--step-grouping order), and the metrics say what the shards hold."""
    names = list(SOURCES)[:count]
    tokens, weights, mixture = _steps(paths, tmp_path / "source", names, algorithm=algorithm,
                                      step_grouping="source")
    worst = np.abs(tokens / tokens.sum(axis=1, keepdims=True) - weights).max(axis=0)
    assert worst == pytest.approx([s["worst_step_deviation"] for s in mixture["sources"]])
    ordered, _, _ = _steps(paths, tmp_path / "order", names, algorithm=algorithm, step_grouping="order")
    worst_ordered = np.abs(ordered / ordered.sum(axis=1, keepdims=True) - weights).max()
    assert worst.max() <= worst_ordered + 1e-9
    assert tokens.sum() == pytest.approx(ordered.sum())  # the same packs, only regrouped


def test_step_grouping_source_gives_the_same_bytes_on_any_number_of_ranks(tmp_path, paths):
    from support.runs import packed_on_ranks

    sources = {n: {"path": str(paths[n]), "weight": SOURCES[n][2], "max-repeat": 50.0} for n in list(SOURCES)[:3]}
    packed_on_ranks(tmp_path, 2, sources=sources, capacity=512, window=300, dp_size=2, micro_batches=2,
                    tokens=30_000, order="shuffle", algorithm="ffd", step_grouping="source")  # asserts the digests


@pytest.mark.parametrize("options, message", [
    (dict(inputs=["IN"]), "--step-grouping source deals packs into steps by the sources of a blend"),
    (dict(step_tokens=4096, sources="S"), "--step-grouping source needs --micro-batches M"),
])
def test_step_grouping_source_is_refused_without_a_blend_or_with_step_tokens(tmp_path, paths, options, message):
    from packctl.errors import PackctlError

    options = dict(options)
    if options.get("inputs") == ["IN"]:
        options["inputs"] = [str(paths["web"])]
        options.update(micro_batches=2)
    if options.get("sources") == "S":
        options["sources"] = {"web": {"path": str(paths["web"]), "weight": 1.0}}
    with pytest.raises(PackctlError, match=message):
        pack(PackConfig(output=str(tmp_path / "out"), dp_size=2, step_grouping="source", **options))

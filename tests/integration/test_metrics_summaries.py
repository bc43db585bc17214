"""_metrics.json from per-rank summaries: the same figures as the whole plan gives, for any number
of ranks, any algorithm, order and option that adds to the report (balance, batch mode, groups,
epochs, lr scaling, the over-long policies); the summaries themselves add up exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from packctl import PackConfig, PackctlError, pack
from packctl.mpi.comm import SingleComm
from packctl.pipeline.report import padded_batching_over_ranks
from packctl.plan.algorithms import KERNELS
from packctl.plan.metrics import PackSummary, exact_sum_of_squares, pack_metrics, padded_batching_tokens
from packctl.sample import SampleSpec, write_sample

from support.profiles import examples
from support.threadcomm import run_ranks
from support.whole_plan_metrics import assert_same_report, reference_metrics, written_metrics

@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpora")
    write_sample(root / "plain", SampleSpec(sequences=400, shards=3, seed=3, max_length=2500))
    write_sample(root / "grouped", SampleSpec(sequences=300, shards=2, seed=4, max_length=900, groups="rollout"))
    return {"plain": root / "plain", "grouped": root / "grouped"}


CONFIGS = {
    "concat-split": dict(algorithm="concat", too_long="split", window=90),
    "ffs-shuffle": dict(algorithm="ffs", order="shuffle", too_long="split", window=70),
    "mffd-truncate": dict(algorithm="mffd", too_long="truncate", seq_multiple=8, window=150),
    "pool-drop": dict(algorithm="pool", too_long="drop", window=120),
    "balance-sqrt": dict(order="shuffle", too_long="split", window=80, dp_size=2, micro_batches=2, lr_scaling="sqrt"),
    "balance-warmup": dict(order="curriculum", too_long="truncate", window=100, dp_size=3, micro_batches=1,
                           warmup_shapes=True, pad_to="multiple", pack_multiple=64, lr_scaling="linear",
                           batch_unit="sequences"),
    "batch": dict(mode="batch", too_long="split", window=100),
    "batch-buckets-balance": dict(mode="batch", too_long="truncate", window=100, shape_buckets=3, dp_size=2,
                                  micro_batches=2),
    "shape-buckets": dict(too_long="split", window=100, pad_to="multiple", pack_multiple=32, shape_buckets=3),
    "epochs": dict(order="shuffle", too_long="split", window=90, epochs=3),
    "epochs-balance": dict(algorithm="ffs", order="shuffle", too_long="split", window=120, epochs=2, dp_size=2,
                           micro_batches=2, lr_scaling="sqrt"),
    # epochs whose steps differ in their reference batch size: the whole run reports epoch 0's
    "epochs-balance-ref": dict(algorithm="concat", order="shuffle", too_long="split", capacity=512, window=20,
                               epochs=2, dp_size=2, micro_batches=1),
    "groups": dict(corpus="grouped", capacity=8192, order="shuffle", window=20),
    "groups-split": dict(corpus="grouped", capacity=8192, algorithm="ffd", too_long="split", window=25),
    "groups-step": dict(corpus="grouped", capacity=4096, group_scope="step", dp_size=2, micro_batches=2, window=30),
    "groups-epochs": dict(corpus="grouped", capacity=8192, order="shuffle", epochs=2, window=30),
}


def config_of(corpora: dict[str, Path], out: Path, options: dict) -> PackConfig:
    options = dict(options)
    corpus = options.pop("corpus", "plain")
    if corpus == "grouped":
        options["group_column"] = "group_id"
    return PackConfig(inputs=[str(corpora[corpus])], output=str(out), overwrite=True,
                      **{"capacity": 2048, **options})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("ranks", [1, 3])
def test_metrics_are_those_of_the_whole_plan(tmp_path, corpora, name, ranks):
    config = config_of(corpora, tmp_path / "out", CONFIGS[name])
    if ranks == 1:
        pack(config)
    else:
        run_ranks(ranks, lambda comm: pack(config, comm=comm))
    assert_same_report(written_metrics(tmp_path / "out"), reference_metrics(config))


@pytest.mark.slow
@settings(max_examples=examples(100, default=12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(algorithm=st.sampled_from(list(KERNELS)),
       order=st.sampled_from(["input", "shuffle", "curriculum"]),
       too_long=st.sampled_from(["split", "truncate", "drop"]), capacity=st.sampled_from([512, 1024, 4096]),
       window=st.integers(20, 500), seq_multiple=st.sampled_from([1, 8]),
       balance=st.sampled_from([None, (2, 1), (2, 2), (4, 2)]), lr_scaling=st.sampled_from(["none", "sqrt"]),
       epochs=st.sampled_from([1, 1, 2]), ranks=st.integers(1, 5), seed=st.integers(0, 3))
def test_any_plan_reports_the_whole_plan_metrics(tmp_path_factory, corpora, algorithm, order, too_long, capacity,
                                                 window, seq_multiple, balance, lr_scaling, epochs, ranks, seed):
    out = tmp_path_factory.mktemp("out") / "out"
    options = dict(algorithm=algorithm, order=order, too_long=too_long, capacity=capacity, window=window,
                   seq_multiple=seq_multiple, epochs=epochs, seed=seed)
    if balance is not None:
        options.update(dp_size=balance[0], micro_batches=balance[1], lr_scaling=lr_scaling)
    config = config_of(corpora, out, options)
    try:
        config.validate()
    except PackctlError:
        assume(False)
    run_ranks(ranks, lambda comm: pack(config, comm=comm))
    assert_same_report(written_metrics(out), reference_metrics(config))


@settings(max_examples=examples(300), deadline=None)
@given(packs=st.lists(st.lists(st.integers(0, 64), min_size=0, max_size=6), min_size=0, max_size=30),
       cuts=st.lists(st.integers(0, 30), max_size=4), align=st.sampled_from([1, 4]), batch=st.booleans())
def test_summaries_of_runs_of_packs_add_up_to_the_summary_of_all(packs, cuts, align, batch):
    """Any cut of the packs into runs (ranks), summarized and added in any order: the metrics of all."""
    capacity = 64 * 6
    seq_lens = np.array([n for p in packs for n in p], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in packs])]).astype(np.int64)
    pack_lens = np.full(len(packs), capacity, dtype=np.int64)
    rows = np.array([max(len(p), 1) for p in packs], dtype=np.int64) if batch else None

    def summary(lo: int, hi: int) -> PackSummary:
        sub = offsets[lo:hi + 1] - offsets[lo]
        return PackSummary.of(seq_lens[offsets[lo]:offsets[hi]], sub, pack_lens[lo:hi], capacity=capacity,
                              align=align, rows=rows[lo:hi] if batch else None)

    bounds = sorted({0, len(packs), *(min(c, len(packs)) for c in cuts)})
    parts = [summary(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])] or [summary(0, 0)]
    added = sum(reversed(parts[:-1]), parts[-1])
    whole = summary(0, len(packs))
    baseline = padded_batching_tokens(seq_lens, whole.baseline_batch_size)
    assert json.dumps(added.metrics(baseline)) == json.dumps(whole.metrics(baseline))
    assert added.metrics(baseline) == pack_metrics(seq_lens, offsets, pack_lens, capacity=capacity, align=align)
    if batch:
        assert json.dumps(added.batch_metrics(baseline, capacity)) == json.dumps(whole.batch_metrics(baseline,
                                                                                                    capacity))


def test_bin_balance_is_exact():
    # loads 9, 1, 5 of capacity 10: fill stdev sqrt(((.9-.5)^2 + (.1-.5)^2 + 0) / 3) = 0.3266, utilization 0.5
    m = pack_metrics(np.array([9, 1, 5]), np.array([0, 1, 2, 3]), np.array([10, 10, 10]), capacity=10, align=1)
    assert m["bin_balance"] == 1 - np.sqrt(3 * (81 + 1 + 25) - 15**2) / 15
    assert exact_sum_of_squares(np.array([2**31 - 1] * 5)) == 5 * (2**31 - 1) ** 2  # no int64 overflow


@settings(max_examples=examples(200), deadline=None)
@given(lengths=st.lists(st.integers(0, 50), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=5),
       batch=st.integers(1, 7))
def test_padded_batching_over_ranks_is_that_of_the_lengths_end_to_end(lengths, cuts, batch):
    """Batches cut by rank boundaries (a rank may hold none, or a part of one batch only)."""
    lengths = np.array(lengths, dtype=np.int64)
    bounds = sorted({0, len(lengths), *(min(c, len(lengths)) for c in cuts)})
    parts = [lengths[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])] + [lengths[:0]]
    results = run_ranks(len(parts), lambda comm: padded_batching_over_ranks(comm, parts[comm.rank], batch))
    assert results == [padded_batching_tokens(lengths, batch)] * len(parts)
    assert padded_batching_over_ranks(SingleComm(), lengths, batch) == padded_batching_tokens(lengths, batch)

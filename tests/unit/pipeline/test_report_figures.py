"""pipeline/report.py without a pack: the figures of metrics.json from summaries that add up over
ranks (the docstrings' worked examples, and the same figures from any split of the ranks)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.pipeline.report import (STAGES, Corpus, first_seen_steps, limit_report, scale_out, shape_coverage,
                                     throughput)
from support.profiles import examples


def test_limit_report_of_the_docstring():
    report = limit_report({"images": 8}, {"totals": np.array([11]), "at_limit": np.array([1])}, packs=2)
    assert report == {"images": {"limit": 8, "total": 11, "utilization": 0.6875, "packs_at_limit": 1}}
    assert limit_report({"images": 8}, {"totals": np.array([0]), "at_limit": np.array([0])}, packs=0)[
        "images"]["utilization"] == 0.0


def _rank(sequences: int, tokens: int, **timings: float) -> dict:
    return {"token_transfer": "exchange", "read_amplification": 1.25, "sequences_planned": sequences,
            "tokens_written": tokens, "timings": timings, "bytes_sent": 1000 * sequences}


def test_scale_out_is_max_over_mean_of_what_each_rank_did():
    report = scale_out([_rank(30, 100, scan=1.0, plan=2.0), _rank(10, 300, scan=3.0)])
    assert report["ranks"] == 2 and report["token_transfer"] == "exchange" and report["read_amplification"] == 1.25
    assert report["sequences_planned"] == {"max": 30, "mean": 20.0, "max_over_mean": 1.5}
    assert report["tokens_written"] == {"max": 300, "mean": 200.0, "max_over_mean": 1.5}
    # a stage any rank timed; a rank that did not time it counts 0 s
    assert report["stage_seconds"] == {"scan": {"max": 3.0, "mean": 2.0, "max_over_mean": 1.5},
                                       "plan": {"max": 2.0, "mean": 1.0, "max_over_mean": 2.0}}
    assert list(report["stage_seconds"]) == [s for s in STAGES if s in ("scan", "plan")]
    assert report["bytes_exchanged"] == 40_000


def test_scale_out_of_ranks_that_did_nothing_is_even():
    assert scale_out([_rank(0, 0), _rank(0, 0)])["sequences_planned"] == {"max": 0, "mean": 0.0, "max_over_mean": 1.0}


def test_shape_coverage_says_when_every_rank_has_met_every_shape():
    # rank 0 meets 4096 at step 0, 2048 at step 2; rank 1 meets 4096 at step 1 and never 2048
    step, dp_rank, shape = [0, 1, 2, 3], [0, 1, 0, 1], [4096, 4096, 2048, 4096]
    seen, steps = first_seen_steps(np.array(step), np.array(dp_rank), np.array(shape), dp_size=2)
    assert steps == 4 and sorted(seen) == [2048, 4096]
    coverage = shape_coverage(seen, steps)
    assert coverage == {"distinct": 2, "values": [2048, 4096], "all_ranks_seen_by_step": [None, 1],
                        "all_seen_by_step": None, "steps": 4}
    seen[2048][1] = 3  # rank 1 meets 2048 at step 3 too
    assert shape_coverage(seen, steps)["all_seen_by_step"] == 3


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2), st.sampled_from([128, 256, 512])), max_size=30),
       st.integers(1, 3))
def test_first_seen_steps_of_ranks_merge_by_their_minimum(rows, parts):
    """Each rank summarizes its own steps; the minimum over the summaries is the whole table's."""
    step, dp_rank, shape = (np.array([r[k] for r in rows], np.int64) for k in range(3))
    whole, whole_steps = first_seen_steps(step, dp_rank, shape, dp_size=3)
    merged, steps = {}, 0
    for part in np.array_split(np.arange(len(rows)), parts):
        seen, n = first_seen_steps(step[part], dp_rank[part], shape[part], dp_size=3)
        steps = max(steps, n)
        for value, first in seen.items():
            merged[value] = np.minimum(merged.get(value, first), first)
    assert steps == whole_steps and sorted(merged) == sorted(whole)
    assert all(np.array_equal(merged[v], whole[v]) for v in whole)


def test_throughput_leaves_out_compile_time_and_resumed_tokens():
    ranks = [{"peak_rss_bytes": 5, "blocks_read_twice": 1, "spill_files": 0, "spilled_bytes": 0},
             {"peak_rss_bytes": 9, "blocks_read_twice": 2, "spill_files": 3, "spilled_bytes": 30}]
    corpus = Corpus(sequences=1000, tokens=10_000_000, skipped_empty=0, blocks=4)
    report = throughput(corpus, ranks, {"total": 5.0, "compile": 3.0}, resumed_shards=2, resumed_tokens=2_000_000)
    assert report["tokens_per_s"] == pytest.approx(4_000_000) and report["sequences_per_s"] == pytest.approx(500)
    assert (report["peak_rss_bytes"], report["blocks_read_twice"], report["spill_files"], report["spilled_bytes"]) \
        == (9, 3, 3, 30)
    assert report["resumed_shards"] == 2

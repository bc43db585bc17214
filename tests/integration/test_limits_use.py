"""What users see of --limit: the what-if of `packctl stats INPUT --limit` equals what `pack`
writes, `packctl stats OUT` reports each budget from the shards, `--balance-cost` evens out the
vision work of the ranks, and `packctl.torch` hands the limited columns out per batch."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packctl import PackConfig
from packctl.plan.algorithms import KERNELS
from packctl.plan.balance import imbalance_summary
from packctl.sample import SampleSpec, write_sample
from packctl.stats import input_stats, packed_stats, stats
from support.data import write_table
from support.profiles import examples
from support.runs import pack_to

NOT_IN_STATS = ("throughput", "timings")  # run facts of a pack, not properties of the packing

WHOLE_ITEM_ALGORITHMS = [name for name, kernel in KERNELS.items() if not kernel.cuts_items]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    """A small synthetic VLM corpus (`packctl sample --modality image`): images, image_tokens."""
    root = tmp_path_factory.mktemp("vlm") / "in"
    write_sample(root, SampleSpec(sequences=1500, shards=3, max_length=4096, modality="image", seed=4))
    return root


def _shard_columns(out: Path, names: list[str]) -> dict[str, list]:
    manifest = json.loads((out / "_manifest.json").read_text())
    tables = [pq.read_table(out / s["path"], columns=names) for s in manifest["shards"]]
    return {name: [v for t in tables for v in t.column(name).to_pylist()] for name in names}


def _assert_row_is_metrics(row: dict, out: Path, label) -> None:
    metrics = json.loads((out / "_metrics.json").read_text())
    assert "limits" in metrics and "packs_at_capacity" in metrics
    for key, value in metrics.items():
        if key not in NOT_IN_STATS:
            assert row[key] == value, (label, key)


LIMIT_SETTINGS = [
    dict(capacity=4096, limits={"images": 4}, too_long="drop"),
    dict(capacity=4096, limits={"image_tokens": 1152, "images": 3}, too_long="drop", order="shuffle", seed=2,
         window=500),
    dict(capacity=2048, limits={"images": 2}, too_long="drop", order="curriculum", cp_size=2, pad_to="multiple",
         max_seqs_per_bin=6),
    dict(capacity=4096, limits={"images": 4}, too_long="drop", dp_size=4, micro_batches=2, balance_cost="images"),
    dict(capacity=4096, limits={"image_tokens": 1728}, too_long="drop", dp_size=3, step_tokens=20000,
         balance="tokens", balance_cost="image_tokens", order="shuffle"),
]


@pytest.mark.parametrize("options", LIMIT_SETTINGS, ids=["images", "two-limits-shuffle", "curriculum-cp2-multiple",
                                                         "balance-cost", "balance-cost-step-tokens"])
def test_what_if_equals_what_pack_writes(vlm, tmp_path, options):
    planning = {k: v for k, v in options.items() if k != "capacity"}
    algorithms = ("concat", "bfd", "ffs", "pool") if "dp_size" not in options else ("ffd",)
    r = input_stats([str(vlm)], [options["capacity"]], PackConfig(**planning), algorithms=algorithms)
    for algorithm in algorithms:
        _, out = pack_to(tmp_path / algorithm, [vlm], algorithm=algorithm, **options)
        row = next(w for w in r["what_if"] if w["algorithm"] == algorithm)
        _assert_row_is_metrics(row, out, algorithm)
        assert row["counts"] == json.loads((out / "_manifest.json").read_text())["counts"]
        # stats OUT gives the same budget figures, from the shards
        report = packed_stats(out)
        assert report["limits"] == row["limits"] and report["packs_at_capacity"] == row["packs_at_capacity"]
        assert report["binding"] == row["binding"]


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_what_if_equals_pack_on_random_small_corpora(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("random")
    n = data.draw(st.integers(1, 40))
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    images = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    write_table(tmp / "in" / "a.parquet", {"input_ids": pa.array([list(range(1, m + 1)) for m in lengths],
                                                                   pa.list_(pa.int32())),
                                           "images": pa.array(images, pa.uint8())})
    options = dict(capacity=data.draw(st.sampled_from([32, 48])), limits={"images": data.draw(st.integers(1, 6))},
                   too_long="drop", algorithm=data.draw(st.sampled_from(WHOLE_ITEM_ALGORITHMS)),
                   order=data.draw(st.sampled_from(["input", "shuffle"])), window=data.draw(st.integers(3, 50)))
    planning = {k: v for k, v in options.items() if k not in ("capacity", "algorithm")}
    if sum(1 for m, i in zip(lengths, images) if m <= options["capacity"] and i <= options["limits"]["images"]) == 0:
        return  # nothing to pack: pack refuses it (tested elsewhere)
    r = input_stats([str(tmp / "in")], [options["capacity"]], PackConfig(**planning),
                    algorithms=[options["algorithm"]])
    _, out = pack_to(tmp, [tmp / "in"], **options)
    _assert_row_is_metrics(r["what_if"][0], out, options)


def test_stats_out_figures_are_the_sums_of_the_shards(vlm, tmp_path):
    limits = {"images": 4, "image_tokens": 1728}
    _, out = pack_to(tmp_path, [vlm], capacity=4096, limits=limits, too_long="drop", algorithm="bfd")
    cols = _shard_columns(out, ["images", "image_tokens", "images_sum", "image_tokens_sum", "seq_lens"])
    report = stats([str(out)])
    packs = len(cols["seq_lens"])
    layout = json.loads((out / "_manifest.json").read_text())["layout"]
    assert layout["limits"] == limits and report["layout"]["limits"] == limits
    at = {}
    for name, limit in limits.items():
        per_pack = [sum(v) for v in cols[name]]  # recomputed from the per-sequence column
        assert per_pack == cols[f"{name}_sum"]
        f = report["limits"][name]
        assert f["limit"] == limit and f["total"] == sum(per_pack)
        assert f["utilization"] == sum(per_pack) / (packs * limit)
        at[name] = sum(1 for s in per_pack if s * 100 >= 99 * limit)
        assert f["packs_at_limit"] == at[name]
    at_capacity = sum(1 for lens in cols["seq_lens"] if sum(lens) * 100 >= 99 * 4096)  # align 1: padded = true
    assert report["packs_at_capacity"] == at_capacity
    assert report["binding"] == _binding_by_lower_bounds(sum(sum(lens) for lens in cols["seq_lens"]), 4096,
                                                         {name: (sum(cols[f"{name}_sum"]), limit)
                                                          for name, limit in limits.items()})
    expected = report["binding"]
    # the rendered table names every budget and the binding one
    from packctl.cli.render import stats_renderables
    from rich.console import Console
    console = Console(width=100, record=True, file=io.StringIO())
    for renderable in stats_renderables(report):
        console.print(renderable)
    text = console.export_text()
    assert "budgets" in text and f"binding: {expected}" in text
    assert "limit 1,728: utilization" in text and "· binds" in text


def _binding_by_lower_bounds(padded_tokens: int, capacity: int, budgets: dict[str, tuple[int, int]]) -> str:
    """The reference: the budget that alone needs the most packs, ceil(total / limit); among equals
    the fullest (total / limit), then tokens, then the first limit."""
    import math

    needs = [("tokens", padded_tokens, capacity), *((name, t, n) for name, (t, n) in budgets.items())]
    best = needs[0]
    for need in needs[1:]:
        name, total, limit = need
        if (math.ceil(total / limit), total * best[2]) > (math.ceil(best[1] / best[2]), best[1] * limit):
            best = need
    return best[0]


def test_binding_budget_is_the_one_that_sets_the_pack_count(tmp_path):
    """The README's multimodal example, smaller: 576-token tiles stop a pack at 8,064 image tokens,
    under 99% of --limit image_tokens=8192, so no pack is "at" that limit; yet the image tokens
    need the most packs (ceil(total / 8192)) and fill 96% of their budget while tokens fill 66%:
    image_tokens binds, in the what-if, in `pack`'s summary and in `stats OUT`."""
    from rich.console import Console

    from packctl.cli.render import pack_table

    corpus = tmp_path / "vlm"
    write_sample(corpus, SampleSpec(sequences=2000, shards=2, max_length=8192, modality="image", max_tiles=5))
    options = dict(capacity=16384, limits={"images": 8, "image_tokens": 8192}, too_long="drop", algorithm="bfd")
    row = input_stats([str(corpus)], [16384], PackConfig(**{k: v for k, v in options.items() if k != "capacity"}),
                      algorithms=["bfd"])["what_if"][0]
    image_tokens = row["limits"]["image_tokens"]
    assert image_tokens["packs_at_limit"] == 0 and image_tokens["utilization"] > 0.9 > 0.7 > row["utilization"]
    assert row["binding"] == "image_tokens" == _binding_by_lower_bounds(
        row["tokens"] + row["padding"]["alignment_tokens"], 16384,
        {name: (f["total"], f["limit"]) for name, f in row["limits"].items()})
    result, out = pack_to(tmp_path, [corpus], **options)
    assert packed_stats(out)["binding"] == "image_tokens"
    screen = Console(width=120, record=True, file=io.StringIO())
    screen.print(pack_table(result))
    assert "binding: image_tokens" in screen.export_text()


def test_stats_json_of_an_output_with_limits(vlm, tmp_path):
    from support.adversary import packctl
    _, out = pack_to(tmp_path, [vlm], capacity=4096, limits={"images": 4}, too_long="drop")
    result = packctl("stats", str(out), "--json")
    assert result.code == 0, result.stderr
    report = json.loads(result.stdout)
    metrics = json.loads((out / "_metrics.json").read_text())
    assert report["limits"] == metrics["limits"] and report["packs_at_capacity"] == metrics["packs_at_capacity"]
    assert report["binding"] in ("tokens", "images")


def test_what_if_table_shows_each_budget(vlm):
    from support.adversary import packctl
    result = packctl("stats", str(vlm), "--capacity", "4096", "--limit", "images=4", "--limit",
                     "image_tokens=1152", "--too-long", "drop")
    assert result.code == 0, result.stderr
    assert "images" in result.stdout and "image_tokens" in result.stdout and "binds" in result.stdout
    assert "over a --limit" in result.stdout  # the recommendation says why rows were dropped
    result = packctl("stats", str(vlm), "--capacity", "4096", "--limit", "images=4", "--too-long", "drop", "--json")
    rows = json.loads(result.stdout)["what_if"]
    assert all(set(r["limits"]) == {"images"} and r["binding"] in ("tokens", "images") for r in rows)


def test_balance_cost_evens_out_vision_work_in_the_output(vlm, tmp_path):
    options = dict(capacity=4096, limits={"images": 8, "image_tokens": 2304}, too_long="drop", dp_size=4,
                   micro_batches=4, algorithm="bfd")
    _, plain = pack_to(tmp_path / "plain", [vlm], **options)
    _, even = pack_to(tmp_path / "even", [vlm], balance_cost="image_tokens", **options)

    def vision(out):
        cols = _shard_columns(out, ["step", "dp_rank", "image_tokens_sum"])
        grid = np.zeros((max(cols["step"]) + 1, 4))
        np.add.at(grid, (cols["step"], cols["dp_rank"]), cols["image_tokens_sum"])
        return imbalance_summary(grid)["weighted"]
    metrics = json.loads((even / "_metrics.json").read_text())["balance"]
    assert metrics["balance_cost"] == "image_tokens"
    assert metrics["after"]["image_tokens"]["weighted"] == pytest.approx(vision(even))
    assert metrics["before"]["image_tokens"]["weighted"] > metrics["after"]["image_tokens"]["weighted"]
    assert "balance_cost" not in json.loads((plain / "_metrics.json").read_text())["balance"]
    assert vision(even) < vision(plain)
    # every pack still within every limit, and the same samples in both
    for out in (plain, even):
        cols = _shard_columns(out, ["images_sum", "image_tokens_sum"])
        assert max(cols["images_sum"]) <= 8 and max(cols["image_tokens_sum"]) <= 2304
    ids = [sorted(i for v in _shard_columns(o, ["sample_ids"])["sample_ids"] for i in v) for o in (plain, even)]
    assert ids[0] == ids[1]


def test_balance_cost_output_is_the_same_for_any_rank_count_and_verifies(vlm, tmp_path):
    from support.adversary import assert_every_sample_once, packctl
    from support.runs import packed_on_ranks
    # limits no single sample exceeds, so every sample is packed (the checker sees each once)
    options = dict(inputs=[str(vlm)], capacity=4096, limits={"images": 16, "image_tokens": 4096}, too_long="error",
                   dp_size=3, micro_batches=2, balance_cost="images", order="shuffle", window=400)
    out = packed_on_ranks(tmp_path, 3, **options)
    assert packctl("verify", str(out), "--source", str(vlm), "--no-attention").code == 0
    assert_every_sample_once(out, [vlm])

"""`packctl stats` tables in narrow terminals: the what-if of the README (`--capacity 8192
--capacity 16384 --cp-size 2 --too-long split`), the histograms and the table of an OUT of
`pack --epochs` printed 80 and 60 columns wide: no line wider than the terminal, no cell cut
("…"), every number of the report printed whole."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from packctl import PackConfig
from packctl.cli.render import stats_renderables
from packctl.sample import SampleSpec, write_sample
from packctl.stats import input_stats, stats
from support.runs import pack_to


def _readme_what_if(root: Path, sequences: int) -> dict:
    """The README's what-if over `packctl sample --distribution rl-longtail` (100,000 sequences
    there; 20,000 make a table as wide: more than 80 columns in one piece)."""
    write_sample(root, SampleSpec(sequences=sequences, distribution="rl-longtail", shards=1))
    return input_stats([str(root)], [8192, 16384], PackConfig(cp_size=2, too_long="split"))


@pytest.fixture(scope="module", params=[pytest.param(800, id="800-sequences"),
                                        pytest.param(20_000, id="20000-sequences", marks=pytest.mark.slow)])
def what_if(request, tmp_path_factory) -> dict:
    return _readme_what_if(tmp_path_factory.mktemp("corpus") / "in", request.param)


def _printed(report: dict, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    for renderable in stats_renderables(report):
        console.print(renderable)
    return console.export_text()


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


@pytest.mark.parametrize("width", [80, 60])
def test_the_what_if_fits_the_terminal_with_every_number_whole(what_if, width):
    text = _printed(what_if, width)
    lines = text.splitlines()
    assert "…" not in text
    assert max(len(line.rstrip()) for line in lines) <= width
    for row in what_if["what_if"]:
        padding = row["padding"]["alignment_tokens"] + row["padding"]["tail_tokens"]
        for number in (f"{row['packs']:,}", _pct(row["utilization"]), _pct(row["packing_efficiency"]),
                       f"{padding:,}", f"{row['counts']['sequences_split']:,}", f"{row['plan_seconds']:.2f}s",
                       f"+{row['packs'] - row['lower_bound_packs_l2']:,}"):
            assert any(f" {number} " in f" {line} " for line in lines), (width, row["algorithm"], number)
    for cap in what_if["capacities"]:
        pb = cap["padded_batching"]
        for number in (f"{pb['batches']:,}", _pct(pb["utilization"]), f"{pb['padding_tokens']:,}"):
            assert any(f" {number} " in f" {line} " for line in lines), (width, number)
    # each table of the what-if names the rows: the capacity and the algorithm head every one
    assert sum(1 for line in lines if line.split()[:2] == ["C", "algorithm"]) == (1 if width >= 80 else 2)
    # the histogram of lengths keeps each label on one line, its bars shorter
    assert any("1,024 - 2,047" in line and "of tokens" in line for line in lines)


def test_the_table_of_epochs_fits_with_its_headers_whole(tmp_path):
    write_sample(tmp_path / "in", SampleSpec(sequences=300, shards=1, max_length=2048))
    _, out = pack_to(tmp_path, [tmp_path / "in"], capacity=2048, order="shuffle", epochs=3)
    report = stats([str(out)])
    text = _printed(report, 60)
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= 60
    for header in ("utilization", "Spearman overall", "same packs as epoch 0", "packs of 1 sequence"):
        assert header in text, header
    assert all(_pct(r["utilization"]) in text for r in report["epochs"])
    # the report of one output: its overview and histograms
    one = stats([str(out / "epoch-00000")])
    for width in (80, 60):
        text = _printed(one, width)
        assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= width
        assert f"{one['tokens']:,}" in text and _pct(one["utilization"]) in text

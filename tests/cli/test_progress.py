"""Progress and summaries of long commands (packctl/cli/render.py): rates and counts that read
right, bars that stop where a run stopped, the job's totals under several ranks, and summaries of
epochs, plans and resumed runs that say what they count."""
from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from packctl.cli.render import ECHO_ROOM, LogProgress, RichProgress, counted, rate
from packctl.config import PackConfig
from packctl.pipeline import pack
from packctl.runtime import Progress, job_stage
from support.threadcomm import run_ranks

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_slow_rates_keep_their_digits_and_one_is_singular():
    assert [rate(x) for x in (0.5, 0.0123, 8.25, 42.13, 25.0, 99.99, 1234.4)] == [
        "0.5", "0.0123", "8.25", "42.1", "25", "100", "1,234"]
    assert [counted(n, "blocks") for n in (0, 1, 2, 1000)] == ["0 blocks", "1 block", "2 blocks", "1,000 blocks"]
    now = [0.0]
    out = io.StringIO()
    progress = LogProgress(out, interval=100, clock=lambda: now[0])
    advance = progress.stage("scan", 1)
    now[0] = 2.0
    advance(1)
    progress.close()
    assert out.getvalue().splitlines() == ["packctl: scan: 1 block",
                                           "packctl: scan done: 1 block in 2.0s, 0.5 blocks/s"]


def _terminal(width: int = 80) -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=width, color_system=None), screen


def _last_frame(screen: io.StringIO) -> list[str]:
    """The lines of the last drawing of the live display (rich redraws it after cursor moves)."""
    text = ANSI.sub("\n", screen.getvalue().replace("\r", "\n"))
    return [line for line in text.splitlines() if line.strip()]


def test_a_stopped_stage_keeps_its_bar_at_the_count_reached():
    console, screen = _terminal()
    progress = RichProgress(console)
    progress.stage("scan", 4)(4)
    progress.stage("materialize", 100)(30)
    progress.close(stopped=True)  # Ctrl-C in materialize
    last = _last_frame(screen)
    assert any("materialize" in line and "30/100" in line for line in last[-2:]), last[-2:]
    assert not any("30/30" in line for line in last)


def test_a_stopped_stage_is_logged_as_stopped_at_its_count():
    out = io.StringIO()
    progress = LogProgress(out, interval=100, clock=iter([0.0, 0.0, 4.0]).__next__)
    progress.stage("materialize", 50_904)(6_400)
    progress.close(stopped=True)
    assert out.getvalue().splitlines()[-1] == ("packctl: materialize stopped: 6,400 packs of 50,904 in 4.0s, "
                                               "1,600 packs/s")


def test_a_stage_that_ends_shows_its_bar_full():
    console, screen = _terminal()
    progress = RichProgress(console)
    progress.stage("scan", 4)(3)  # a total counted ahead
    progress.stage("plan", 10)(10)
    progress.close()
    assert any("scan" in line and "3/3" in line for line in _last_frame(screen))


def test_bars_leave_the_last_columns_free_for_the_ctrl_c_echo():
    console, screen = _terminal(80)
    progress = RichProgress(console)
    for name in ("scan", "plan", "materialize"):
        progress.stage(name, 123_456_789)(61_000_000)
    progress.close(stopped=True)
    widths = [len(line.rstrip()) for line in _last_frame(screen)]
    assert widths and max(widths) <= 80 - ECHO_ROOM


def test_job_stage_draws_the_job_total_from_this_ranks_share():
    out = io.StringIO()
    progress = LogProgress(out, interval=0, clock=iter(range(100)).__next__)
    advance = job_stage(progress, "materialize", 6_400, 25_600)
    advance(3_200)
    advance(3_200)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "packctl: materialize: 25,600 packs"
    assert lines[1].startswith("packctl: materialize 12,800/25,600 packs (50%)")
    assert lines[-1].startswith("packctl: materialize done: 25,600 packs")


class _Recorded(Progress):
    def __init__(self):
        self.totals: dict[str, int | None] = {}
        self.done: dict[str, int] = {}

    def stage(self, name, total):
        self.totals[name], self.done[name] = total, 0

        def advance(n):
            self.done[name] += n
        return advance


@pytest.mark.slow
def test_under_several_ranks_progress_counts_the_job(tmp_path, sample_data):
    recorded = _Recorded()

    def run(comm):
        return pack(PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "out"), too_long="split"),
                    comm=comm, progress=recorded if comm.rank == 0 else None)

    result = run_ranks(3, run)[0]
    assert recorded.totals["plan"] == recorded.done["plan"] == result.counts["sequences_in"]
    assert recorded.totals["materialize"] == recorded.done["materialize"] == result.counts["packs"]
    assert recorded.totals["scan"] == recorded.done["scan"] == result.metrics["throughput"]["blocks"]


def _summary(result) -> str:
    from packctl.cli.render import pack_table

    console, screen = _terminal(160)
    console.print(pack_table(result))
    return " ".join(ANSI.sub("", screen.getvalue()).split())


def test_the_summary_of_epochs_says_tokens_per_epoch(tmp_path, sample_data):
    result = pack(PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "out"), too_long="split",
                             order="shuffle", epochs=2))
    c = result.counts
    assert c["tokens_packed"] == 2 * c["tokens_in"]
    assert f"tokens packed │ {c['tokens_in']:,} of {c['tokens_in']:,} per epoch (x2: {c['tokens_packed']:,})" in \
        _summary(result)


def test_the_summary_of_a_plan_says_planned(tmp_path, sample_data):
    result = pack(PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "plan"), too_long="split",
                             plan_only=True))
    text = _summary(result)
    assert "tokens planned" in text and "tokens packed" not in text
    assert re.search(r"throughput │ [\d,]+ seq/s, [\d.,]+ M tok/s planned", text), text


def test_a_resumed_run_counts_only_the_tokens_it_wrote():
    from packctl.pipeline.report import Corpus, throughput

    corpus = Corpus(sequences=1000, tokens=10_000_000, skipped_empty=0, blocks=1)
    ranks = [{"peak_rss_bytes": 1, "blocks_read_twice": 0, "spill_files": 0, "spilled_bytes": 0}]
    speed = throughput(corpus, ranks, {"total": 2.0}, resumed_shards=4, resumed_tokens=8_000_000)
    assert speed["tokens_per_s"] == 1_000_000 and speed["sequences_per_s"] == 500


def test_the_summary_of_a_resumed_run_says_what_it_left_out(tmp_path, sample_data):
    import dataclasses

    result = pack(PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "out"), too_long="split"))
    metrics = {**result.metrics, "throughput": {**result.metrics["throughput"], "resumed_shards": 1}}
    assert "1 shard kept from the interrupted run left out" in _summary(dataclasses.replace(result, metrics=metrics))


@pytest.fixture(scope="module")
def small_output(tmp_path_factory, sample_data):
    out = tmp_path_factory.mktemp("progress") / "out"
    pack(PackConfig(inputs=[str(sample_data)], output=str(out), too_long="split", shard_rows=100))
    return out


def test_verify_shows_its_checks_and_times_each(small_output, sample_data):
    from packctl.verify import VerifyOptions, verify

    recorded = _Recorded()
    report = verify(small_output, VerifyOptions(source=[str(sample_data)], attention=False), progress=recorded)
    shards = report.checks["structure"].details["shards"]
    assert shards > 1
    assert recorded.totals == {"structure": shards, "conservation": 4} and recorded.done == recorded.totals
    assert report.checks["structure"].seconds > 0 and report.checks["conservation"].seconds > 0
    assert report.checks["attention"].seconds is None  # skipped
    assert set(report.to_dict()["checks"]["structure"]) >= {"status", "seconds"}


def test_verify_says_which_check_is_slow_and_how_to_skip_it():
    from packctl.cli.render import verify_table
    from packctl.verify.report import CheckResult, VerifyReport

    report = VerifyReport("out", {"structure": CheckResult("ok", ["4 shards"], seconds=2.0),
                                  "attention": CheckResult("ok", ["sdpa fp32"], seconds=350.0),
                                  "contamination": CheckResult("ok", ["8 packs"], seconds=9.0)}, [])
    console, screen = _terminal(120)
    console.print(verify_table(report))
    text = ANSI.sub("", screen.getvalue())
    assert re.search(r"attention\s*│\s*ok\s*│\s*350\.0s", text), text
    assert "time 361.0s, attention 350.0s of it (--no-attention skips the attention and contamination checks)" in text


def test_sample_shows_the_shards_it_writes(tmp_path):
    from packctl.sample import SampleSpec, write_sample

    recorded = _Recorded()
    paths = write_sample(tmp_path / "c", SampleSpec(sequences=50, shards=3), progress=recorded)
    assert len(paths) == 3 and recorded.totals == {"generate": None, "write": 3} and recorded.done["write"] == 3


def test_export_shows_the_shards_it_reads(small_output, tmp_path):
    from packctl.export import export

    recorded = _Recorded()
    export(small_output, tmp_path / "nemo", "nemo", progress=recorded)
    shards = len(list(small_output.glob("data/*.parquet")))
    assert recorded.totals == {"export": shards} == recorded.done


def test_without_a_terminal_verify_prints_its_result_alone(small_output):
    from support.runs import run_cli

    proc = run_cli("verify", str(small_output), "--no-attention")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert re.search(r"time [\d.]+s, (structure|conservation) [\d.]+s of it", proc.stdout), proc.stdout


def test_on_a_terminal_export_draws_its_bars(small_output, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import packctl.cli.render
    from packctl.cli import app

    shown = []

    class Recorded(packctl.cli.render.RichProgress):
        def stage(self, name, total):
            shown.append((name, total))
            return super().stage(name, total)

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    monkeypatch.setattr(packctl.cli.render, "RichProgress", Recorded)
    args = ["export", str(small_output), "-o", str(tmp_path / "e"), "--format", "nemo"]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert shown == [("export", len(list(small_output.glob("data/*.parquet"))))]
    assert CliRunner().invoke(app, [*args[:3], str(tmp_path / "q"), *args[4:], "-q"]).exit_code == 0
    assert len(shown) == 1  # -q: no bars

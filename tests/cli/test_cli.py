"""Command-line conveniences: --version, -q quiet everywhere, sample --json."""
from __future__ import annotations

import json
import os

from support.runs import run_cli
from packctl.version import __version__


def test_version_flag():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"packctl {__version__}"


def test_sample_json_lists_what_it_wrote(tmp_path):
    proc = run_cli("sample", "-o", str(tmp_path / "c"), "--sequences", "12", "--shards", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["sequences"] == 12 and len(report["shards"]) == 3
    assert all((tmp_path / "c" / f"shard-{k:05d}.parquet").as_posix() == path
               for k, path in enumerate(report["shards"]))


def test_quiet_hides_the_progress_bars_on_a_terminal(tmp_path, sample_data, monkeypatch):
    from rich.console import Console
    from typer.testing import CliRunner

    import packctl.cli.render
    from packctl.cli import app

    shown = []

    class Recorded(packctl.cli.render.RichProgress):
        def __init__(self, console):
            shown.append(console)
            super().__init__(console)

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    monkeypatch.setattr(packctl.cli.render, "RichProgress", Recorded)
    args = ["pack", str(sample_data), "-o", str(tmp_path / "out"), "--too-long", "split", "--overwrite"]
    assert CliRunner().invoke(app, [*args, "-q"]).exit_code == 0
    assert shown == []
    assert CliRunner().invoke(app, args).exit_code == 0
    assert len(shown) == 1  # without -q a terminal shows them


def test_log_progress_prints_stage_lines_with_rate_and_eta():
    import io

    from packctl.cli.render import LogProgress

    now = [0.0]
    out = io.StringIO()
    progress = LogProgress(out, interval=10, clock=lambda: now[0])
    advance = progress.stage("materialize", 1000)
    now[0] = 5.0
    advance(100)  # within the interval: no line
    now[0] = 10.0
    advance(150)  # 250 packs in 10 s: 25/s, 750 left: eta 30 s
    progress.stage("report", None)
    progress.close()
    assert out.getvalue().splitlines() == [
        "packctl: materialize: 1,000 packs",
        "packctl: materialize 250/1,000 packs (25%), 25 packs/s, eta 30s",
        "packctl: materialize done: 250 packs in 10.0s, 25 packs/s",
        "packctl: report",
        "packctl: report done in 0.0s",
    ]


def test_log_progress_rates_leave_out_compiling(monkeypatch):
    import io

    import packctl.jit
    from packctl.cli.render import LogProgress

    now, compiled = [0.0], [0.0]
    monkeypatch.setattr(packctl.jit, "compile_seconds", lambda: compiled[0])
    out = io.StringIO()
    progress = LogProgress(out, interval=100, clock=lambda: now[0])
    advance = progress.stage("plan", 2000)
    now[0], compiled[0] = 2.0, 1.5  # 1.5 s of the 2 s compiled kernels
    advance(2000)
    progress.close()
    assert out.getvalue().splitlines()[-1] == (
        "packctl: plan done: 2,000 sequences in 2.0s, 4,000 sequences/s "
        "(after 1.5s compiling kernels, once per install)")


def test_compile_clock_counts_a_kernel_compiled_on_first_call():
    import numpy as np

    from packctl.jit import CompileClock, njit

    @njit  # no cache: compiled in this process
    def total(values):
        out = 0
        for v in values:
            out += v
        return out

    clock = CompileClock()
    assert clock.seconds == 0.0
    assert total(np.arange(5)) == 10
    first = clock.seconds
    assert first > 0.0
    assert total(np.arange(3)) == 3  # compiled already: no more compile time
    assert clock.seconds == first


def test_throughput_leaves_out_compiling():
    from packctl.pipeline.report import Corpus, throughput

    corpus = Corpus(sequences=1000, tokens=50_000, skipped_empty=0, blocks=1)
    ranks = [{"peak_rss_bytes": 1, "blocks_read_twice": 0, "spill_files": 0, "spilled_bytes": 0}]
    speed = throughput(corpus, ranks, {"total": 3.0, "compile": 2.0}, resumed_shards=0)
    assert speed["sequences_per_s"] == 1000 and speed["tokens_per_s"] == 50_000


def test_without_a_terminal_a_run_logs_its_stages_unless_quiet(tmp_path, sample_data):
    args = ["pack", str(sample_data), "-o", str(tmp_path / "out"), "--too-long", "split", "--overwrite"]
    logged = run_cli(*args)
    assert logged.returncode == 0, logged.stderr
    for line in ("packctl: scan: 4 blocks", "packctl: plan done: 2,000 sequences", "packctl: materialize done:"):
        assert line in logged.stderr
    quiet = run_cli(*args, "-q")
    assert quiet.returncode == 0 and "packctl:" not in quiet.stderr


def test_choice_options_list_their_values_in_help():
    proc = run_cli("pack", "--help")
    text = " ".join(proc.stdout.split())
    for flag, values in (("--algorithm", "concat|ffd|bfd|mffd|ffs|split|pool"), ("--order", "input|shuffle|curriculum"),
                         ("--too-long", "error|drop|truncate|split"), ("--pad-to", "capacity|multiple"),
                         ("--mode", "pack|batch"), ("--token-transfer", "auto|exchange|read")):
        assert f"{flag} [{values}]" in text, flag


def _complete(words: str) -> list[str]:
    """What bash completion offers for the last word (click's protocol, as the installed script asks)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, _PACKCTL_COMPLETE="complete_bash", COMP_WORDS=words,
               COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)))
    code = "import sys; sys.argv = ['packctl']; from packctl.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_shell_completion_offers_the_choices():
    assert _complete("packctl pack --algorithm ") == ["concat", "ffd", "bfd", "mffd", "ffs", "split", "pool"]
    assert _complete("packctl pack --too-long tr") == ["truncate"]
    assert _complete("packctl stats --order c") == ["curriculum"]
    assert _complete("packctl verify --backend f") == ["flash-attn", "flex"]
    assert _complete("packctl sample --distribution r") == ["rl-longtail"]


def test_cli_choice_lists_match_the_implementations():
    from packctl.cli.options import SAMPLE_DISTRIBUTIONS, SAMPLE_GROUPS, SAMPLE_MODALITIES, VERIFY_BACKENDS
    from packctl.sample import DISTRIBUTIONS, GROUP_KINDS, MODALITIES
    from packctl.verify.backends import BACKENDS

    assert SAMPLE_DISTRIBUTIONS == DISTRIBUTIONS and VERIFY_BACKENDS == BACKENDS
    assert SAMPLE_GROUPS == GROUP_KINDS and SAMPLE_MODALITIES == MODALITIES


def test_the_command_line_loads_no_heavy_module_before_it_needs_one():
    """`packctl --help` and option parsing import neither numpy, pyarrow, polars, numba nor torch
    (0.55 s of imports before: the help now answers in about 0.1 s). Checked by module, not by time."""
    import subprocess
    import sys

    code = ("import sys, packctl, packctl.cli; "
            "print(sorted(m for m in ('numpy', 'pyarrow', 'pandas', 'polars', 'numba', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_packing_never_imports_pandas(tmp_path, sample_data):
    """pyarrow imports pandas (about 0.25 s) on `pa.array(ndarray)` and `.to_numpy()`; the pack
    path converts through buffers (packctl.contract.arrow) and never pays it. With --dp-size too (its
    step columns go through the same conversion). Checked by module, not by time."""
    import subprocess
    import sys

    for extra in ([], ["--dp-size", "2", "--micro-batches", "2"]):
        args = ["pack", str(sample_data), "-o", str(tmp_path / "out"), "--too-long", "split", "--overwrite", "-q"]
        # -X importtime logs every import as it happens (the CLI ends with os._exit: no code runs after)
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "packctl", *args, *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "pyarrow" in imported and "numba" in imported  # the log is read right
        assert "pandas" not in imported, extra


def test_pack_summary_shows_every_budget_and_the_samples_dropped_over_a_limit(tmp_path):
    import os

    vlm, out = tmp_path / "vlm", tmp_path / "out"
    assert run_cli("sample", "-o", str(vlm), "--modality", "image", "--sequences", "600").returncode == 0
    wide = {**os.environ, "COLUMNS": "240"}  # one line per row of the summary
    proc = run_cli("pack", str(vlm), "-o", str(out), "--capacity", "4096", "--limit", "images=2",
                   "--limit", "image_tokens=1152", "--too-long", "drop", env=wide)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((out / "_metrics.json").read_text())
    over = metrics["counts"]["over_limit"]
    assert over > 0  # samples of 3+ images cannot fit images=2
    assert f"({over:,} dropped over a --limit)" in proc.stdout
    for name, figures in metrics["limits"].items():
        assert f"limit {figures['limit']:,}: utilization" in proc.stdout, name
        assert f"({figures['total']:,} in all)" in proc.stdout, name
    assert "binding: " in proc.stdout


def test_options_use_no_deprecated_typer_api():
    """Building every command's options warns nothing from typer (its `shell_complete=` is
    deprecated and on its way out; completion goes through `autocompletion=`)."""
    import warnings

    import click
    import typer

    from packctl.cli import app

    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module=r"typer(\.|$)")
        group = typer.main.get_command(app)
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            assert command.get_params(click.Context(command, parent=ctx, info_name=name))


def test_help_groups_the_options_and_names_values_as_typed():
    """`pack --help` at 80 columns: the options in their panels (config.PANELS), each value named
    as it is typed (`--capacity N`, `--limit COL=N`), never as a Python type; `-h` is --help."""
    from packctl.config import PANELS

    env = {**os.environ, "COLUMNS": "80"}
    proc = run_cli("pack", "--help", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for title in ("Arguments", *PANELS):
        assert f"{title}:" in lines, title
    for python_type in ("list[str]", "<int>", "<str>", "<path>", "{", "<float>"):
        assert python_type not in proc.stdout, python_type
    assert "Usage: packctl pack [OPTIONS] [INPUT...]" in proc.stdout
    for shown in ("--capacity N", "--limit COL=N", "-o, --output OUT", "--memory-budget SIZE"):
        assert shown in proc.stdout, shown
    packing = lines[lines.index("Packing:"):lines.index("Order:")]
    assert any(line.lstrip().startswith("--too-long") for line in packing)
    assert run_cli("pack", "-h", env=env).stdout == proc.stdout
    for command in ("materialize", "stats", "verify", "export", "sample"):
        shown = run_cli(command, "-h", env=env)
        assert shown.returncode == 0 and shown.stdout.startswith(f"Usage: packctl {command}"), command
        assert "<" not in shown.stdout.replace("<=", "") and "{" not in shown.stdout, command


def test_command_list_gives_each_description_whole():
    """`packctl --help` at 80 columns: each command's first sentence whole (wrapped), none cut
    with "..."."""
    proc = run_cli("-h", env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.split("Commands:")[1]
    assert "..." not in commands
    assert "tokens read from the plan's source." in " ".join(commands.split())
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())

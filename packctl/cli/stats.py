"""`packctl stats`: the report of a packed output, or a what-if over raw input."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import List, Optional

import typer

from packctl.cli.app import Command, app, console, fail, loading_modules
from packctl.cli.options import config_options, with_signature
from packctl.config import PLANNING_OPTIONS, command_line_values, from_command_line, load_config
from packctl.errors import PackctlError

_STATS_EXAMPLE = """How good a packing is, or what-if planning before one (docs/stats.md).

PATH: a packed output (a directory holding _manifest.json), several to compare,
or raw tokenized Parquet (files, directories, globs) for a what-if table.
The options below are every planning option of pack, with the same meaning: the
what-if plans exactly what pack would (every algorithm unless --algorithm is given).
They apply to raw input only; --attn-coeff also sets the balance report of an output.

Examples:

\b
    packctl stats out
    packctl stats out_bfd out_concat --plot compare.png
    packctl stats corpus --capacity 4096 --capacity 8192 --too-long split
"""


_STATS_OWN = [
    inspect.Parameter("paths", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[List[str]],
                      default=typer.Argument(None, metavar="PATH...", help="Packed output(s), or raw Parquet files, "
                                                                           "directories or globs.")),
    inspect.Parameter("capacity", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[List[str]],
                      default=typer.Option(None, metavar="N", help="What-if capacity; repeat it to compare capacities "
                                                      "(--capacity 4096 --capacity 8192).  [default: 4096]")),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--config", help="TOML file of pack options for the what-if.")),
]
_STATS_REPORT = [
    inspect.Parameter("json_output", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--json", help="Print the report as JSON on stdout.")),
    inspect.Parameter("plot", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--plot", help="Also draw the report into this PNG file.")),
    inspect.Parameter("verify_checksums", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(True, "--verify-checksums/--no-verify-checksums",
                                           help="Check each shard of a packed output against its manifest (sha256, "
                                                "rows, tokens, layout) while reading it.")),
]


@app.command("stats", cls=Command, help=_STATS_EXAMPLE)
@with_signature(_STATS_OWN + config_options(PLANNING_OPTIONS) + _STATS_REPORT)
def stats_command(*, paths: Optional[List[str]], capacity: Optional[List[str]], config: Optional[Path],
                  json_output: bool, plot: Optional[Path], verify_checksums: bool, **planning) -> None:
    with loading_modules():
        from packctl.cli.render import stats_renderables
        from packctl.stats import stats

    try:
        report = stats(paths or [], capacities=[from_command_line("capacity", c) for c in capacity or ()] or None,
                       file_values=load_config(config) if config is not None else {}, verify=verify_checksums,
                       **command_line_values(planning))
        if plot is not None:
            from packctl.stats.plot import write_plot

            write_plot(report, plot)
    except PackctlError as exc:
        fail(exc)
    if json_output:
        print(json.dumps(report, indent=2))
    else:
        screen = console()
        for renderable in stats_renderables(report):
            screen.print(renderable)

"""`packctl pack`: its options are PackConfig's fields (packctl/config.py)."""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from packctl.cli.app import Command, StdoutFailed, app, console, fail, loading_modules, ranks_stop_together
from packctl.cli.options import JSON_OUTPUT, QUIET, config_options, with_signature
from packctl.config import FIELDS, build_config, command_line_values, load_config
from packctl.errors import PackctlError

_PACK_EXAMPLE = """Pack tokenized Parquet shards into THD packs.

Example:

\b
    packctl pack sample_data -o out --capacity 4096 --algorithm bfd --too-long split
"""

_PACK_OWN = [
    inspect.Parameter("inputs", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[List[str]],
                      default=typer.Argument(None, metavar="INPUT...", help=FIELDS["inputs"].metadata["help"])),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--config", help="TOML file with any of these options.",
                                           rich_help_panel="Run")),
]

@app.command("pack", cls=Command, help=_PACK_EXAMPLE, no_args_is_help=True)
@with_signature(_PACK_OWN + config_options([n for n in FIELDS if n != "inputs"]) + [JSON_OUTPUT, QUIET])
def pack_command(*, inputs: Optional[List[str]], config: Optional[Path], json_output: bool, quiet: bool,
                 **options) -> None:
    with loading_modules():
        from packctl.mpi.comm import get_comm
        from packctl.pipeline import Progress, pack

    try:
        comm = get_comm()
    except PackctlError as exc:
        fail(exc)
    with ranks_stop_together(comm):
        try:
            file_values = load_config(config) if config is not None else {}
            cfg = build_config(file_values, inputs=inputs or None, **command_line_values(options))
        except PackctlError as exc:
            exc.everywhere = True  # every rank reads the same file and flags: rank 0 says it once
            raise
    shown = Progress()
    if comm.rank == 0 and not (json_output or quiet):  # on a terminal bars, elsewhere (Slurm logs) log lines
        # rich's progress bars and tables load only where they are shown
        from packctl.cli.render import LogProgress, RichProgress

        err = console(stderr=True)
        shown = RichProgress(err) if err.is_terminal else LogProgress()
    progress = _Stages(shown)
    with ranks_stop_together(comm):
        try:
            result = pack(cfg, progress=progress, comm=comm)
        except MemoryError:
            raise PackctlError(_out_of_memory(progress.current, cfg)) from None
    if comm.rank != 0:
        return
    if result.note:
        console(stderr=True, soft_wrap=True).print(result.note, highlight=False, markup=False)
    pad_like = result.metrics.get("throughput", {}).get("tokens_equal_to_pad_id", 0)
    if pad_like and not quiet and not json_output:
        console(stderr=True).print(f"note: {pad_like:,} input tokens equal --pad-token-id {cfg.pad_token_id}; "
                                   "padding is told apart by seq_lens / cu_seqlens, not by its id", highlight=False)
    try:
        if json_output:
            print(json.dumps({"output": str(result.output), "counts": result.counts, "metrics": result.metrics,
                              "shards": len(result.shards)}, indent=2))
        elif not quiet:
            from packctl.cli.render import pack_table

            console().print(pack_table(result))
        sys.stdout.flush()
    except StdoutFailed as exc:
        exc.note = f"{result.output} is complete"  # only the summary is lost: no need to pack again
        raise


class _Stages:
    """The progress display of a run (a packctl.pipeline.Progress, which --help need not import),
    which also remembers the stage it is in: the stage named when the run runs out of memory."""

    def __init__(self, shown):
        self._shown = shown
        self.current: str | None = None

    def stage(self, name: str, total: int | None):
        self.current = name
        return self._shown.stage(name, total)

    def close(self, stopped: bool = False) -> None:
        self._shown.close(stopped)


# Out of memory in a stage of pack: what the stage does, and the options that bound what it holds.
_MEMORY_BY_STAGE = {
    "scan": ("reading the input", "lower --memory-budget (decoded blocks are kept up to it)"),
    "plan": ("planning the packs", "lower --window (sequences planned at once)"),
    "materialize": ("writing the packs", "lower --memory-budget or --capacity"),
}


def _out_of_memory(stage: str | None, cfg) -> str:
    """`out of memory while writing the packs; lower ...`, and where finished shards wait for
    --resume (a run that fails keeps them: packctl/runtime.py after_failure)."""
    from packctl.output.journal import partial_dir

    what, advice = _MEMORY_BY_STAGE.get(stage, ("packing", "lower --memory-budget, --window or --capacity"))
    if stage == "plan" and cfg.epochs > 1:
        advice += "; every epoch is planned before any is written: fewer --epochs hold less"
    if stage == "plan" and cfg.dp_size is not None:
        advice += "; steps are planned per rank: a lower --dp-size or --micro-batches holds less"
    message = f"out of memory while {what}; {advice}"
    partial = partial_dir(Path(cfg.output))
    if partial.is_dir():
        message += f"; the finished shards are kept in {partial}: rerun the same command with --resume to continue"
    return message

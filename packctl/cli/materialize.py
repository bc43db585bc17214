"""`packctl materialize PLAN -o OUT`: the full output of a plan (`pack --plan-only`)."""
from __future__ import annotations

import inspect
import json
import sys

import typer

from packctl.cli.app import Command, StdoutFailed, app, console, fail, loading_modules, ranks_stop_together
from packctl.cli.options import JSON_OUTPUT, QUIET, choice, with_signature
from packctl.config import FIELDS, option_help
from packctl.specs import TokenTransfer
from packctl.errors import PackctlError

_MATERIALIZE_EXAMPLE = """Write the full output of a plan (packctl pack --plan-only): the shards pack writes
without --plan-only, byte for byte, their tokens read from the plan's source.

Example:

\b
    packctl pack sample_data -o plan --plan-only --too-long split
    packctl materialize plan -o out
"""

_PARAMS = [
    inspect.Parameter("plan", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Argument(..., metavar="PLAN", help="Output directory of packctl pack --plan-only.")),
    inspect.Parameter("output", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option(..., "--output", "-o", help="Output directory OUT to write; refused if it "
                                                                       "exists unless --overwrite.")),
    inspect.Parameter("overwrite", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--overwrite/--no-overwrite", help=option_help("overwrite"))),
    inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--resume/--no-resume", help=option_help("resume"))),
    inspect.Parameter("memory_budget", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option(None, "--memory-budget", help=option_help("memory_budget"))),
    inspect.Parameter("token_transfer", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option("auto", "--token-transfer", **choice(FIELDS["token_transfer"].metadata["choices"]),
                                           help=option_help("token_transfer", with_choices=False))),
    JSON_OUTPUT, QUIET,
]


@app.command("materialize", cls=Command, help=_MATERIALIZE_EXAMPLE, no_args_is_help=True)
@with_signature(_PARAMS)
def materialize_command(*, plan: str, output: str, overwrite: bool, resume: bool, memory_budget: str | None,
                        token_transfer: str, json_output: bool, quiet: bool) -> None:
    with loading_modules():
        from packctl import pipeline
        from packctl.mpi.comm import get_comm
        from packctl.pipeline import Progress

    try:
        comm = get_comm()
    except PackctlError as exc:
        fail(exc)
    if token_transfer not in TokenTransfer.values():
        fail(PackctlError(f"--token-transfer {token_transfer!r}: choose one of {', '.join(TokenTransfer.values())}"))
    shown = Progress()
    if comm.rank == 0 and not (json_output or quiet):
        from packctl.cli.render import LogProgress, RichProgress

        err = console(stderr=True)
        shown = RichProgress(err) if err.is_terminal else LogProgress()
    with ranks_stop_together(comm):
        try:
            result = pipeline.materialize_plan(plan, output, overwrite=overwrite, resume=resume,
                                               memory_budget=memory_budget, token_transfer=token_transfer,
                                               progress=shown, comm=comm)
        except MemoryError:
            raise PackctlError("out of memory while writing the packs; lower --memory-budget") from None
    if comm.rank != 0:
        return
    if result.note:
        console(stderr=True, soft_wrap=True).print(result.note, highlight=False, markup=False)
    try:
        if json_output:
            print(json.dumps({"output": str(result.output), "counts": result.counts, "shards": len(result.shards),
                              "timings": result.timings}, indent=2))
        elif not quiet:
            counts = result.counts
            print(f"packctl materialize -> {result.output}: {counts.get('packs', 0):,} packs, "
                  f"{counts.get('tokens_packed', 0):,} tokens in {len(result.shards)} shard(s)")
        sys.stdout.flush()
    except StdoutFailed as exc:
        exc.note = f"{result.output} is complete"
        raise

"""`packctl tokenize`: raw text and chat records -> tokenized Parquet that `packctl pack` reads."""
from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from packctl.cli.app import Command, app, console, loading_modules, ranks_stop_together

_HELP = """Tokenize raw text and chat data (JSONL, JSON, Parquet, text) with a local tokenizer, with loss masks.

The output is tokenized Parquet (input_ids, labels with -100 where no loss) that `packctl pack`
reads as it is.

Example:

\b
    packctl tokenize chat.jsonl -o tokenized --tokenizer ./my-tokenizer
    packctl pack tokenized -o packed --capacity 8192 --too-long split
"""

_FORMATS = "auto, text, messages, prompt-completion, preference"
_LOSS = "assistant, all, last-assistant, completion"


@app.command("tokenize", cls=Command, help=_HELP, no_args_is_help=True)
def tokenize_command(
    inputs: List[str] = typer.Argument(..., metavar="INPUT...",
                                       help="JSONL (.jsonl, .json lines, .jsonl.gz, .jsonl.zst), JSON arrays, Parquet "
                                            "or .txt files, directories of them, or globs."),
    output: str = typer.Option(..., "-o", "--output", help="The tokenized output directory."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="A local Hugging Face tokenizer directory "
                                                           "(tokenizer.json, tokenizer_config.json); never downloaded."),
    format: str = typer.Option("auto", "--format", help=f"The record format: {_FORMATS} (auto: from the column "
                                                        "names)."),
    loss_on: Optional[str] = typer.Option(None, "--loss-on", help=f"Which tokens are trained on: {_LOSS} (default by "
                                                                  "format: text all, messages assistant, "
                                                                  "prompt-completion and preference completion)."),
    text_column: str = typer.Option("text", "--text-column", help="Column of plain text."),
    messages_column: str = typer.Option("messages", "--messages-column", help="Column of chat messages."),
    prompt_column: str = typer.Option("prompt", "--prompt-column", help="Column of prompts."),
    completion_column: str = typer.Option("completion", "--completion-column", help="Column of completions."),
    chosen_column: str = typer.Option("chosen", "--chosen-column", help="Column of preferred answers."),
    rejected_column: str = typer.Option("rejected", "--rejected-column", help="Column of rejected answers."),
    tools_column: str = typer.Option("tools", "--tools-column", help="Column of tool definitions (chat)."),
    add_bos: str = typer.Option("auto", "--add-bos", help="auto, always or never (never doubled)."),
    add_eos: str = typer.Option("auto", "--add-eos", help="auto, always or never (never doubled)."),
    on_bad_row: str = typer.Option("error", "--on-bad-row", help="error (stop naming the row) or drop (count it by "
                                                                 "reason and go on)."),
    group_column: Optional[str] = typer.Option(None, "--group-column", help="Carry this column (GRPO rollouts of "
                                                                           "one prompt); pack it with "
                                                                           "--group-column."),
    keep_column: Optional[List[str]] = typer.Option(None, "--keep-column", help="Carry this input column into the "
                                                                                "output (repeatable)."),
    text_unit: str = typer.Option("line", "--text-unit", help="A .txt record: line (each non-empty line) or "
                                                              "document (the whole file)."),
    shard_records: int = typer.Option(10_000, "--shard-records", help="Input records per output shard."),
    workers: int = typer.Option(0, "--workers", help="Worker processes (0: one per core); the output is the "
                                                     "same for any number."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run, keeping its finished shards."),
    json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    with loading_modules():
        from packctl.mpi.comm import get_comm
        from packctl.runtime import Progress
        from packctl.tokenize.formats import Columns
        from packctl.tokenize.run import TokenizeConfig, tokenize_corpus

    comm = get_comm()
    config = TokenizeConfig(inputs=list(inputs), output=output, tokenizer=tokenizer, format=format, loss_on=loss_on,
                            columns=Columns(text=text_column, messages=messages_column, prompt=prompt_column,
                                            completion=completion_column, chosen=chosen_column,
                                            rejected=rejected_column, tools=tools_column), add_bos=add_bos,
                            add_eos=add_eos, on_bad_row=on_bad_row, group_column=group_column,
                            keep_columns=tuple(keep_column or ()), text_unit=text_unit, shard_records=shard_records,
                            workers=workers, overwrite=overwrite, resume=resume)
    shown = Progress()
    if comm.rank == 0 and not (json_output or quiet):
        from packctl.cli.render import LogProgress, RichProgress

        err = console(stderr=True)
        shown = RichProgress(err) if err.is_terminal else LogProgress()
    with ranks_stop_together(comm):
        result = tokenize_corpus(config, progress=shown, comm=comm)
    if comm.rank != 0:
        return
    if result.note:
        console(stderr=True, soft_wrap=True).print(result.note, highlight=False, markup=False)
    if json_output:
        print(json.dumps({"output": str(result.output), "counts": result.counts,
                          "throughput": result.metrics.get("throughput"), "shards": len(result.shards)}, indent=2))
    elif not quiet:
        from packctl.cli.render import tokenize_table

        console().print(tokenize_table(result))
    sys.stdout.flush()

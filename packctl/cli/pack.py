"""`packctl pack`: its options are PackConfig's fields (packctl/config.py)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from packctl.cli.app import app, fail, ranks_stop_together
from packctl.cli.options import JSON_OUTPUT, QUIET, config_options, with_signature
from packctl.config import FIELDS, build_config, load_config
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
                      default=typer.Option(None, "--config", help="TOML file with any of these options.")),
]

@app.command("pack", help=_PACK_EXAMPLE)
@with_signature(_PACK_OWN + config_options([n for n in FIELDS if n != "inputs"]) + [JSON_OUTPUT, QUIET])
def pack_command(*, inputs: Optional[List[str]], config: Optional[Path], json_output: bool, quiet: bool,
                 **options) -> None:
    from packctl.mpi.comm import get_comm
    from packctl.pipeline import pack
    from packctl.cli.render import LogProgress, RichProgress, summary_table

    try:
        comm = get_comm()
        file_values = load_config(config) if config is not None else {}
        cfg = build_config(file_values, inputs=inputs or None, **options)
    except PackctlError as exc:
        fail(exc)
    err = Console(stderr=True)
    progress = None
    if comm.rank == 0 and not (json_output or quiet):  # on a terminal bars, elsewhere (Slurm logs) log lines
        progress = RichProgress(err) if err.is_terminal else LogProgress()
    with ranks_stop_together(comm):
        result = pack(cfg, progress=progress, comm=comm)
    if comm.rank != 0:
        return
    if result.note:
        Console(stderr=True, soft_wrap=True).print(result.note, highlight=False, markup=False)
    pad_like = result.metrics.get("throughput", {}).get("tokens_equal_to_pad_id", 0)
    if pad_like and not quiet and not json_output:
        Console(stderr=True).print(f"note: {pad_like:,} input tokens equal --pad-token-id {cfg.pad_token_id}; "
                                   "padding is told apart by seq_lens / cu_seqlens, not by its id", highlight=False)
    if json_output:
        print(json.dumps({"output": str(result.output), "counts": result.counts, "metrics": result.metrics,
                          "shards": len(result.shards)}, indent=2))
    elif not quiet:
        Console().print(summary_table(result))

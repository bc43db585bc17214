"""`packctl export`: a packed output in the packed format another trainer reads itself."""
from __future__ import annotations

import json
import time
from typing import Optional

import typer

from packctl.cli.app import Command, app, console, fail, loading_modules
from packctl.cli.options import choice
from packctl.errors import PackctlError
from packctl.export.formats import FORMATS, formats_help

_EXPORT_EXAMPLE = f"""Rewrite a packed output in the packed format another trainer reads itself.

Formats: {formats_help()}.

Examples:

\b
    packctl export packed -o packed-nemo --format nemo --eos-token-id 2
    packctl export packed -o packed-olmo --format olmo --eos-token-id 32000 --bos-token-id 32001 --vocab-size 32002
    packctl export packed -o packed-megatron --format megatron --vocab-size 32000
"""


@app.command("export", cls=Command, help=_EXPORT_EXAMPLE)
def export_command(
    output: str = typer.Argument(..., metavar="OUT", help="Output directory of packctl pack."),
    target: str = typer.Option(..., "--output", "-o", help="Directory to write the export into."),
    fmt: str = typer.Option(..., "--format", **choice(FORMATS), help="Format to write."),
    eos_token_id: Optional[int] = typer.Option(None, help="The tokenizer's EOS id: NeMo pads sub-sequences with "
                                                          "it; OLMo-core finds document ends by it."),
    bos_token_id: Optional[int] = typer.Option(None, help="olmo: the BOS id every sequence starts with (checked); "
                                                          "leave out for sequences without BOS. Recorded in olmo.json "
                                                          "for the reader's tokenizer."),
    vocab_size: Optional[int] = typer.Option(None, help="olmo, megatron: the tokenizer's vocabulary size; sets the "
                                                        "token dtype (olmo: uint16 up to 65,536 ids, else uint32; "
                                                        "megatron: uint16 below 65,500, else int32; without it, from "
                                                        "the data) and refuses larger ids."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the files of an existing export directory."),
    verify_checksums: bool = typer.Option(True, "--verify-checksums/--no-verify-checksums",
                                          help="Check each shard against the manifest (sha256, rows, tokens, layout) "
                                               "while reading it."),
    json_output: bool = typer.Option(False, "--json", help="Print what was written as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary."),
) -> None:
    with loading_modules():
        from packctl.export import export

    from packctl.cli.render import command_progress

    started = time.perf_counter()
    try:
        with command_progress(None if json_output or quiet else console(stderr=True)) as progress:
            result = export(output, target, fmt, overwrite=overwrite, eos_token_id=eos_token_id,
                            bos_token_id=bos_token_id, vocab_size=vocab_size, verify=verify_checksums,
                            progress=progress)
    except PackctlError as exc:
        fail(exc)
    if json_output:
        print(json.dumps(result, indent=2))
    elif not quiet:
        padding = (f" + {result['padding_documents']:,} padding documents" if result.get("padding_documents")
                   else "")
        print(f"packctl export -> {result['output']}: {result['packs']:,} packs, {result['sequences']:,} sequences"
              f"{padding} as {result['format']} ({len(result['files'])} file(s)) in "
              f"{time.perf_counter() - started:.1f}s")

"""`packctl verify`: the contract, conservation against the input, attention equivalence."""
from __future__ import annotations

import json
from typing import List, Optional

import typer

from packctl.cli.app import Command, app, console, fail, loading_modules
from packctl.cli.options import VERIFY_BACKENDS, choice
from packctl.errors import PackctlError

_VERIFY_EXAMPLE = """Verify a packed output: contract, conservation against the input, attention equivalence.

Exit 0 when every check passes, 1 when one fails (naming shard, row, sequence and rule), 2 when
the output or the options cannot be used. docs/verify.md explains each check.

Examples:

\b
    packctl verify out --source sample_data
    packctl verify out --device cuda --backend flash-attn --dtype bf16,fp16 --bench
"""


@app.command("verify", cls=Command, help=_VERIFY_EXAMPLE)
def verify_command(
    output: str = typer.Argument(..., metavar="OUT", help="Output directory of packctl pack."),
    source: Optional[List[str]] = typer.Option(None, "--source", help="The INPUT given to packctl pack (repeat for "
                                                                      "several); checks conservation."),
    split: Optional[str] = typer.Option(None, "--split", help="The dataset split of a --source directory that holds "
                                                              "several.  [default: the one OUT was packed from]"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", metavar="DIR", help="The tokenizer that reads raw "
                                            "--source records.  [default: the one OUT was packed with]"),
    sample: int = typer.Option(8, help="Packs drawn for the attention checks."),
    seed: int = typer.Option(0, help="Seed of the pack sample and of the probe embedding."),
    backend: str = typer.Option("auto", **choice(("auto", *VERIFY_BACKENDS)),
                                help="Attention backend."),
    device: str = typer.Option("auto", **choice(("auto", "cpu", "cuda")),
                               help="auto: cuda when torch sees a GPU."),
    dtype: Optional[str] = typer.Option(None, help="Comma-separated fp32,bf16,fp16.  [default: fp32 on CPU, "
                                                   "bf16,fp16 on CUDA]"),
    heads: int = typer.Option(2, help="Attention heads of the probe."),
    head_dim: int = typer.Option(64, help="Head dimension of the probe."),
    cp_size: Optional[int] = typer.Option(None, help="Context-parallel size to check.  [default: the manifest's]"),
    attention: bool = typer.Option(True, "--attention/--no-attention", help="Run the attention and contamination "
                                                                            "checks (need torch)."),
    bench: bool = typer.Option(False, "--bench", help="Time packed varlen vs padded-batch attention."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    with loading_modules():
        from packctl.contract.manifest import epoch_outputs
        from packctl.verify import VerifyOptions, verify

    try:
        options = VerifyOptions(source=source or [], split=split, tokenizer=tokenizer, attention=attention,
                                sample=sample, seed=seed,
                                backend=backend, device=device, dtype=dtype, heads=heads, head_dim=head_dim,
                                cp_size=cp_size, bench=bench)
        outputs = epoch_outputs(output)  # the OUT of pack --epochs: every epoch's output is checked
    except PackctlError as exc:
        fail(exc)
    from packctl.cli.render import command_progress

    try:
        with command_progress(None if json_output else console(stderr=True)) as progress:
            reports = [verify(o, options, progress=progress) for o in outputs or [output]]
    except PackctlError as exc:
        fail(exc)
    exit_code = max(r.exit_code for r in reports)
    if json_output:
        print(json.dumps(reports[0].to_dict() if outputs is None else
                         {"output": output, "ok": exit_code == 0, "exit_code": exit_code,
                          "epochs": [r.to_dict() for r in reports]}, indent=2))
    else:
        for report in reports:
            from packctl.cli.render import verify_table

            console(soft_wrap=True).print(verify_table(report))
    raise typer.Exit(exit_code)

"""The `packctl` command line: thin typer commands over the Python API."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from packctl.config import build_config, load_config
from packctl.errors import PackctlError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="Pack variable-length tokenized Parquet datasets into THD shards for LLM training.")

_PACK_EXAMPLE = """Pack tokenized Parquet shards into THD packs.

Example:

    packctl pack sample_data -o out --capacity 4096 --algorithm bfd --too-long split
"""


def _fail(exc: PackctlError) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {exc}", highlight=False, markup=True)
    raise typer.Exit(exc.exit_code)


@app.command("pack", help=_PACK_EXAMPLE)
def pack_command(
    inputs: Optional[List[str]] = typer.Argument(None, metavar="INPUT...", help="Parquet files, directories or globs."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output directory OUT."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file with any of these options."),
    capacity: Optional[int] = typer.Option(None, help="Tokens per pack.  [default: 4096]"),
    algorithm: Optional[str] = typer.Option(None, help="concat|ffd|bfd|mffd|ffs|split  [default: bfd]"),
    order: Optional[str] = typer.Option(None, help="input|shuffle|curriculum  [default: input]"),
    curriculum_order: Optional[str] = typer.Option(None, help="asc|desc, for --order curriculum  [default: asc]"),
    seed: Optional[int] = typer.Option(None, help="Seed of shuffle order and of ffs.  [default: 0]"),
    window: Optional[int] = typer.Option(None, help="Sequences per planning window.  [default: 100000]"),
    cp_size: Optional[int] = typer.Option(None, help="Context-parallel size (pads to 2*cp*tp).  [default: 1]"),
    tp_size: Optional[int] = typer.Option(None, help="Tensor-parallel size.  [default: 1]"),
    seq_multiple: Optional[int] = typer.Option(None, help="Extra per-sequence length multiple.  [default: 1]"),
    pad_to: Optional[str] = typer.Option(None, help="capacity|multiple  [default: capacity]"),
    pack_multiple: Optional[int] = typer.Option(None, help="Pack length multiple for --pad-to multiple.  "
                                                           "[default: the alignment]"),
    pad_token_id: Optional[int] = typer.Option(None, help="Token id of padding.  [default: 0]"),
    max_seqs_per_bin: Optional[int] = typer.Option(None, help="At most this many sequences per pack."),
    too_long: Optional[str] = typer.Option(None, help="error|drop|truncate|split  [default: error]"),
    tokens_column: Optional[str] = typer.Option(None, help="Input column of token ids.  [default: input_ids]"),
    labels_column: Optional[str] = typer.Option(None, help="Input column of labels.  [default: labels if present]"),
    shard_rows: Optional[int] = typer.Option(None, help="Packs per output shard.  [default: 1024]"),
    memory_budget: Optional[str] = typer.Option(None, help="Decoded tokens held in memory, e.g. 8GiB.  "
                                                           "[default: a quarter of RAM]"),
    overwrite: Optional[bool] = typer.Option(None, "--overwrite/--no-overwrite", help="Replace an existing OUT."),
    json_output: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary table."),
) -> None:
    from packctl.pipeline import pack
    from packctl.report import RichProgress, summary_table

    try:
        file_values = load_config(config) if config is not None else {}
        cfg = build_config(
            file_values, inputs=inputs or None, output=output, capacity=capacity, algorithm=algorithm,
            order=order, curriculum_order=curriculum_order, seed=seed, window=window, cp_size=cp_size,
            tp_size=tp_size, seq_multiple=seq_multiple, pad_to=pad_to, pack_multiple=pack_multiple,
            pad_token_id=pad_token_id, max_seqs_per_bin=max_seqs_per_bin, too_long=too_long,
            tokens_column=tokens_column, labels_column=labels_column, shard_rows=shard_rows,
            memory_budget=memory_budget, overwrite=overwrite,
        )
        err = Console(stderr=True)
        progress = RichProgress(err) if err.is_terminal and not json_output else None
        result = pack(cfg, progress=progress)
    except PackctlError as exc:
        _fail(exc)
    if json_output:
        print(json.dumps({"output": str(result.output), "counts": result.counts, "metrics": result.metrics,
                          "shards": len(result.shards)}, indent=2))
    elif not quiet:
        Console().print(summary_table(result))


@app.command("sample")
def sample_command(
    output: str = typer.Option(..., "--output", "-o", help="Directory to write the shards into."),
    sequences: int = typer.Option(3000, help="Number of sequences."),
    distribution: str = typer.Option("lognormal", help="zipf|lognormal|rl-longtail"),
    shards: int = typer.Option(4, help="Number of Parquet shards."),
    seed: int = typer.Option(0, help="Random seed."),
    vocab_size: int = typer.Option(32000, help="Token ids are drawn from [1, vocab-size)."),
    max_length: int = typer.Option(32768, help="Longest sequence."),
    prompt_fraction: float = typer.Option(0.5, help="Share of rows with a masked prompt (zipf, lognormal)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing directory."),
) -> None:
    """Write a deterministic synthetic tokenized corpus.

    Example:

        packctl sample -o corpus --sequences 100000 --distribution rl-longtail
    """
    from packctl.sample import SampleSpec, write_sample

    try:
        paths = write_sample(output, SampleSpec(sequences=sequences, distribution=distribution, shards=shards,
                                                seed=seed, vocab_size=vocab_size, max_length=max_length,
                                                prompt_fraction=prompt_fraction), overwrite=overwrite)
    except PackctlError as exc:
        _fail(exc)
    Console(stderr=True).print(f"wrote {sequences:,} sequences in {len(paths)} shards to {output}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()

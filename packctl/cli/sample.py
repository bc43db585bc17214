"""`packctl sample`: a deterministic synthetic corpus."""
from __future__ import annotations

import json
import time
from typing import Optional

import typer

from packctl.cli.app import Command, app, console, fail, loading_modules
from packctl.cli.options import (
    SAMPLE_DISTRIBUTIONS,
    SAMPLE_GROUPS,
    SAMPLE_MODALITIES,
    choice,
)
from packctl.errors import PackctlError


@app.command("sample", cls=Command)
def sample_command(
    output: str = typer.Option(..., "--output", "-o", help="Directory to write the shards into."),
    sequences: int = typer.Option(3000, help="Number of sequences."),
    distribution: str = typer.Option("lognormal", **choice(SAMPLE_DISTRIBUTIONS), help="Length distribution."),
    shards: int = typer.Option(4, help="Number of Parquet shards."),
    seed: int = typer.Option(0, help="Random seed."),
    vocab_size: int = typer.Option(32000, help="Token ids are drawn from [1, vocab-size)."),
    max_length: int = typer.Option(32768, help="Longest sequence."),
    prompt_fraction: float = typer.Option(0.5, help="Share of rows with a masked prompt (zipf, lognormal)."),
    groups: str = typer.Option("none", **choice(SAMPLE_GROUPS),
                               help="Grouped rows sharing a masked prompt, numbered in a group_id column: "
                                    "preference pairs (chosen, rejected) or rollouts (--group-size responses); "
                                    "pack them with --group-column group_id."),
    group_size: int = typer.Option(4, help="Responses per prompt of --groups rollout."),
    eos_id: Optional[int] = typer.Option(None, help="Every sequence ends with this id (its last token replaced); "
                                                    "vocab-size or more. For EOS-delimited trainers (export --format "
                                                    "olmo)."),
    bos_id: Optional[int] = typer.Option(None, help="Every sequence starts with this id (its first token replaced); "
                                                    "vocab-size or more."),
    modality: str = typer.Option("text", **choice(SAMPLE_MODALITIES),
                                 help="image: a vision-language corpus, ~40% text-only rows, with int32 columns "
                                      "images and image_tokens (each image's tokens are part of input_ids, id "
                                      "--vocab-size); pack it with --limit images=N or image_tokens=N."),
    image_tokens: int = typer.Option(576, help="Tokens of one image tile (--modality image)."),
    max_tiles: int = typer.Option(1, help="Tiles per image, drawn in [1, max-tiles] (--modality image; 5 is "
                                          "LLaVA-NeXT-like)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing directory."),
    json_output: bool = typer.Option(False, "--json", help="Print what was written as JSON on stdout."),
) -> None:
    """Write a deterministic synthetic tokenized corpus.

    Example:

        packctl sample -o corpus --sequences 100000 --distribution rl-longtail

        packctl sample -o pairs --sequences 50000 --groups preference

        packctl sample -o corpus --sequences 2000 --eos-id 32000 --bos-id 32001

        packctl sample -o vlm --sequences 100000 --modality image --max-tiles 5
    """
    with loading_modules():
        from packctl.sample import SampleSpec, write_sample

    from packctl.cli.render import command_progress

    started = time.perf_counter()
    try:
        with command_progress(None if json_output else console(stderr=True)) as progress:
            paths = write_sample(output, SampleSpec(sequences=sequences, distribution=distribution, shards=shards,
                                                    seed=seed, vocab_size=vocab_size, max_length=max_length,
                                                    prompt_fraction=prompt_fraction, groups=groups,
                                                    group_size=group_size, eos_id=eos_id, bos_id=bos_id,
                                                    modality=modality, image_tokens=image_tokens, max_tiles=max_tiles),
                                 overwrite=overwrite, progress=progress)
    except PackctlError as exc:
        fail(exc)
    if json_output:
        print(json.dumps({"output": str(output), "sequences": sequences, "distribution": distribution, "seed": seed,
                          "shards": [str(p) for p in paths]}, indent=2))
        return
    console(stderr=True).print(f"wrote {sequences:,} sequences in {len(paths)} shards to {output} in "
                               f"{time.perf_counter() - started:.1f}s")

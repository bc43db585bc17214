"""The `packctl` command line: thin typer commands over the Python API."""
from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from packctl.config import FIELDS, PLANNING_OPTIONS, build_config, load_config, option_help
from packctl.errors import PackctlError

app = typer.Typer(add_completion=True, no_args_is_help=True, rich_markup_mode=None,
                  help="Pack variable-length tokenized Parquet datasets into THD shards for LLM training.")

_PACK_EXAMPLE = """Pack tokenized Parquet shards into THD packs.

Example:

\b
    packctl pack sample_data -o out --capacity 4096 --algorithm bfd --too-long split
"""


def choice(values) -> dict:
    """typer.Option arguments for an option with a fixed set of values: --help shows them
    (`[input|shuffle|curriculum]`) and shell completion offers them. A value outside them is
    refused by the option's own check (one line naming the option and the choices, exit 2)."""
    values = tuple(values)

    def complete(ctx, param, incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]

    return {"metavar": f"[{'|'.join(values)}]", "shell_complete": complete}


# The names of packctl.sample.DISTRIBUTIONS and packctl.verify.backends.BACKENDS, spelled here so
# that --help and completion import neither numpy nor torch (tests/test_cli.py checks they agree).
SAMPLE_DISTRIBUTIONS = ("zipf", "lognormal", "rl-longtail")
SAMPLE_GROUPS = ("none", "preference", "rollout")  # packctl.sample.GROUP_KINDS, without importing pyarrow
VERIFY_BACKENDS = ("flash-attn", "torch-varlen", "flex", "sdpa")


def config_options(names) -> list[inspect.Parameter]:
    """Typer options of PackConfig fields, made from the fields themselves (config.py `option`):
    the flag, help, choices and default are declared once, there."""
    params = []
    for name in names:
        meta = FIELDS[name].metadata
        flag = meta["flag"] or f"--{name.replace('_', '-')}"
        decls = [f"{flag}/--no-{flag[2:]}" if meta["switch"] else flag] + ([meta["short"]] if meta["short"] else [])
        kind = meta["cli"] or _CLI_TYPES[str(FIELDS[name].type).replace(" | None", "")]
        if kind is list:  # a repeated flag: --keep-columns a --keep-columns b
            kind = List[str]
        choices = choice(meta["choices"]) if meta["choices"] else {}
        option = typer.Option(None, *decls, help=option_help(name, with_choices=not choices), **choices)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[kind],
                                        default=option))
    return params


_CLI_TYPES = {"int": int, "str": str, "bool": bool, "float": float, "list[str]": list}


def _with_signature(params: list[inspect.Parameter]):
    """Give a `**options` function the signature typer reads its options from."""
    def decorate(fn):
        fn.__signature__ = inspect.Signature(params)
        return fn
    return decorate


def _print_version(value: bool) -> None:
    if value:
        from packctl.version import __version__

        print(f"packctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the packctl version and exit.")) -> None:
    """Pack variable-length tokenized Parquet datasets into THD shards for LLM training."""


def _fail(exc: PackctlError) -> None:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    raise typer.Exit(exc.exit_code)


_PACK_OWN = [
    inspect.Parameter("inputs", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[List[str]],
                      default=typer.Argument(None, metavar="INPUT...", help=FIELDS["inputs"].metadata["help"])),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--config", help="TOML file with any of these options.")),
]
_OUTPUT_FORMAT = [
    inspect.Parameter("json_output", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--json", help="Print the result as JSON on stdout.")),
    inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--quiet", "-q", help="No summary table.")),
]


@app.command("pack", help=_PACK_EXAMPLE)
@_with_signature(_PACK_OWN + config_options([n for n in FIELDS if n != "inputs"]) + _OUTPUT_FORMAT)
def pack_command(*, inputs: Optional[List[str]], config: Optional[Path], json_output: bool, quiet: bool,
                 **options) -> None:
    from packctl.dist.comm import get_comm
    from packctl.pipeline import pack
    from packctl.report import LogProgress, RichProgress, summary_table

    try:
        comm = get_comm()
        file_values = load_config(config) if config is not None else {}
        cfg = build_config(file_values, inputs=inputs or None, **options)
    except PackctlError as exc:
        _fail(exc)
    err = Console(stderr=True)
    progress = None
    if comm.rank == 0 and not (json_output or quiet):  # on a terminal bars, elsewhere (Slurm logs) log lines
        progress = RichProgress(err) if err.is_terminal else LogProgress()
    with _ranks_stop_together(comm):
        result = pack(cfg, progress=progress, comm=comm)
    if comm.rank != 0:
        return
    pad_like = result.metrics.get("throughput", {}).get("tokens_equal_to_pad_id", 0)
    if pad_like and not quiet and not json_output:
        Console(stderr=True).print(f"note: {pad_like:,} input tokens equal --pad-token-id {cfg.pad_token_id}; "
                                   "padding is told apart by seq_lens / cu_seqlens, not by its id", highlight=False)
    if json_output:
        print(json.dumps({"output": str(result.output), "counts": result.counts, "metrics": result.metrics,
                          "shards": len(result.shards)}, indent=2))
    elif not quiet:
        Console().print(summary_table(result))


@contextmanager
def _ranks_stop_together(comm) -> Iterator[None]:
    """Errors under MPI: one that every rank raised (bad option, bad input found before reading)
    is printed by rank 0 and every rank exits with its code; one that only this rank hit (its own
    blocks, a failed write) is printed with the rank, and all ranks are aborted, so none hangs."""
    try:
        yield
    except PackctlError as exc:
        if comm.size == 1 or getattr(exc, "everywhere", False):
            if comm.rank == 0:
                _fail(exc)
            raise typer.Exit(exc.exit_code)
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] rank {comm.rank}: {escape(str(exc))}",
                                                   highlight=False)
        comm.abort(exc.exit_code)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except BaseException:
        if comm.size == 1:
            raise
        traceback.print_exc()
        print(f"rank {comm.rank}: internal error; aborting all ranks", file=sys.stderr, flush=True)
        comm.abort(1)


@app.command("sample")
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
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing directory."),
    json_output: bool = typer.Option(False, "--json", help="Print what was written as JSON on stdout."),
) -> None:
    """Write a deterministic synthetic tokenized corpus.

    Example:

        packctl sample -o corpus --sequences 100000 --distribution rl-longtail

        packctl sample -o pairs --sequences 50000 --groups preference
    """
    from packctl.sample import SampleSpec, write_sample

    try:
        paths = write_sample(output, SampleSpec(sequences=sequences, distribution=distribution, shards=shards,
                                                seed=seed, vocab_size=vocab_size, max_length=max_length,
                                                prompt_fraction=prompt_fraction, groups=groups,
                                                group_size=group_size), overwrite=overwrite)
    except PackctlError as exc:
        _fail(exc)
    if json_output:
        print(json.dumps({"output": str(output), "sequences": sequences, "distribution": distribution, "seed": seed,
                          "shards": [str(p) for p in paths]}, indent=2))
        return
    Console(stderr=True).print(f"wrote {sequences:,} sequences in {len(paths)} shards to {output}")


_STATS_EXAMPLE = """How good a packing is, or what-if planning before one (docs/stats.md).

PATH: a packed output (a directory holding _manifest.json), several to compare,
or raw tokenized Parquet (files, directories, globs) for a what-if table.
Planning options apply to raw input only and mean what they mean for pack.

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
    inspect.Parameter("capacity", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[List[int]],
                      default=typer.Option(None, help="What-if capacity; repeat it to compare capacities "
                                                      "(--capacity 4096 --capacity 8192).  [default: 4096]")),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--config", help="TOML file of pack options for the what-if.")),
]
_STATS_REPORT = [
    inspect.Parameter("attn_coeff", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[float],
                      default=typer.Option(None, help="a of the attention cost a*L + L^2 in the DP balance of a "
                                                      "packed output.  [default: the one it was packed with]")),
    inspect.Parameter("json_output", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, "--json", help="Print the report as JSON on stdout.")),
    inspect.Parameter("plot", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
                      default=typer.Option(None, "--plot", help="Also draw the report into this PNG file.")),
]


@app.command("stats", help=_STATS_EXAMPLE)
@_with_signature(_STATS_OWN + config_options([*PLANNING_OPTIONS, "tokens_column"]) + _STATS_REPORT)
def stats_command(*, paths: Optional[List[str]], capacity: Optional[List[int]], config: Optional[Path],
                  attn_coeff: Optional[float], json_output: bool, plot: Optional[Path], **planning) -> None:
    from packctl.report import stats_renderables
    from packctl.stats import stats

    try:
        report = stats(paths or [], capacities=capacity or None, attn_coeff=attn_coeff,
                       file_values=load_config(config) if config is not None else {}, **planning)
        if plot is not None:
            from packctl.stats.plot import write_plot

            write_plot(report, plot)
    except PackctlError as exc:
        _fail(exc)
    if json_output:
        print(json.dumps(report, indent=2))
    else:
        console = Console()
        for renderable in stats_renderables(report):
            console.print(renderable)


_VERIFY_EXAMPLE = """Verify a packed output: contract, conservation against the input, attention equivalence.

Exit 0 when every check passes, 1 when one fails (naming shard, row, sequence and rule), 2 when
the output or the options cannot be used. docs/verify.md explains each check.

Examples:

\b
    packctl verify out --source sample_data
    packctl verify out --device cuda --backend flash-attn --dtype bf16,fp16 --bench
"""


@app.command("verify", help=_VERIFY_EXAMPLE)
def verify_command(
    output: str = typer.Argument(..., metavar="OUT", help="Output directory of packctl pack."),
    source: Optional[List[str]] = typer.Option(None, "--source", help="The INPUT given to packctl pack (repeat for "
                                                                      "several); checks conservation."),
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
    from packctl.io.manifest import epoch_outputs
    from packctl.verify import VerifyOptions, summary_table, verify

    try:
        options = VerifyOptions(source=source or [], attention=attention, sample=sample, seed=seed, backend=backend,
                                device=device, dtype=dtype, heads=heads, head_dim=head_dim, cp_size=cp_size,
                                bench=bench)
        outputs = epoch_outputs(output)  # the OUT of pack --epochs: every epoch's output is checked
        reports = [verify(o, options) for o in outputs or [output]]
    except PackctlError as exc:
        _fail(exc)
    exit_code = max(r.exit_code for r in reports)
    if json_output:
        print(json.dumps(reports[0].to_dict() if outputs is None else
                         {"output": output, "ok": exit_code == 0, "exit_code": exit_code,
                          "epochs": [r.to_dict() for r in reports]}, indent=2))
    else:
        for report in reports:
            Console(soft_wrap=True).print(summary_table(report))
    raise typer.Exit(exit_code)


_EXPORT_EXAMPLE = """Rewrite a packed output in the packed format another trainer reads itself.

Formats: nemo (NeMo / Megatron-Bridge packed SFT, *.idx.parquet and packing_metadata.json),
nemo-npy (the same as NeMo's legacy .npy), olmo (OLMo-core numpy token and label-mask files).

Example:

\b
    packctl export packed -o packed-nemo --format nemo --eos-token-id 2
"""
EXPORT_FORMATS = ("nemo", "nemo-npy", "olmo")  # packctl.export.FORMATS (tests/test_cli.py checks they agree)


@app.command("export", help=_EXPORT_EXAMPLE)
def export_command(
    output: str = typer.Argument(..., metavar="OUT", help="Output directory of packctl pack."),
    target: str = typer.Option(..., "--output", "-o", help="Directory to write the export into."),
    fmt: str = typer.Option(..., "--format", **choice(EXPORT_FORMATS), help="Format to write."),
    eos_token_id: Optional[int] = typer.Option(None, help="The tokenizer's EOS id: NeMo pads sub-sequences with "
                                                          "it; OLMo-core finds document ends by it."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the files of an existing export directory."),
    json_output: bool = typer.Option(False, "--json", help="Print what was written as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary."),
) -> None:
    from packctl.export import export

    try:
        result = export(output, target, fmt, overwrite=overwrite, eos_token_id=eos_token_id)
    except PackctlError as exc:
        _fail(exc)
    if json_output:
        print(json.dumps(result, indent=2))
    elif not quiet:
        print(f"packctl export -> {result['output']}: {result['packs']:,} packs, {result['sequences']:,} sequences "
              f"as {result['format']} ({len(result['files'])} file(s))")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit as done:
        _exit_now(done)


def _exit_now(done: SystemExit) -> None:
    """End the `packctl` process without tearing the interpreter down: every output is written,
    fsync'd and closed by now, and freeing a large run's objects one by one takes about 0.4 s
    (docs/performance.md). Under MPI the normal exit runs, so that MPI is finalized."""
    if "mpi4py" in sys.modules:
        raise done
    code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    if done.code is not None and not isinstance(done.code, int):
        print(done.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()

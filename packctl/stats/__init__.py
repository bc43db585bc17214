"""`packctl stats`: how good a packing is, and what a corpus would pack into before a long run.

    packctl stats OUT                      a packed output (holds _manifest.json), recomputed from its shards
    packctl stats OUT_A OUT_B              packed outputs side by side
    packctl stats INPUT --capacity 4096    raw tokenized shards: lengths and a what-if table of every
                                           algorithm (repeat --capacity to compare capacities)

Every report is a dict with stable keys (docs/stats.md); `packctl.cli.render` draws it in the
terminal and `packctl.stats.plot` draws it as a PNG. The metric formulas live in `packctl.plan.metrics`.

    >>> report = stats(["sample_data"], capacities=[4096], too_long="split")   # doctest: +SKIP
    >>> report["best"], report["recommendation"]                              # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from packctl.config import as_python, build_config
from packctl.contract.manifest import epoch_dir, epoch_outputs
from packctl.errors import PackctlError
from packctl.stats.packed import compare_stats, is_packed_output, looks_like_unfinished_output, packed_stats
from packctl.stats.whatif import PLANNING_OPTIONS, input_stats, read_lengths, what_if_row

__all__ = ["compare_stats", "input_stats", "is_packed_output", "packed_stats", "read_lengths", "stats",
           "what_if_row", "PLANNING_OPTIONS"]

DEFAULT_CAPACITY = 4096


def stats(paths: list[str], *, capacities: list[int] | None = None, attn_coeff: float | None = None,
          file_values: dict[str, Any] | None = None, verify: bool = True, **options: Any) -> dict[str, Any]:
    """The report for PATHs: packed outputs (one, or several to compare) or raw input.

    Args:
        paths: packed output directories, or raw Parquet files, directories and globs.
        capacities: what-if capacities (raw input only); default the `capacity` of
            `file_values`, else 4096, as `pack`.
        attn_coeff: `a` of the attention cost a*L + L^2: for packed outputs, of the DP balance
            report (default: the one it was packed with); for raw input, the planning option.
        file_values: values of a `--config` TOML file (PackConfig fields), for the what-if.
        verify: check every shard of a packed output against its manifest while reading it
            (sha256, rows, tokens, layout); False is `--no-verify-checksums`.
        options: PackConfig fields given as flags (None = not given): the planning options of
            PLANNING_OPTIONS (every option that changes what `pack` plans). With `algorithm`
            given (flag or file), the what-if plans that algorithm only, else every one.
    """
    file_values = dict(file_values or {})
    given = {k: v for k, v in options.items() if v is not None}
    attn_coeff = as_python(attn_coeff)
    if attn_coeff is not None and (isinstance(attn_coeff, bool) or not isinstance(attn_coeff, (int, float))
                                   or not 0 <= attn_coeff < float("inf")):
        raise PackctlError(f"--attn-coeff {attn_coeff!r}: must be a number >= 0")
    if not paths:
        paths = list(file_values.get("inputs") or [])
    if given.get("sources") or file_values.get("sources") or given.get("blend") or file_values.get("blend"):
        if paths:  # a blend's inputs are its sources, as for pack
            raise PackctlError(f"{paths[0]} with --source: give every input as a source (--source "
                               f"NAME={paths[0]}:WEIGHT), or drop --source")
        from packctl.source.mixture import with_blend

        config = with_blend(build_config(file_values, **{**given, **({"attn_coeff": attn_coeff}
                                                                     if attn_coeff is not None else {})}))
        if not capacities:
            capacities = [int(file_values.get("capacity", DEFAULT_CAPACITY))]
        algorithms = [config.algorithm] if "algorithm" in given or "algorithm" in file_values else None
        return input_stats([], capacities, config, algorithms)
    if not paths:
        raise PackctlError("no PATH given: pass a packed output directory or tokenized Parquet files")
    for path in paths:
        if looks_like_unfinished_output(path):
            raise PackctlError(f"{path}: packed shards without _manifest.json, a run that did not finish: "
                               "pack again")
    packed = [is_packed_output(p) for p in paths]
    if any(packed):
        if not all(packed):
            raw = paths[packed.index(False)]
            raise PackctlError(f"{raw}: not a packed output (no _manifest.json) while {paths[packed.index(True)]} "
                               "is one; compare packed outputs together, or run stats on raw input alone")
        what_if_flags = [f"--{k.replace('_', '-')}" for k in given] + (["--capacity"] if capacities else [])
        if what_if_flags or file_values:
            flags = ", ".join(what_if_flags) or "--config"
            raise PackctlError(f"{paths[0]} is a packed output, whose settings are in its _manifest.json: {flags} "
                               "only apply to raw input; drop them, or point stats at the tokenized input")
        a = attn_coeff
        several = [p for p in paths if Path(p).is_dir() and epoch_outputs(p) is not None]
        if len(paths) > 1 and several:
            raise PackctlError(f"{several[0]}: the output of packctl pack --epochs holds one output per epoch: "
                               f"compare its epochs with packctl stats {several[0]}, or pass {Path(several[0]) / epoch_dir(0)}")
        if len(paths) == 1:
            return packed_stats(paths[0], attn_coeff=a, verify=verify)
        return compare_stats(paths, attn_coeff=a, verify=verify)
    if attn_coeff is not None:
        given["attn_coeff"] = attn_coeff
    config = build_config(file_values, **given)
    if not capacities:
        capacities = [int(file_values.get("capacity", DEFAULT_CAPACITY))]
    algorithms = [config.algorithm] if "algorithm" in given or "algorithm" in file_values else None
    return input_stats(paths, capacities, config, algorithms)

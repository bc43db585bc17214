"""The writer's half of the manifest: what `pack` records of a run, in every shard's Parquet
metadata (`shard_metadata`) and in `_manifest.json` (`build_manifest`); the reader's half, and the
file names, are in packctl/contract/manifest.py."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from packctl.contract.manifest import ShardEntry
from packctl.contract.schema import FORMAT_VERSION, IGNORE_INDEX
from packctl.source.kinds import options_of
from packctl.source.kinds.raw import tokenization
from packctl.source.tokenized import tokenized_sources
from packctl.urls import is_url
from packctl.version import __version__

if TYPE_CHECKING:
    from packctl.config import PackConfig
    from packctl.source.index import InputFile

# Options that say where and how a run executes, never what it writes: kept out of the shards'
# metadata so the same packing has the same bytes wherever it is written.
EXECUTION_ONLY = ("output", "overwrite", "memory_budget", "token_transfer")
# The shards of a plan carry the metadata of the output `packctl materialize` makes of it, so that
# its shards are those `pack` writes without --plan-only, byte for byte: a plan says it is one in its
# manifest (`kind`), and its shards by their columns (seq_starts, no input_ids).
NOT_IN_SHARDS = EXECUTION_ONLY + ("plan_only",)
PLAN_KIND = "plan"


def layout_of(config: PackConfig) -> dict[str, Any]:
    """The manifest's `layout`. Batch mode (`pad_to` "batch"): `capacity` is the micro-batch
    budget max_tokens, `max_seq_len` the longest row (docs/format.md)."""
    if config.mode == "batch":
        return {
            "mode": "batch",
            "capacity": config.resolved_max_tokens,
            "max_seq_len": config.capacity,
            "align": config.align,
            "pad_to": "batch",
            "pack_multiple": config.align,
            "pad_token_id": config.pad_token_id,
            "ignore_index": IGNORE_INDEX,
            "cp_size": config.cp_size,
            "tp_size": config.tp_size,
            "sequence_parallel": config.sequence_parallel,
        }
    layout = {
        "capacity": config.capacity,
        "align": config.align,
        "pad_to": config.pad_to,
        "pack_multiple": config.resolved_pack_multiple,
        "pad_token_id": config.pad_token_id,
        "ignore_index": IGNORE_INDEX,
        "cp_size": config.cp_size,
        "tp_size": config.tp_size,
        "sequence_parallel": config.sequence_parallel,
    }
    if config.limits:  # --limit COL=N: every pack's COL_sum is at most N
        layout["limits"] = dict(config.limits)
    if config.share_prefix:  # segments form trees: parent_segments links each branch to its prefix
        layout["tree"] = True
        layout["share_prefix"] = {"prefix_column": config.prefix_column}
    return layout


def resolved_config(config: PackConfig, labels_column: str | None) -> dict[str, Any]:
    out = config.to_dict()
    out["labels_column"] = labels_column
    if out.get("split") is None:  # recorded only where it selects files: other outputs keep their bytes
        out.pop("split", None)
    return out


def shard_metadata(config: PackConfig, labels_column: str | None, inputs: list[InputFile]) -> bytes:
    """JSON for every shard's `packctl` key: what produced it, without execution-only options."""
    cfg = resolved_config(config, labels_column)
    for key in NOT_IN_SHARDS:
        cfg.pop(key, None)
    return json.dumps({
        "format_version": FORMAT_VERSION,
        "packctl_version": __version__,
        "config": cfg,
        "layout": layout_of(config),
        "inputs": [asdict(f) for f in inputs],
    }, sort_keys=True).encode()


def build_manifest(config: PackConfig, labels_column: str | None, inputs: list[InputFile],
                   shards: list[ShardEntry], counts: dict[str, int], timings: dict[str, float],
                   fingerprints: list | None = None) -> dict[str, Any]:
    """`_manifest.json`. A plan's (`config.plan_only`) also says `"kind": "plan"` and records each
    input's fingerprint (`mtime_ns`, `footer`: source/files.py), which the readers of a plan check
    before they read a token from it, and where it is from any folder (`absolute_path`)."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "packctl_version": __version__,
        "config": resolved_config(config, labels_column),
        "layout": layout_of(config),
        "inputs": [asdict(f) for f in inputs],
        "shards": [asdict(s) for s in shards],
        "counts": counts,
        "timings": timings,
    }
    tokenized = tokenized_sources([f.path for f in inputs])
    if config.tokenizer is not None:  # raw records tokenized as they were read (source/kinds/raw.py)
        tokenized = [tokenization(options_of(dataclasses.asdict(config)), [f.path for f in inputs])]
    if tokenized:  # inputs `packctl tokenize` wrote, or pack --tokenizer: how their tokens and labels were made
        manifest["tokenization"] = tokenized
    if config.plan_only:
        manifest["kind"] = PLAN_KIND
        for entry, read in zip(manifest["inputs"], fingerprints or []):
            path = entry["path"]  # where its readers find it, from any folder (a URL is already absolute)
            entry["absolute_path"] = path if is_url(path) else os.path.abspath(path)
            entry["mtime_ns"] = read.mtime_ns
            entry["footer"] = read.footer
    return manifest

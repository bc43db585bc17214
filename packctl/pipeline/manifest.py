"""The writer's half of the manifest: what `pack` records of a run (`RunRecord`, taken from its
options at preflight), in every shard's Parquet metadata (`RunRecord.shard_metadata`), in
`_manifest.json` (`RunRecord.manifest`) and in the fingerprint `--resume` compares
(`RunRecord.fingerprint`); the reader's half, and the file names, are in packctl/contract/manifest.py."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass
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
    if out.get("split") is None:  # recorded only where it selects files
        out.pop("split", None)
    return out


@dataclass(frozen=True)
class RunRecord:
    """What a run's outputs record of its options, taken from its `PackConfig` once, at preflight
    (`RunRecord.of`): the manifest's `config` (every option, resolved, with the labels column the
    inputs have) and `layout`, and for `pack --tokenizer` how the tokens were made. Past preflight
    the shards' metadata, the manifest and the run fingerprint are written from it, never from the
    config:

        record = RunRecord.of(config, index.labels_column, [f.path for f in index.files])
        record.shard_metadata(index.files)   b'{"config": {...}, "format_version": ...}'
    """

    config: dict[str, Any]
    layout: dict[str, Any]
    tokenization: dict[str, Any] | None = None  # pack --tokenizer: the tokenizer and its options

    @classmethod
    def of(cls, config: PackConfig, labels_column: str | None, paths: list[str]) -> "RunRecord":
        made = None
        if config.tokenizer is not None:  # raw records tokenized as they were read (source/kinds/raw.py)
            made = tokenization(options_of(dataclasses.asdict(config)), paths)
        return cls(config=resolved_config(config, labels_column), layout=layout_of(config), tokenization=made)

    @property
    def plan_only(self) -> bool:
        return bool(self.config.get("plan_only"))

    def shard_metadata(self, inputs: list[InputFile]) -> bytes:
        """JSON for every shard's `packctl` key: what produced it, without execution-only options
        (--resume is how a run executes, not what it writes: recorded as false)."""
        cfg = {key: value for key, value in self.config.items() if key not in NOT_IN_SHARDS}
        cfg["resume"] = False
        return json.dumps({
            "format_version": FORMAT_VERSION,
            "packctl_version": __version__,
            "config": cfg,
            "layout": self.layout,
            "inputs": [asdict(f) for f in inputs],
        }, sort_keys=True).encode()

    def manifest(self, inputs: list[InputFile], shards: list[ShardEntry], counts: dict[str, int],
                 timings: dict[str, float], fingerprints: list | None = None) -> dict[str, Any]:
        """`_manifest.json`. A plan's (`plan_only`) also says `"kind": "plan"` and records each
        input's fingerprint (`mtime_ns`, `footer`: source/files.py), which the readers of a plan
        check before they read a token from it, and where it is from any folder (`absolute_path`)."""
        manifest = {
            "format_version": FORMAT_VERSION,
            "packctl_version": __version__,
            "config": dict(self.config),
            "layout": dict(self.layout),
            "inputs": [asdict(f) for f in inputs],
            "shards": [asdict(s) for s in shards],
            "counts": counts,
            "timings": timings,
        }
        tokenized = [self.tokenization] if self.tokenization is not None else tokenized_sources(
            [f.path for f in inputs])
        if tokenized:  # inputs `packctl tokenize` wrote, or pack --tokenizer: how their tokens and labels were made
            manifest["tokenization"] = tokenized
        if self.plan_only:
            manifest["kind"] = PLAN_KIND
            for entry, read in zip(manifest["inputs"], fingerprints or []):
                path = entry["path"]  # where its readers find it, from any folder (a URL is already absolute)
                entry["absolute_path"] = path if is_url(path) else os.path.abspath(path)
                entry["mtime_ns"] = read.mtime_ns
                entry["footer"] = read.footer
        return manifest

    def fingerprint(self, inputs: list[InputFile], fingerprints: list) -> dict[str, Any]:
        """What must not change between an interrupted run and its `--resume`: everything the
        shards record (format, packctl version, options without execution-only ones, layout,
        inputs) plus, per input, what the run read of it: modification time and footer digest (a
        file rewritten with the same size and mtime still changes its footer). A plan and the
        packs of the same options are two outputs (`kind`): neither is taken for the other."""
        fingerprint = json.loads(self.shard_metadata(inputs))
        for entry, read in zip(fingerprint["inputs"], fingerprints):
            entry["mtime_ns"] = read.mtime_ns
            entry["footer"] = read.footer
        fingerprint["kind"] = PLAN_KIND if self.plan_only else "packs"
        if self.plan_only:
            fingerprint["config"]["plan_only"] = True
        if self.tokenization is not None:  # as the manifest records it: a complete OUT compares it too
            fingerprint["tokenization"] = [self.tokenization]
        return fingerprint

"""The manifest and the `packctl` Parquet metadata key (docs/format.md).

Format version 2 lays OUT out as a Parquet dataset: the shards under `data/`, the reports under
names Parquet dataset readers skip (leading underscore), so pyarrow, polars and Hugging Face
`datasets` read OUT itself as the table of packs:

    OUT/_manifest.json             written last: its presence means the output is complete
    OUT/_metrics.json              the packing report
    OUT/data/train-00000.parquet   the packs, shards numbered in window order

`pack --epochs K` writes one such output per epoch, `OUT/epoch-00000/` ..., and `OUT/_epochs.json`
last (`epoch_outputs`, `epoch_output`).

Version 1 (manifest.json, metrics.json, part-00000.parquet at OUT's root) is still read.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packctl.errors import PackctlError
from packctl.schema import FORMAT_VERSION, IGNORE_INDEX
from packctl.version import __version__

if TYPE_CHECKING:  # readers of a manifest (packctl.torch) need none of the packing side
    from packctl.config import PackConfig
    from packctl.io.reader import InputFile
    from packctl.io.journal import ShardInfo

MANIFEST = "_manifest.json"
EPOCHS = "_epochs.json"  # the OUT of --epochs > 1: one output per epoch, in epoch-00000/ ... (docs/format.md)
METRICS = "_metrics.json"
DATA_DIR = "data"
LEGACY_MANIFEST = "manifest.json"  # format version 1
LEGACY_METRICS = "metrics.json"
READABLE_VERSIONS = (1, FORMAT_VERSION)


def shard_name(shard: int, epoch: int | None = None) -> str:
    """The path of shard k inside OUT: `data/train-00000.parquet` (the file name Hugging Face
    `datasets` maps to the train split, so `load_dataset("parquet", data_dir=OUT)` takes only the
    shards); shard k of epoch e of `--epochs`: `epoch-0000e/data/train-0000k.parquet`."""
    name = f"{DATA_DIR}/train-{shard:05d}.parquet"
    return name if epoch is None else f"{epoch_dir(epoch)}/{name}"


def epoch_dir(epoch: int) -> str:
    """The folder of epoch e's output inside the OUT of `--epochs`: `epoch-00001`."""
    return f"epoch-{epoch:05d}"


def manifest_path(out: Path) -> Path | None:
    """OUT's manifest: `_manifest.json`, or the `manifest.json` of a version-1 output; None if neither."""
    for name in (MANIFEST, LEGACY_MANIFEST):
        if (out / name).is_file():
            return out / name
    return None


def metrics_path(out: Path) -> Path:
    """OUT's packing report (`_metrics.json`, or `metrics.json` in a version-1 output)."""
    return next((out / name for name in (METRICS, LEGACY_METRICS) if (out / name).is_file()), out / METRICS)

# Options that say where and how a run executes, never what it writes: kept out of the shards'
# metadata so the same packing has the same bytes wherever it is written.
EXECUTION_ONLY = ("output", "overwrite", "memory_budget", "token_transfer")


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
    return {
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


def resolved_config(config: PackConfig, labels_column: str | None) -> dict[str, Any]:
    out = config.to_dict()
    out["labels_column"] = labels_column
    return out


def shard_metadata(config: PackConfig, labels_column: str | None, inputs: list[InputFile]) -> bytes:
    """JSON for every shard's `packctl` key: what produced it, without execution-only options."""
    cfg = resolved_config(config, labels_column)
    for key in EXECUTION_ONLY:
        cfg.pop(key)
    return json.dumps({
        "format_version": FORMAT_VERSION,
        "packctl_version": __version__,
        "config": cfg,
        "layout": layout_of(config),
        "inputs": [asdict(f) for f in inputs],
    }, sort_keys=True).encode()


def build_manifest(config: PackConfig, labels_column: str | None, inputs: list[InputFile],
                   shards: list[ShardInfo], counts: dict[str, int], timings: dict[str, float]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "packctl_version": __version__,
        "config": resolved_config(config, labels_column),
        "layout": layout_of(config),
        "inputs": [asdict(f) for f in inputs],
        "shards": [asdict(s) for s in shards],
        "counts": counts,
        "timings": timings,
    }


def read_manifest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(OUT, its manifest) of a packed output given as OUT or its manifest file: the one reader of
    `stats`, `verify` and `packctl.torch`, with one PackctlError (exit 2) per problem. Reads
    format versions 1 and 2."""
    path = Path(path)
    out = path.parent if path.name in (MANIFEST, LEGACY_MANIFEST) and not path.is_dir() else path
    if not out.is_dir():
        raise PackctlError(f"{out}: no such output directory; pass the -o OUT of a packctl pack run")
    found = manifest_path(out)
    if found is None and (out / EPOCHS).is_file():
        raise PackctlError(f"{out}: the output of packctl pack --epochs holds one output per epoch: pass "
                           f"{out / epoch_dir(0)} (or epoch=0 to packctl.torch.PackedDataset)")
    if found is None:
        raise PackctlError(f"{out}: no {MANIFEST}, so the output is incomplete or not a packctl output "
                           f"(packctl pack writes {MANIFEST} last): run packctl pack again")
    try:
        manifest = json.loads(found.read_text())
    except (OSError, ValueError) as exc:
        raise PackctlError(f"{found}: not readable JSON ({exc}); run packctl pack again") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise PackctlError(f"{found}: format_version {version!r}, this packctl reads versions "
                           f"{', '.join(map(str, READABLE_VERSIONS))}: use the packctl that wrote it, or pack again")
    for key in ("layout", "shards", "counts"):
        if key not in manifest:
            raise PackctlError(f"{found}: no '{key}' entry; not a packctl manifest (docs/format.md)")
    if not isinstance(manifest["shards"], list) or not manifest["shards"]:
        raise PackctlError(f"{found}: lists no shards")
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict) or not isinstance(shard.get("path"), str):
            raise PackctlError(f"{found}: shards[{i}] has no 'path'")
    return out, manifest


def epoch_outputs(out: str | Path) -> list[Path] | None:
    """The output of every epoch of an OUT written by `packctl pack --epochs K` (K > 1), in epoch
    order: [OUT/epoch-00000, ...]; None for any other path (one output, or none)."""
    out = Path(out)
    if not (out / EPOCHS).is_file():
        return None
    try:
        epochs = json.loads((out / EPOCHS).read_text())["epochs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackctlError(f"{out / EPOCHS}: not readable ({exc}); run packctl pack again") from None
    return [out / epoch_dir(e) for e in range(int(epochs))]


def epoch_output(out: str | Path, epoch: int) -> Path:
    """The output of epoch `epoch` of `packctl pack --epochs K`: OUT/epoch-0000e (a complete
    output of its own)."""
    outputs = epoch_outputs(out)
    if outputs is None:
        raise PackctlError(f"{out}: no {EPOCHS}, so not the complete output of packctl pack --epochs K; "
                           "leave epoch unset for an output of one epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < len(outputs):
        raise PackctlError(f"epoch={epoch!r}: {out} holds epochs 0 to {len(outputs) - 1}")
    return outputs[epoch]

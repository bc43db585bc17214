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
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packctl.errors import PackctlError
from packctl.contract.schema import FORMAT_VERSION


MANIFEST = "_manifest.json"
EPOCHS = "_epochs.json"  # the OUT of --epochs > 1: one output per epoch, in epoch-00000/ ... (docs/format.md)
METRICS = "_metrics.json"
DATA_DIR = "data"
LEGACY_MANIFEST = "manifest.json"  # format version 1
LEGACY_METRICS = "metrics.json"
READABLE_VERSIONS = (1, FORMAT_VERSION)


@dataclass(frozen=True)
class ShardEntry:
    """One entry of the manifest's `shards`: a shard's path relative to OUT, its packs (rows), its
    true tokens (the sum of `num_tokens`) and the sha256 of its bytes."""

    path: str
    rows: int
    tokens: int
    sha256: str


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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

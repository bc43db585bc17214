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

Every reader of an output (`packctl.contract.reader.open_output`: the loader, export, stats;
`packctl verify`) trusts a manifest only after `manifest_problems` found nothing in it: every field
a reader relies on has its type and range, every shard path is relative, normalized and inside OUT
(symbolic links resolved), and the shards are listed in the order `pack` writes them:

    {"shards": [{"path": "data/train-00000.parquet", "rows": 286, "tokens": 1170955, "sha256": "abb8..."},
                {"path": "../elsewhere.parquet", ...}]}
    -> shards[1].path '../elsewhere.parquet' leads out of OUT          [manifest-paths]
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Callable

from packctl.errors import PackctlError
from packctl.contract.schema import FORMAT_VERSION, INT32_MAX


MANIFEST = "_manifest.json"
EPOCHS = "_epochs.json"  # the OUT of --epochs > 1: one output per epoch, in epoch-00000/ ... (docs/format.md)
METRICS = "_metrics.json"
DATA_DIR = "data"
# On an object store each run writes under OUT/runs/<run-id>/ and its manifest lists its shards
# there: `runs/20261128T071800Z-3f9a0c12/data/train-00000.parquet` (output/stored.py)
RUNS_DIR = "runs"
LEGACY_MANIFEST = "manifest.json"  # format version 1
# In every directory `packctl export` writes (written last: the export is complete), so that
# INPUT never reads an export back as samples: {"packctl_version", "format", "source"}
EXPORT_MARK = "_packctl_export.json"
TOKENIZED = "tokenized"  # the manifest kind of `packctl tokenize`'s output: an input, not a packed output
LEGACY_METRICS = "metrics.json"
READABLE_VERSIONS = (1, FORMAT_VERSION)
# The counts every manifest holds (DESIGN.md's list); `packs` and `pieces` are checked when present
# (a manifest of an earlier format version that packctl still reads may lack them).
COUNT_KEYS = ("sequences_in", "sequences_packed", "sequences_dropped", "sequences_truncated", "sequences_split",
              "tokens_in", "tokens_packed", "tokens_dropped", "tokens_truncated")
OPTIONAL_COUNT_KEYS = ("packs", "pieces", "tokens_shared")  # tokens_shared: with --share-prefix
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
REPACK = "pack again"


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


def listed_shard_name(shard: int, format_version: int) -> str:
    """The path a manifest of `format_version` lists shard k under, relative to its output (an
    epoch's folder numbers its shards from 0 again): `data/train-00003.parquet`, version 1
    `part-00003.parquet`."""
    return shard_name(shard) if format_version >= 2 else f"part-{shard:05d}.parquet"


_STORE_RUN = re.compile(rf"^{RUNS_DIR}/[A-Za-z0-9._-]+/")


def store_run_prefix(shards: object) -> str:
    """The run prefix under which an output on an object store lists every shard (taken from the
    first entry), or "" for a manifest that lists them under OUT itself:

        [{"path": "runs/20261128T071800Z-3f9a0c12/data/train-00000.parquet", ...}, ...]
        -> "runs/20261128T071800Z-3f9a0c12/"
    """
    first = shards[0] if isinstance(shards, list) and shards else None
    path = first.get("path") if isinstance(first, dict) else None
    found = _STORE_RUN.match(path) if isinstance(path, str) else None
    return found.group(0) if found else ""


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


# ---- where a path may lead -----------------------------------------------------------------------


def relative_path_problem(path: str) -> str | None:
    """Why `path` cannot name a file inside OUT the way packctl writes it (relative, `/`-separated,
    normalized), or None: `../x.parquet` -> "leads out of OUT (..)"; `data//x.parquet` -> "is not
    normalized (packctl writes 'data/x.parquet')"."""
    if not path:
        return "is empty"
    if "\x00" in path:
        return "holds a NUL character"
    if "\\" in path:
        return "holds a backslash (paths inside OUT are /-separated)"
    if path.startswith("/"):
        return "is absolute (paths inside OUT are relative to it)"
    if ".." in path.split("/"):
        return "leads out of OUT (..)"
    normal = posixpath.normpath(path)
    if normal != path:
        return f"is not normalized (packctl writes {normal!r})"
    return None


def inside(root_real: str, path: Path) -> bool:
    """Whether `path`, every symbolic link on the way resolved, is inside the directory whose real
    path is `root_real` (resolve OUT first, so an OUT that is itself a link is fine)."""
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


# ---- validation ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestProblem:
    """One field of a manifest no reader may trust, with the `packctl verify` rule it breaks:

        manifest-fields   a field a reader relies on is missing, or of the wrong type or range
        manifest-paths    a shard path that is not relative, normalized and inside OUT, or listed twice
        manifest-order    the shards are not listed in the order pack writes them
        manifest-counts   counts.packs / counts.tokens_packed differ from the shards' rows / tokens

    `shard`: the index of the `shards` entry concerned; `unreadable`: its file must not be read
    (no usable path)."""

    rule: str
    field: str
    message: str
    shard: int | None = None
    unreadable: bool = False

    def __str__(self) -> str:
        return f"{self.field} {self.message}"

    def line(self, manifest_file: Path | str) -> str:
        """The one-line PackctlError message of a reader: the file, the field, what to do."""
        if self.rule == "manifest-paths":
            fix = "packctl reads only the files inside OUT that pack wrote: pack again"
        elif self.rule == "manifest-order":
            fix = "the manifest's entries were reordered, dropped or added: pack again"
        elif self.rule == "manifest-counts":
            fix = "a shard entry was dropped or added, or a count edited: pack again"
        else:
            fix = "the manifest was edited or damaged: pack again (docs/format.md says what it holds)"
        return f"{manifest_file}: {self}; {fix}"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any, low: int | None = 0, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
            and (high is None or value <= high))


def _int_at_least(low: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: _is_int(v, low)), f"an integer >= {low}"


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


# layout key -> (required, check, what it must be); docs/format.md, "_manifest.json"
LAYOUT_FIELDS: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "capacity": (True, *_int_at_least(1)),
    "align": (True, *_int_at_least(1)),
    "pad_to": (True, lambda v: v in ("capacity", "multiple", "batch"), 'one of "capacity", "multiple", "batch"'),
    "pad_token_id": (True, lambda v: _is_int(v, 0, INT32_MAX), f"an integer in [0, {INT32_MAX}]"),
    "pack_multiple": (False, lambda v: v is None or _is_int(v, 1), "an integer >= 1"),
    "ignore_index": (False, lambda v: _is_int(v, None), "an integer"),
    "cp_size": (False, *_int_at_least(1)),
    "tp_size": (False, *_int_at_least(1)),
    "sequence_parallel": (False, lambda v: isinstance(v, bool), "true or false"),
    "mode": (False, lambda v: v in ("pack", "batch"), 'one of "pack", "batch"'),
    "max_seq_len": (False, *_int_at_least(1)),
    "limits": (False, lambda v: isinstance(v, dict) and all(isinstance(k, str) and k and _is_int(n, 1, INT32_MAX)
                                                            for k, n in v.items()),
               f"an object of column: limit, each an integer in [1, {INT32_MAX}] (--limit)"),
}
_STR = (lambda v: isinstance(v, str), "a string")
_STR_OR_NULL = (lambda v: v is None or isinstance(v, str), "a string or null")
# config keys a reader acts on (stats, verify's conservation and group rules), when present
CONFIG_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "capacity": _int_at_least(1),
    "pad_to": _STR,
    "pack_multiple": (lambda v: v is None or _is_int(v, 1), "an integer >= 1 or null"),
    "too_long": _STR,
    "algorithm": _STR,
    "order": _STR,
    "tokens_column": _STR,
    "labels_column": _STR_OR_NULL,
    "skip_empty": (lambda v: isinstance(v, bool), "true or false"),
    "attn_coeff": (lambda v: v is None or _number(v), "a number or null"),
    "group_scope": _STR_OR_NULL,
}


def manifest_problems(out: Path, manifest: dict[str, Any]) -> list[ManifestProblem]:
    """Every reason not to trust `manifest`, the parsed manifest of the output directory `out`
    (an object with a readable `format_version`: `read_manifest_json`); [] for what pack writes.

    The shards must be listed as pack lists them: shard k is `data/train-0000k.parquet`
    (`part-0000k.parquet` in version 1), each path resolving inside OUT. Cheap: no shard is read.
    """
    found: list[ManifestProblem] = []
    found += _layout_problems(manifest.get("layout"))
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        found.append(ManifestProblem("manifest-fields", "shards", f"is {_shown(shards)}, a list of shards"))
        shards = []
    elif not shards:
        found.append(ManifestProblem("manifest-fields", "shards", "lists no shards; an output holds at least one"))
    shard_found, sums_known = _shards_problems(out, shards, manifest["format_version"])
    found += shard_found
    found += _counts_problems(manifest.get("counts"), shards if sums_known else [])
    found += _inputs_problems(manifest.get("inputs"))
    found += _config_problems(manifest.get("config"))
    found += _lr_scale_problems(manifest.get("lr_scale"))
    return found


def _shards_problems(out: Path, shards: list, version: int) -> tuple[list[ManifestProblem], bool]:
    """What is wrong with each shard entry, and whether every entry's rows and tokens are integers
    (the counts can then be checked against their sums)."""
    found: list[ManifestProblem] = []
    root_real = os.path.realpath(out)
    run_prefix = store_run_prefix(shards)
    seen: dict[str, int] = {}
    sums_known = True
    for k, entry in enumerate(shards):
        where = f"shards[{k}]"
        if not isinstance(entry, dict):
            found.append(ManifestProblem("manifest-fields", where, f"is {_shown(entry)}, an object with path, rows, "
                                         "tokens and sha256", shard=k, unreadable=True))
            sums_known = False
            continue
        for key in ("rows", "tokens"):
            if not _is_int(entry.get(key)):
                found.append(ManifestProblem("manifest-fields", f"{where}.{key}", f"is {_shown(entry.get(key))}, an "
                                             "integer >= 0", shard=k))
                sums_known = False
        sha = entry.get("sha256")
        if not (isinstance(sha, str) and SHA256_HEX.fullmatch(sha)):
            found.append(ManifestProblem("manifest-fields", f"{where}.sha256", f"is {_shown(sha)}, 64 lowercase hex "
                                         "digits (the sha256 of the shard's bytes)", shard=k))
        path = entry.get("path")
        if not isinstance(path, str):
            found.append(ManifestProblem("manifest-fields", f"{where}.path", f"is {_shown(path)}, a path relative to "
                                         "OUT", shard=k, unreadable=True))
            continue
        why = relative_path_problem(path)
        if why is None and not inside(root_real, out / path):
            why = "leads out of OUT through a symbolic link"
        if why is None and path in seen:
            why = f"is listed again (also shards[{seen[path]}])"
        if why is not None:
            found.append(ManifestProblem("manifest-paths", f"{where}.path", f"{_shown(path)} {why}", shard=k,
                                         unreadable=True))
            continue
        seen[path] = k
        expected = run_prefix + listed_shard_name(k, version)
        if path != expected:
            found.append(ManifestProblem("manifest-order", f"{where}.path", f"is {path!r}, where pack lists shard {k} "
                                         f"as {expected!r}", shard=k))
    return found, sums_known


def _counts_problems(counts: Any, shards: list) -> list[ManifestProblem]:
    """The counts: an object of integers holding every count key, `packs` and `tokens_packed`
    the sums of `shards`' rows and tokens (not checked when `shards` is empty)."""
    if not isinstance(counts, dict):
        return [ManifestProblem("manifest-fields", "counts", f"is {_shown(counts)}, an object of counts")]
    found = [ManifestProblem("manifest-fields", f"counts.{key}", "is missing") for key in COUNT_KEYS
             if key not in counts]
    found += [ManifestProblem("manifest-fields", f"counts.{key}", f"is {_shown(value)}, an integer >= 0")
              for key, value in counts.items() if not _is_int(value)]
    for key, column, what in (("packs", "rows", "rows"), ("tokens_packed", "tokens", "tokens")):
        if not shards:
            break
        total = sum(entry[column] for entry in shards)
        if _is_int(counts.get(key)) and counts[key] != total:
            found.append(ManifestProblem("manifest-counts", f"counts.{key}", f"is {counts[key]}, but the "
                                         f"shards' {what} sum to {total}"))
    return found


def _config_problems(config: Any) -> list[ManifestProblem]:
    if config is not None and not isinstance(config, dict):
        return [ManifestProblem("manifest-fields", "config", f"is {_shown(config)}, an object of options")]
    return [ManifestProblem("manifest-fields", f"config.{key}", f"is {_shown(config[key])}, {what}")
            for key, (check, what) in CONFIG_FIELDS.items() if isinstance(config, dict) and key in config
            and not check(config[key])]


def _layout_problems(layout: Any) -> list[ManifestProblem]:
    if not isinstance(layout, dict):
        return [ManifestProblem("manifest-fields", "layout", f"is {_shown(layout)}, an object (capacity, align, "
                                "pad_to, pad_token_id, ...)")]
    found = []
    for key, (required, check, what) in LAYOUT_FIELDS.items():
        if key not in layout:
            if required:
                found.append(ManifestProblem("manifest-fields", f"layout.{key}", f"is missing; {what}"))
        elif not check(layout[key]):
            found.append(ManifestProblem("manifest-fields", f"layout.{key}", f"is {_shown(layout[key])}, {what}"))
    return found


def _inputs_problems(inputs: Any) -> list[ManifestProblem]:
    if inputs is None:
        return []
    if not isinstance(inputs, list):
        return [ManifestProblem("manifest-fields", "inputs", f"is {_shown(inputs)}, a list of input files")]
    for i, entry in enumerate(inputs):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            return [ManifestProblem("manifest-fields", f"inputs[{i}]", f"is {_shown(entry)}, an object with a path")]
        for key in ("rows", "bytes"):
            if key in entry and not _is_int(entry[key]):
                return [ManifestProblem("manifest-fields", f"inputs[{i}].{key}", f"is {_shown(entry[key])}, an "
                                        "integer >= 0")]
    return []


def _lr_scale_problems(recorded: Any) -> list[ManifestProblem]:
    """`lr_scale`, when a manifest records one: a list indexed by step, or a {step: scale} object."""
    if recorded is None:
        return []
    values = recorded.values() if isinstance(recorded, dict) else recorded if isinstance(recorded, list) else None
    steps_ok = not isinstance(recorded, dict) or all(str(k).isdigit() for k in recorded)
    if values is None or not steps_ok or not all(_number(v) for v in values):
        return [ManifestProblem("manifest-fields", "lr_scale", f"is {_shown(recorded)}, a list of numbers (one per "
                                "step) or an object {step: number}")]
    return []


# ---- reading -------------------------------------------------------------------------------------


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in `path`, or one PackctlError line (not readable, not JSON, not an object)."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise PackctlError(f"{path}: not readable JSON ({_short(exc)}); {what}") from None
    if not isinstance(value, dict):
        raise PackctlError(f"{path}: holds {_shown(value)}, not a JSON object; {what}")
    return value


def read_manifest_json(path: str | Path) -> tuple[Path, Path, dict[str, Any]]:
    """(OUT, its manifest file, the manifest) of a packed output given as OUT or its manifest file,
    unvalidated but for what makes it a manifest at all: a JSON object with a format version this
    packctl reads. A PackctlError (exit 2, for `packctl verify` too) otherwise."""
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
    manifest = read_json_object(found, "not a packctl manifest: run packctl pack again")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise PackctlError(f"{found}: format_version {_shown(version)}, this packctl reads versions "
                           f"{', '.join(map(str, READABLE_VERSIONS))}: use the packctl that wrote it, or pack again")
    return out, found, manifest


def read_manifest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(OUT, its manifest) of a packed output given as OUT or its manifest file, validated
    (`manifest_problems`): the manifest reader of every consumer, with one PackctlError (exit 2)
    naming the file and the field of the first problem. Reads format versions 1 and 2.

        shards[0] and shards[1] swapped in the manifest ->
        error: out/_manifest.json: shards[0].path is 'data/train-00001.parquet', where pack lists
        shard 0 as 'data/train-00000.parquet'; the manifest's entries were reordered, dropped or added: pack again
    """
    out, found, manifest = read_manifest_json(path)
    problems = manifest_problems(out, manifest)
    if problems:
        raise PackctlError(problems[0].line(found))
    return out, manifest


def epoch_outputs(out: str | Path) -> list[Path] | None:
    """The output of every epoch of an OUT written by `packctl pack --epochs K` (K > 1), in epoch
    order: [OUT/epoch-00000, ...]; None for any other path (one output, or none).

    `_epochs.json` is validated as a manifest is: its `epochs` an integer >= 1, its `outputs` one
    entry per epoch whose `path` is the epoch's folder (`epoch-0000e`), each folder inside OUT."""
    out = Path(out)
    index_file = out / EPOCHS
    if not index_file.is_file():
        return None
    index = read_json_object(index_file, "run packctl pack again")

    def broken(field: str, message: str) -> PackctlError:
        return PackctlError(f"{index_file}: {field} {message}; the index of epochs was edited or damaged: "
                            "run packctl pack again")

    version = index.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise broken("format_version", f"is {_shown(version)}, this packctl reads versions "
                     f"{', '.join(map(str, READABLE_VERSIONS))}")
    epochs = index.get("epochs")
    if not _is_int(epochs, 1):
        raise broken("epochs", f"is {_shown(epochs)}, an integer >= 1")
    listed = index.get("outputs")
    if not isinstance(listed, list) or len(listed) != epochs:
        raise broken("outputs", f"is {_shown(listed)}, a list of the {epochs} epochs' outputs")
    root_real = os.path.realpath(out)
    for e, entry in enumerate(listed):
        path = entry.get("path") if isinstance(entry, dict) else None
        if path != epoch_dir(e):
            raise broken(f"outputs[{e}].path", f"is {_shown(path)}, where pack writes epoch {e} to {epoch_dir(e)!r}")
        if not inside(root_real, out / path):
            raise broken(f"outputs[{e}].path", f"{path!r} leads out of OUT through a symbolic link")
    return [out / epoch_dir(e) for e in range(epochs)]


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


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

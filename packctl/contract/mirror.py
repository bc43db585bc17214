"""A packed output on an object store (`s3://bucket/out`), read through a local mirror.

Every reader of outputs (`open_output`: the loader, `stats`, `export`, `materialize`; `verify`)
reads local files. For an OUT on a store they read a mirror of it: `_manifest.json` is fetched
first (one GET), then each shard it lists the first time a reader asks for it (one GET of the whole
object, hashed as it streams), and nothing else: the prefix is never listed, so an unfinished run's
shards or the shards of a run being replaced (docs/object-stores.md) are never seen.

    mirror = mirror_output("s3://bucket/out")
    mirror.root                   ~/.cache/packctl/outputs/<url digest>-<manifest digest>/
    mirror.fetch("runs/20261128T071800Z-3f9a0c12/data/train-00000.parquet", sha256)
                                  the shard, downloaded once, its sha256 checked against the manifest

The cache (`$XDG_CACHE_HOME/packctl/outputs`, else `~/.cache/packctl/outputs`; `PACKCTL_OUTPUT_CACHE`
names another directory) holds one folder per output URL and manifest: a manifest replaced by
`pack --overwrite` has another digest, so a mirror never mixes two runs, and every process of a node
(the ranks of a training job) shares the shards one of them downloaded. A shard enters the cache
only when its bytes have the manifest's sha256, under a temporary name renamed into place, so a
reader never meets a partial or unchecked file there; the local reader then checks it again as it
checks any output. Deleting the cache is always safe.

`verify` mirrors into a scratch directory instead, with every listed shard fetched as it is
(`check=False`), so that its rules report a changed object as they report a changed file.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packctl.contract.manifest import EPOCHS, MANIFEST, METRICS, TOKENIZED, relative_path_problem, store_run_prefix
from packctl.errors import PackctlError
from packctl.urls import refuse_url

CACHE_ENV = "PACKCTL_OUTPUT_CACHE"
CHUNK = 8 << 20  # bytes a GET streams at a time while hashing


@dataclass(frozen=True)
class StoreMirror:
    """An output URL and the local folder mirroring it. `check`: a shard is kept only when its
    bytes have the manifest's sha256 (False: kept as fetched, for `verify` to judge)."""

    url: str
    root: Path
    check: bool = True

    def fetch(self, rel: str, sha256: str | None) -> Path:
        """The local copy of OUT/`rel`, downloaded first if the mirror lacks it."""
        local = self.root / rel
        if local.is_file():
            return local
        problem = relative_path_problem(rel)
        if problem is not None:  # the manifest was validated, but this is where a bad path would escape
            raise PackctlError(f"{self.url}/{rel}: the manifest's shard path {problem}; pack again")
        url = f"{self.url}/{rel}"
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=local.parent)
        try:
            with os.fdopen(fd, "wb") as sink:
                digest = _download(url, sink)
            if self.check and isinstance(sha256, str) and digest != sha256:
                raise PackctlError(f"{url}: sha256 differs from the manifest's ({MANIFEST}): the object was changed "
                                   "or damaged after packctl pack wrote it; pack again")
            os.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return local

    def local_name(self, text: str) -> str:
        """`text` with the mirror's folder spelled as the URL it mirrors, for messages."""
        return text.replace(str(self.root), self.url)


def mirror_output(url: str, into: str | Path | None = None, *, check: bool = True) -> StoreMirror:
    """The mirror of the output at `url` (OUT, or OUT/_manifest.json): its manifest fetched, and its
    report (`_metrics.json`) when the store holds one of the manifest's run. `into`: a folder to
    mirror into instead of the cache (made if missing)."""
    from packctl.store import is_store_url, normalize_url, open_object, stat_object

    if not is_store_url(url):
        refuse_url(url, "input")
    url = normalize_url(url)
    if url.endswith("/" + MANIFEST):
        url = url[: -len(MANIFEST) - 1]
    if stat_object(f"{url}/{MANIFEST}") is None:
        if stat_object(f"{url}/{EPOCHS}") is not None:
            raise PackctlError(f"{url}: an output of packctl pack --epochs; packctl reads only single outputs from "
                               "an object store: copy it locally (`aws s3 sync`) and read the copy", everywhere=True)
        raise PackctlError(f"{url}: no {MANIFEST}, so nothing complete is there (packctl pack writes {MANIFEST} "
                           "last, as its commit): check the URL, or run packctl pack again", everywhere=True)
    manifest_bytes = _read_all(url, MANIFEST, open_object)
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        raise PackctlError(f"{url}/{MANIFEST}: not a packctl manifest (not a JSON object); run packctl pack again",
                           everywhere=True)
    if into is None:
        key = hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + hashlib.sha256(manifest_bytes).hexdigest()[:16]
        root = _cache_root() / key
    else:
        root = Path(into)
    root.mkdir(parents=True, exist_ok=True)
    _put_local(root / MANIFEST, manifest_bytes)
    # the run's own report matches its manifest; OUT/_metrics.json may be a newer run's for a moment
    for name in (store_run_prefix(manifest.get("shards")) + METRICS, METRICS):
        if stat_object(f"{url}/{name}") is not None:
            _put_local(root / METRICS, _read_all(url, name, open_object))
            break
    return StoreMirror(url=url, root=root, check=check)


def store_manifest_kind(url: str) -> str | None:
    """What the store holds at `url`: "packed" (a packed output's manifest, or the index of an
    output of `pack --epochs`), "tokenized" (a corpus of `packctl tokenize`, an input), or None."""
    from packctl.store import is_store_url, normalize_url, open_object, stat_object

    if not is_store_url(url):
        return None
    url = normalize_url(url)
    if url.endswith("/" + MANIFEST):
        url = url[: -len(MANIFEST) - 1]
    if stat_object(f"{url}/{MANIFEST}") is None:
        return "packed" if stat_object(f"{url}/{EPOCHS}") is not None else None
    try:
        manifest = json.loads(_read_all(url, MANIFEST, open_object))
    except ValueError:
        return "packed"  # not JSON: the reader says so in one line
    return "tokenized" if isinstance(manifest, dict) and manifest.get("kind") == TOKENIZED else "packed"


def _cache_root() -> Path:
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    from packctl.cachedir import user_cache_dir

    found = user_cache_dir("outputs")
    if found is None:
        raise PackctlError(f"no writable cache directory for an output read from an object store; set {CACHE_ENV} "
                           "to a directory packctl may write", everywhere=True)
    return Path(found)


def _read_all(url: str, name: str, open_object) -> bytes:
    handle, _ = open_object(f"{url}/{name}")
    with handle:
        return handle.read()


def _download(url: str, sink) -> str:
    """Stream the object at `url` into `sink`; its sha256 (hex)."""
    from packctl.store import open_object, store_error

    handle, _ = open_object(url)
    hasher = hashlib.sha256()
    with handle:
        while True:
            try:
                chunk = handle.read(CHUNK)
            except OSError as exc:
                raise store_error(url, exc, "read") from None
            if not chunk:
                break
            hasher.update(chunk)
            sink.write(chunk)  # a full disk is the local OSError it is, not the store's
    return hasher.hexdigest()


def _put_local(path: Path, data: bytes) -> None:
    """Write `data` at `path` under a temporary name renamed into place (readers share the cache)."""
    fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

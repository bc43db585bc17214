"""INPUT on an object store (`s3://bucket/prefix`): the objects a run reads, resolved by the rules
of local INPUT (source/resolve.py) where a store has their like.

    s3://corpus/tok                     every *.parquet object below the prefix (its dataset splits
                                        as a local directory's, --split)
    s3://corpus/tok/a.parquet           that object
    's3://corpus/**/train-*.parquet'    the objects a glob matches (`**`: any number of names)

    resolve_objects(["s3://corpus/tok"])  ->  files s3://corpus/tok/a.parquet, s3://corpus/tok/b/c.parquet

Each object is read once here for its fingerprint (size, last-modified time, footer digest), which
every later open checks (source/files.py). A store has no links and no inodes: an object's
identity is its URL (device 0, inode a 63-bit digest of the URL, so one object reached by two
INPUTs or two `--source`s is known as one). Parquet objects only; one run reads local files or
objects, not both. packctl outputs are never input: an object whose Parquet metadata has the
`packctl` key, or one below a prefix holding packctl's `_manifest.json`, `_epochs.json` or
`_packctl_export.json`, is refused naming it.
"""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

from packctl import store
from packctl.contract.manifest import EPOCHS, EXPORT_MARK, LEGACY_MANIFEST, MANIFEST
from packctl.contract.schema import METADATA_KEY
from packctl.errors import PackctlError
from packctl.source.files import forget_first_footers, read_fingerprint
from packctl.source.index import Resolution, ResolvedFile
from packctl.source.kinds import PARQUET, InputOptions, claimed, kind_of_paths
from packctl.source.splits import select_split
from packctl.source.tokenized import TOKENIZED
from packctl.urls import is_url

_MARKERS = (MANIFEST, EPOCHS, EXPORT_MARK, LEGACY_MANIFEST)
READERS = 16  # objects whose footers are read at once when a run resolves its input


def resolve_objects(specs: list[str], *, split: str | None = None,
                    options: InputOptions | None = None) -> Resolution:
    """Store INPUT specs (normalized URLs) -> the run's input objects (module docstring)."""
    local = [spec for spec in specs if not is_url(spec)]
    if local:
        raise PackctlError(f"{local[0]}: a local INPUT beside the store INPUT {next(s for s in specs if is_url(s))}; "
                           "one run reads local files or objects of a store, not both: copy one side to the other")
    by_url: dict[str, str] = {}  # url -> the spec that reached it
    listed: dict[str, store.StoreObject] = {}  # url -> its size and last-modified time, as listed
    for spec in specs:
        for url in _expand(spec, split, options, listed):
            if url in by_url:
                raise PackctlError(f"{url}: given twice (by INPUT {by_url[url]} and by INPUT {spec}); list each "
                                   "input object once")
            by_url[url] = spec
    urls = sorted(by_url)
    kind = kind_of_paths(urls, options)
    if kind is not PARQUET:
        raise PackctlError(f"{urls[0]}: packctl reads Parquet objects from a store (Megatron pairs and JSONL are "
                           "read from local files): copy them locally, or convert them to Parquet")
    forget_first_footers()
    files = []
    # the first reads (a HEAD and a ranged GET of the footer each) overlap: the store's latency, not
    # the bytes, is their cost
    with ThreadPoolExecutor(max_workers=min(READERS, len(urls) or 1), thread_name_prefix="packctl-footer") as pool:
        first_reads = list(pool.map(lambda url: read_fingerprint(url, listed.get(url)), urls))
    for url, (fingerprint, metadata, _) in zip(urls, first_reads):
        if METADATA_KEY in (metadata.metadata or {}):
            raise PackctlError(
                f"{url}: a shard written by packctl (its Parquet metadata has the 'packctl' key); packctl outputs "
                f"are never read as input: leave it out of INPUT {by_url[url]}")
        identity = int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "little") >> 1
        files.append(ResolvedFile(path=url, spec=by_url[url], device=0, inode=identity, fingerprint=fingerprint))
    return Resolution(specs=list(specs), files=files, kind=kind)


def _expand(spec: str, split: str | None, options: InputOptions | None, listed: dict) -> list[str]:
    """The object URLs one INPUT reaches: an object, a glob's matches, or a prefix's claimed
    objects; `listed` takes each listed object's `StoreObject`."""
    if set("*?[") & set(spec.split("://", 1)[1]):
        found = store.glob_objects(spec)
        listed.update((o.url, o) for o in found)
        if not found:
            raise PackctlError(f"{spec}: the pattern matches no object")
        root = spec.split("://", 1)[0] + "://" + spec.split("://", 1)[1].split("*")[0].split("?")[0].split("[")[0]
        urls = _not_outputs([o.url for o in found], root.rstrip("/"), spec)
        return [u for u in urls if claimed(u.rsplit("/", 1)[-1], options)]
    below = store.list_objects(spec)  # first: a listing's errors name their cause, a HEAD's cannot
    listed.update((o.url, o) for o in below)
    if not below:
        if store.stat_object(spec) is not None:
            return [spec]
        raise PackctlError(f"{spec}: no such object, and no object below that prefix; check the URL")
    urls = _not_outputs([o.url for o in below], spec, spec)
    claimed_urls = [u for u in urls if claimed(u.rsplit("/", 1)[-1], options)]
    if not claimed_urls:
        raise PackctlError(f"{spec}: the prefix holds no *.parquet object")
    relative = {u[len(spec) + 1:]: u for u in claimed_urls}
    return [relative[name] for name in select_split(spec, sorted(relative), split)]


def _not_outputs(urls: list[str], root: str, spec: str) -> list[str]:
    """`urls` (a listing below `root`), refused when one lies in a packctl output: a prefix between
    it and `root` holding a manifest (a tokenized corpus of `packctl tokenize` is input, not output)."""
    markers = {u.rsplit("/", 1)[0]: u for u in urls if u.rsplit("/", 1)[-1] in _MARKERS}
    kept = []
    for url in urls:
        if url in markers.values():
            continue
        prefix = url.rsplit("/", 1)[0]
        while len(prefix) >= len(root.rstrip("/")) and "://" in prefix:
            marker = markers.get(prefix)
            if marker is not None and _is_packctl_output(marker):
                raise PackctlError(f"{url}: part of the packctl output {prefix} (it holds {marker.rsplit('/', 1)[-1]}); "
                                   f"packctl outputs are never input: narrow INPUT {spec} to leave it out")
            if prefix == root.rstrip("/"):
                break
            prefix = prefix.rsplit("/", 1)[0]
        kept.append(url)
    return kept


def _is_packctl_output(marker_url: str) -> bool:
    handle, found = store.open_object(marker_url)
    try:
        content = json.loads(handle.read_at(found.size, 0))
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and "packctl_version" in content and content.get("kind") != TOKENIZED

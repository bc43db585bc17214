"""Object stores: an `s3://`, `gs://` or `hf://` URL as a pyarrow filesystem and a path in it, the
objects a URL lists, their identity, and the one-line errors of a store.

    filesystem_of("s3://corpus/tok/a.parquet")  ->  (S3FileSystem(...), "corpus/tok/a.parquet")
    list_objects("s3://corpus/tok")              ->  [StoreObject("s3://corpus/tok/a.parquet", 706, 1732...)]
    open_object("s3://corpus/tok/a.parquet")     ->  (pyarrow RandomAccessFile, StoreObject)

pyarrow's own filesystems are used rather than fsspec: `pyarrow.parquet.ParquetFile` over
`open_input_file` reads the footer and each row group with ranged GETs (no whole-object download),
the S3 client is the AWS SDK's (credentials from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/
`AWS_SESSION_TOKEN`, `AWS_PROFILE`, `~/.aws/credentials` and `~/.aws/config`, instance roles), and
its standard retry strategy retries throttling, 5xx and connection errors with exponential backoff.
pyarrow reports no ETag, so an object's identity is its size, its last-modified time and the digest
of its Parquet footer (`packctl.source.files`); each later open checks its size and footer. An
endpoint other than AWS's (MinIO, a local test server) is `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`.

`gs://bucket/key` is read by pyarrow's GCS client (Google's default credentials;
`STORAGE_EMULATOR_HOST` for an emulator), `hf://datasets/org/name[@revision]/key` by huggingface_hub's
fsspec filesystem wrapped as a pyarrow one (the `hf` extra). Outputs are written to `s3://` only
(`WRITTEN`); other schemes are refused by `packctl.urls.refuse_url`. This module imports
`pyarrow.fs` only when a URL is opened, so a run over local files never loads it.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from functools import lru_cache

from packctl.errors import PackctlError
from packctl.urls import is_url

SCHEMES = ("s3", "gs", "hf")  # the stores packctl reads
WRITTEN = ("s3",)  # the stores packctl writes outputs to (output/stored.py)
# attempts per request (the first and the retries) of the AWS SDK's standard retry strategy
RETRY_ATTEMPTS = 6
RETRY_SECONDS = 60  # how long pyarrow's GCS client retries a request that fails transiently


@dataclass(frozen=True)
class StoreObject:
    """An object as the store lists it: its URL, size in bytes and last-modified time.

        StoreObject(url="s3://corpus/tok/a.parquet", size=706, mtime_ns=1732526040000000000)
    """

    url: str
    size: int
    mtime_ns: int


def is_store_url(path: object) -> bool:
    """Whether `path` is a URL of a store packctl reads (`s3://`, `gs://`, `hf://`)."""
    return is_url(path) and str(path).split("://", 1)[0].lower() in SCHEMES


def is_written_url(path: object) -> bool:
    """Whether `path` is a URL of a store packctl writes outputs to (`s3://`)."""
    return is_url(path) and str(path).split("://", 1)[0].lower() in WRITTEN


def normalize_url(url: str) -> str:
    """A URL as the run records it: one scheme spelling, no repeated or trailing slashes.

        normalize_url("S3://corpus//tok/") -> "s3://corpus/tok"
    """
    scheme, rest = url.split("://", 1)
    rest = re.sub(r"/+", "/", rest).strip("/")
    return f"{scheme.lower()}://{rest}"


def filesystem_of(url: str):
    """(pyarrow filesystem, path within it) for a store URL: `s3://bucket/key` -> `bucket/key`,
    `gs://bucket/key` -> `bucket/key`, `hf://datasets/org/name/key` -> `datasets/org/name/key`."""
    scheme, rest = url.split("://", 1)
    return FILESYSTEMS[scheme.lower()](), rest


def _s3():
    return _s3_filesystem(_endpoint(), _credentials_key())


def _gs():
    return _gcs_filesystem(os.environ.get("STORAGE_EMULATOR_HOST") or None)


def _hf():
    return _hf_filesystem(os.environ.get("HF_ENDPOINT") or None, os.environ.get("HF_TOKEN") or None)


# scheme -> the pyarrow filesystem of the process for it (a test may put its own in)
FILESYSTEMS = {"s3": _s3, "gs": _gs, "hf": _hf}


def _endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _credentials_key() -> tuple:
    """What selects the credentials the SDK finds, so that a process whose environment changes
    them (a test, a long-lived loader) gets a client of the new ones. Held in memory only."""
    return tuple(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                             "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"))


@lru_cache(maxsize=4)
def _s3_filesystem(endpoint: str | None, credentials: tuple):
    """One S3 client per endpoint and credentials for the process; the SDK finds the credentials
    (`credentials` only keys the cache)."""
    from pyarrow import fs

    options = {"retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=RETRY_ATTEMPTS)}
    # an object smaller than one part is written by one PutObject, not a multipart upload of three
    # requests (output/stored.py: the manifest is the commit's one PUT); reads are not affected
    options["allow_delayed_open"] = True
    if endpoint is not None:
        options["endpoint_override"] = endpoint
        options["scheme"] = "https" if endpoint.startswith("https://") else "http"
        options["region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return fs.S3FileSystem(**options)


@lru_cache(maxsize=2)
def _gcs_filesystem(emulator: str | None):
    """Google Cloud Storage through pyarrow's client: credentials from Google's default chain
    (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, the metadata server
    of a GCE/GKE node); `STORAGE_EMULATOR_HOST` (`http://127.0.0.1:9023`) names an emulator, read
    without credentials as Google's own clients do."""
    from datetime import timedelta

    from pyarrow import fs

    options = {"retry_time_limit": timedelta(seconds=RETRY_SECONDS)}
    if emulator is not None:
        scheme, _, host = emulator.rpartition("://")
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme or "http", anonymous=True)
    return fs.GcsFileSystem(**options)


@lru_cache(maxsize=2)
def _hf_filesystem(endpoint: str | None, token: str | None):
    """The Hugging Face Hub through huggingface_hub's fsspec filesystem (the `hf` extra), as a
    pyarrow filesystem: `datasets/org/name@revision/path`; the token is `HF_TOKEN` or the one
    `huggingface-cli login` saved, the endpoint `HF_ENDPOINT` (a mirror)."""
    from pyarrow import fs

    from packctl.errors import require

    hub = require("huggingface_hub", "hf", "read hf:// URLs")
    options = {"token": token} if token is not None else {}
    if endpoint is not None:
        options["endpoint"] = endpoint
    return fs.PyFileSystem(fs.FSSpecHandler(hub.HfFileSystem(**options)))


def store_error(url: str, exc: BaseException, doing: str) -> PackctlError:
    """A store's failure as one line naming the URL and what to do; never the request's
    credentials (the SDK's messages hold none; only their first line and the error's name are kept).

        store_error("s3://nope/x", OSError("... AWS Error NO_SUCH_BUCKET ..."), "list")
        -> "s3://nope/x: cannot list: the bucket does not exist; check the bucket name in the URL"
    """
    text = str(exc)
    scheme, rest = url.split("://", 1)
    bucket = rest.split("/", 1)[0]
    if scheme != "s3":
        return _other_store_error(url, scheme, exc, doing)
    if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text:
        why = f"the bucket {bucket} does not exist; check the bucket name in the URL"
    elif any(code in text for code in ("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH",
                                       "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken")):
        why = ("the store refused the credentials (unknown key or wrong secret); set AWS_ACCESS_KEY_ID and "
               "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials of that store")
    elif "ACCESS_DENIED" in text or "AccessDenied" in text or "Forbidden" in text or "403" in text:
        why = f"access denied; grant these credentials s3:ListBucket and s3:GetObject on {bucket}"
    elif isinstance(exc, FileNotFoundError) or "NO_SUCH_KEY" in text or "NoSuchKey" in text:
        why = "no such object"
    else:
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        why = f"{first[:200]}; check the endpoint and the network, then rerun"
    return PackctlError(f"{url}: cannot {doing}: {why}", everywhere=True)


def _other_store_error(url: str, scheme: str, exc: BaseException, doing: str) -> PackctlError:
    """`store_error` for GCS and the Hub, whose clients word their errors otherwise."""
    text = str(exc)
    if isinstance(exc, FileNotFoundError) or "404" in text or "Not Found" in text or "not found" in text:
        why = "no such object (or a repository or revision that does not exist)" if scheme == "hf" else \
            "no such object or bucket"
    elif "401" in text or "403" in text or "Unauthorized" in text or "Forbidden" in text or "denied" in text.lower():
        why = ("access denied: a private or gated repository needs HF_TOKEN (or `huggingface-cli login`) with access "
               "to it" if scheme == "hf" else "access denied; grant these credentials storage.objects.list and "
               "storage.objects.get on the bucket (GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth "
               "application-default login`)")
    else:
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        why = f"{first[:200]}; check the endpoint and the network, then rerun"
    return PackctlError(f"{url}: cannot {doing}: {why}", everywhere=True)


def _call(url: str, doing: str, fn, *args):
    try:
        return fn(*args)
    except PackctlError:
        raise
    except (OSError, ValueError) as exc:
        raise store_error(url, exc, doing) from None


def _object(url: str, info) -> StoreObject:
    return StoreObject(url=url, size=int(info.size), mtime_ns=int(info.mtime_ns or 0))


def stat_object(url: str) -> StoreObject | None:
    """The object at `url`, or None when there is none (a prefix, or nothing)."""
    from pyarrow import fs

    filesystem, path = filesystem_of(url)
    info = _call(url, "read", filesystem.get_file_info, path)
    if info.type == fs.FileType.NotFound:
        _check_bucket(url, filesystem, path, "read")
    return _object(url, info) if info.type == fs.FileType.File else None


def list_objects(url: str) -> list[StoreObject]:
    """Every object below the prefix `url` (recursively), sorted by URL; a prefix with nothing
    below it lists nothing."""
    from pyarrow import fs

    filesystem, path = filesystem_of(url)
    scheme = url.split("://", 1)[0]
    selector = fs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True)
    try:
        infos = filesystem.get_file_info(selector)
    except NotADirectoryError:  # the URL names an object: nothing below it (a filesystem with folders says so)
        infos = []
    except (OSError, ValueError) as exc:
        raise store_error(url, exc, "list") from None
    # a store's path names no scheme; an fsspec filesystem's may lead with "/"
    found = sorted((_object(f"{scheme}://{info.path.lstrip('/')}", info) for info in infos
                    if info.type == fs.FileType.File), key=lambda o: o.url)
    if not found:
        _check_bucket(url, filesystem, path, "list")
    return found


def _check_bucket(url: str, filesystem, path: str, doing: str) -> None:
    """Refuse a URL whose bucket does not exist (pyarrow reports it as an empty listing); the
    Hub's repositories say so themselves."""
    from pyarrow import fs

    if url.startswith("hf://"):
        return

    bucket = _call(url, doing, filesystem.get_file_info, path.split("/", 1)[0])
    if bucket.type == fs.FileType.NotFound:
        raise store_error(url, OSError("NO_SUCH_BUCKET"), doing)


def glob_objects(pattern: str) -> list[StoreObject]:
    """The objects a glob URL matches: `*`, `?` and `[...]` within one name, `**` for any number of
    names. The listing starts at the pattern's fixed leading names.

        glob_objects("s3://corpus/**/train-*.parquet") -> every train-*.parquet below s3://corpus
    """
    scheme, rest = pattern.split("://", 1)
    parts = rest.split("/")
    fixed = 0
    while fixed < len(parts) and not set("*?[") & set(parts[fixed]):
        fixed += 1
    prefix = f"{scheme}://" + "/".join(parts[:fixed])
    below = list_objects(prefix)
    return [o for o in below if _matches(parts[fixed:], o.url[len(prefix):].strip("/").split("/"))]


def _matches(pattern: list[str], names: list[str]) -> bool:
    """Whether glob parts match a key's names: a match of a leading part of the names (a
    "directory" of the store) takes every object below it, as a directory INPUT does."""
    if not pattern:
        return True
    if not names:
        return all(part == "**" for part in pattern)
    part = pattern[0]
    if part == "**":
        return _matches(pattern[1:], names) or _matches(pattern, names[1:])
    return bool(re.match(fnmatch.translate(part), names[0])) and _matches(pattern[1:], names[1:])


def open_object(url: str):
    """(a pyarrow random-access file over the object, its `StoreObject`): HEAD requests for its
    size and last-modified time, then ranged GETs as the file is read."""
    from pyarrow import fs

    filesystem, path = filesystem_of(url)
    info = _call(url, "read", filesystem.get_file_info, path)
    if info.type != fs.FileType.File:
        _check_bucket(url, filesystem, path, "read")
        raise PackctlError(f"{url}: cannot read: no such object", everywhere=True)
    return _call(url, "read", filesystem.open_input_file, path), _object(url, info)


def open_reader(url: str):
    """(a pyarrow random-access file over the object at `url`, its size): one HEAD, by pyarrow's
    open, then ranged GETs as the file is read. For the opens of a run after the object's identity
    was taken (`open_object`), which check what they read against it."""
    filesystem, path = filesystem_of(url)
    handle = _call(url, "read", filesystem.open_input_file, path)
    return handle, _call(url, "read", handle.size)


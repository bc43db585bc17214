"""URLs where packctl takes a local path: refused in one line until object stores are read.

    refuse_url("s3://bucket/corpus", "input")
    -> PackctlError("s3://bucket/corpus: object-store and URL inputs are not read yet; copy the
       files locally (e.g. `aws s3 sync s3://bucket/corpus DIR`) and pass the local directory")

Without this, `os.path.normpath` turns `s3://bucket/corpus` into `s3:/bucket/corpus`, which then
"does not exist".
"""
from __future__ import annotations

import os
import re

from packctl.errors import PackctlError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# How a user copies what a scheme names to a local directory, and back
_COPY_IN = {"s3": "aws s3 sync {url} DIR", "gs": "gcloud storage rsync -r {url} DIR",
            "hf": "huggingface-cli download --repo-type dataset ... --local-dir DIR",
            "http": "curl -O {url}", "https": "curl -O {url}"}
_COPY_OUT = {"s3": "aws s3 sync DIR {url}", "gs": "gcloud storage rsync -r DIR {url}"}


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` is spelled `scheme://...` (s3://, gs://, hf://, http(s)://, any scheme)."""
    return isinstance(path, str) and bool(_URL.match(path))


def refuse_url(path: str | os.PathLike, role: str) -> None:
    """Refuse a URL given as an input (`role` "input") or as an output directory ("output")."""
    if not is_url(path):
        return
    scheme = str(path).split("://", 1)[0].lower()
    if role == "output":
        copy = _COPY_OUT.get(scheme, "a copy tool of that store").format(url=path)
        raise PackctlError(f"{path}: object-store and URL outputs are not written yet; write to a local "
                           f"directory and copy it there (e.g. `{copy}`)", everywhere=True)
    copy = _COPY_IN.get(scheme, "a copy tool of that store")
    raise PackctlError(f"{path}: object-store and URL inputs are not read yet; copy the files locally (e.g. "
                       f"`{copy.format(url=path)}`) and pass the local directory", everywhere=True)

"""Where packctl keeps what it caches between runs (compiled kernels, matplotlib's font list) when
the place the library would choose cannot be written: a read-only install, an unwritable HOME.

    user_cache_dir("numba")
    -> $XDG_CACHE_HOME/packctl/numba, else ~/.cache/packctl/numba, else
       $TMPDIR/packctl-numba-UID (made by and for this user alone), whichever is writable first;
       None when none is (the caller then runs without a cache)
"""
from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


def user_cache_dir(name: str) -> str | None:
    """The first writable cache directory for `name` (module docstring), made if missing."""
    for candidate in _candidates(name):
        if writable(candidate):
            return candidate
    return None


def _candidates(name: str) -> Iterator[str]:
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG rule: a relative value is ignored
        yield os.path.join(xdg, "packctl", name)
    try:
        yield os.path.join(Path.home(), ".cache", "packctl", name)
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        pass
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    temp = os.path.join(tempfile.gettempdir(), f"packctl-{name}-{user}")
    if own_private_dir(temp):
        yield temp


def writable(path: str) -> bool:
    """Whether `path` is (or can be made) a directory a file can be created in (numba's own test)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def own_private_dir(path: str) -> bool:
    """Make `path` a directory only this user can write, or check that it is one. A shared temp
    directory is writable by all: what is loaded from a cache there (numba's compiled code) must
    come from a directory nobody else could have made or written into."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))

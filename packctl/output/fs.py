"""Failed writes as the one-line errors users can act on: what failed, where, on which filesystem,
and what to do.

    write_failed(Path("out/data/train-00003.parquet"), OSError(28, "No space left on device"))
    -> PackctlError("out/data/train-00003.parquet: write failed (No space left on device, on the
       filesystem mounted at /scratch); free space there or choose another -o")
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from packctl.errors import PackctlError

# What to do, by cause; anything else: the generic advice.
_ADVICE = {
    errno.ENOSPC: "free space there or choose another -o",
    errno.EDQUOT: "free space within your quota or choose another -o",
    errno.EROFS: "the filesystem is read-only: choose another -o",
    errno.EACCES: "no permission: choose a writable -o",
    errno.EPERM: "no permission: choose a writable -o",
}


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds `path` (or its nearest existing ancestor)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        device = path.stat().st_dev
        while path != path.parent and path.parent.stat().st_dev == device:
            path = path.parent
    except OSError:
        pass
    return path


def write_failed(path: Path, exc: OSError, advice: str | None = None) -> PackctlError:
    """The error of a write (or create, rename, fsync) of `path` that failed with `exc`."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return PackctlError(f"{path}: write failed ({reason}, on the filesystem mounted at {mount_point(path)}); "
                        f"{advice or _ADVICE.get(exc.errno, 'free space or choose another -o')}")

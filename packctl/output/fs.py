"""Failed writes as the one-line errors users can act on: what failed, where, on which filesystem,
and what to do.

    write_failed(Path("out/data/train-00003.parquet"), OSError(28, "No space left on device"))
    -> PackctlError("out/data/train-00003.parquet: write failed (No space left on device, on the
       filesystem mounted at /scratch); free space there or choose another -o")
"""
from __future__ import annotations

import errno
import os
import re
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


# numpy's `tofile` (and `np.save` into a file, which uses it) reports a write the device cut
# short without an errno: "100000 requested and 4096 written"
_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")


def error_number(exc: OSError) -> int | None:
    """The errno of a failed write; a short write without one (numpy's) is a full device: ENOSPC."""
    if exc.errno is None and _SHORT_WRITE.match(str(exc)):
        return errno.ENOSPC
    return exc.errno


def write_failed(path: Path, exc: OSError, advice: str | None = None) -> PackctlError:
    """The error of a write (or create, rename, fsync) of `path` that failed with `exc`.

        write_failed(Path("olmo/part-00000.npy"), OSError("100000 requested and 4096 written"))
        -> "olmo/part-00000.npy: write failed (No space left on device: 100000 requested and 4096
           written, on the filesystem mounted at /scratch); free space there or choose another -o"
    """
    number = error_number(exc)
    reason = exc.strerror or str(exc) or type(exc).__name__
    if number == errno.ENOSPC and exc.errno is None:
        reason = f"{os.strerror(errno.ENOSPC)}: {exc}"
    return PackctlError(f"{path}: write failed ({reason}, on the filesystem mounted at {mount_point(path)}); "
                        f"{advice or _ADVICE.get(number, 'free space or choose another -o')}")

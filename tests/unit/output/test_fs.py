"""Failed writes as one line (output/fs.py): what failed, where, on which filesystem, what to do."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from packctl.output.fs import error_number, write_failed


def _short_write() -> OSError:
    """The error numpy's `tofile` raises on a full device: no errno, "N requested and M written"."""
    try:
        np.arange(100_000).tofile("/dev/full")
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full took the write")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_short_write_of_numpy_is_named_a_full_device(tmp_path):
    """OLMo's token files and spilled tokens are written by numpy; on a full disk it says only
    "100000 requested and 0 written": the line names ENOSPC's cause, the path and the filesystem."""
    exc = _short_write()
    assert exc.errno is None and error_number(exc) == errno.ENOSPC
    line = str(write_failed(tmp_path / "olmo" / "part-00000.npy", exc))
    assert line.startswith(f"{tmp_path}/olmo/part-00000.npy: write failed (No space left on device: "
                           "100000 requested and 0 written, on the filesystem mounted at ")
    assert line.endswith("free space there or choose another -o")


def test_other_errors_keep_their_own_reason(tmp_path):
    exc = OSError(errno.EROFS, "Read-only file system")
    assert error_number(exc) == errno.EROFS
    assert "(Read-only file system, on the filesystem mounted at" in str(write_failed(Path(tmp_path), exc))
    assert error_number(OSError("something else")) is None

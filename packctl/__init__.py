"""packctl: pack variable-length tokenized datasets into THD shards for LLM training, offline.

    >>> import packctl
    >>> result = packctl.pack(packctl.PackConfig(inputs=["sample_data"], output="out", capacity=4096))
    >>> result.counts["sequences_packed"]  # doctest: +SKIP
"""
from __future__ import annotations

import os

# Arrow's allocator (mimalloc) returns freed pages to the system 10 ms after they are freed by
# default, so nearly every block decoded and every shard encoded fills fresh pages again. Keeping
# them for a second lets the next block or shard reuse them: `pack` runs 6-9% faster, peak memory
# stays within the budget's margin (docs/performance.md). Read once, when pyarrow loads: it
# applies when packctl is imported first (the `packctl` command), and a user's own setting wins.
os.environ.setdefault("MIMALLOC_PURGE_DELAY", "1000")

from packctl.version import __version__  # noqa: E402

from packctl.config import PackConfig, load_config  # noqa: E402
from packctl.errors import PackctlError  # noqa: E402

__all__ = ["PackConfig", "PackResult", "PackctlError", "load_config", "pack", "__version__"]


def __getattr__(name: str):
    # `pack` pulls in the whole pipeline (numba kernels, pyarrow): loaded on first use, so that
    # `packctl --help` and the options need not pay for it.
    if name in ("pack", "PackResult"):
        from packctl import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'packctl' has no attribute {name!r}")

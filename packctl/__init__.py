"""packctl: pack variable-length tokenized datasets into THD shards for LLM training, offline.

    >>> import packctl
    >>> result = packctl.pack(packctl.PackConfig(inputs=["sample_data"], output="out", capacity=4096))
    >>> result.counts["sequences_packed"]  # doctest: +SKIP
"""
from __future__ import annotations

from packctl.version import __version__

from packctl.config import PackConfig, load_config
from packctl.errors import PackctlError
from packctl.pipeline import PackResult, pack

__all__ = ["PackConfig", "PackResult", "PackctlError", "load_config", "pack", "__version__"]

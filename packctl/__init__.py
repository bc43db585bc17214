"""packctl: pack variable-length tokenized datasets into THD shards for LLM training, offline.

    >>> import packctl
    >>> result = packctl.pack(packctl.PackConfig(inputs=["sample_data"], output="out", capacity=4096))
    >>> result.counts["sequences_packed"]  # doctest: +SKIP
"""
from __future__ import annotations

__version__ = "0.1.0"

from packctl.config import PackConfig, load_config  # noqa: E402
from packctl.errors import PackctlError  # noqa: E402
from packctl.pipeline import PackResult, pack  # noqa: E402

__all__ = ["PackConfig", "PackResult", "PackctlError", "load_config", "pack", "__version__"]

"""packctl: pack variable-length tokenized datasets into THD shards for LLM training, offline.

    >>> import packctl
    >>> result = packctl.pack(packctl.PackConfig(inputs=["sample_data"], output="out", capacity=4096))
    >>> result.counts["sequences_packed"]  # doctest: +SKIP
"""
from __future__ import annotations

from packctl.version import __version__

from packctl.config import PackConfig, load_config
from packctl.errors import PackctlError, in_api_terms

__all__ = ["PackConfig", "PackResult", "PackctlError", "load_config", "pack", "plan_packs", "plan_steps", "__version__"]

# the planning API for training loops (packctl/online.py): loaded on first use, so that
# `import packctl` stays free of numba
_ONLINE = ("plan_packs", "plan_steps", "Packs", "Steps")


def pack(config: PackConfig, **options):
    """`packctl.pipeline.pack` (its docstring says what it does) for Python callers: an error
    advises keyword arguments of `PackConfig` (`overwrite=True`), not the command line's flags.

    >>> packctl.pack(packctl.PackConfig(inputs=["sample_data"], output="out"))   # doctest: +SKIP
    PackctlError: out: already exists; pass overwrite=True to replace it or choose another -o
    """
    # the pipeline (numba kernels, pyarrow) loads on first use, so that `packctl --help` and the
    # options need not pay for it
    from packctl import pipeline

    try:
        return pipeline.pack(config, **options)
    except PackctlError as exc:
        exc.args = (in_api_terms(str(exc)),)
        raise


def __getattr__(name: str):
    if name == "PackResult":
        from packctl import pipeline

        return getattr(pipeline, name)
    if name in _ONLINE:
        from packctl import online

        return getattr(online, name)
    raise AttributeError(f"module 'packctl' has no attribute {name!r}")

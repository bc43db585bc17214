"""The `packctl` command line: thin typer commands over the Python API, one module per command
(tokenize, pack, materialize, stats, verify, export, sample), all terminal rendering in render.py.

    packctl pack sample_data -o out --too-long split
"""
from __future__ import annotations

from packctl.cli import export, materialize, pack, sample, stats, tokenize, verify  # noqa: F401  (each registers its command)
from packctl.cli.app import app, main

__all__ = ["app", "main"]

if __name__ == "__main__":  # pragma: no cover
    main()

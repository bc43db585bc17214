"""Inputs that `packctl tokenize` wrote: what made their tokens (tokenizer, chat template, loss
rule), which `pack` records in its manifest so a packed output says how its labels were made.

    tok/_manifest.json  {"kind": "tokenized", "tokenizer": {...}, "tokenize": {...}, ...}
    tok/data/part-00000.parquet   <- an input file of pack: recorded as {"source": "tok", ...}
"""
from __future__ import annotations

import json
import os

from packctl.contract.manifest import TOKENIZED  # the manifest kind of `packctl tokenize`'s output


def tokenized_sources(paths: list[str]) -> list[dict]:
    """One entry per tokenized output the input `paths` come from (OUT/data/part-N.parquet), in
    path order: its directory, tokenizer and tokenization options; [] when none is."""
    found: dict[str, dict | None] = {}
    for path in paths:
        source = os.path.dirname(os.path.dirname(path)) or "."
        if source not in found:
            found[source] = _manifest_of(source)
    return [{"source": source, "tokenizer": m.get("tokenizer"), "tokenize": m.get("tokenize")}
            for source, m in found.items() if m is not None]


def is_tokenized_output(directory: str | os.PathLike) -> bool:
    """Whether `directory` is an output of `packctl tokenize` (its manifest's kind): an input,
    though it holds a _manifest.json as a packed output does."""
    return os.path.isdir(directory) and _manifest_of(os.fspath(directory)) is not None


def _manifest_of(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "_manifest.json"), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("kind") == TOKENIZED else None

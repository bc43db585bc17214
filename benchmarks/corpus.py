"""Benchmark corpora: `packctl sample` shards written one at a time (bounded memory), cached on disk."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from packctl.sample import SampleSpec, generate


def make_corpus(directory: str | Path, *, sequences: int, distribution: str = "zipf", shards: int = 8,
                row_group_rows: int = 8192, seed: int = 0) -> Path:
    """Write (or reuse) a corpus of `sequences` rows in `shards` files; returns the directory."""
    directory = Path(directory)
    stamp = {"sequences": sequences, "distribution": distribution, "shards": shards,
             "row_group_rows": row_group_rows, "seed": seed}
    marker = directory / "corpus.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.parquet"):
        old.unlink()
    per_shard = -(-sequences // shards)
    for k in range(shards):
        n = min(per_shard, sequences - k * per_shard)
        table = generate(SampleSpec(sequences=n, distribution=distribution, shards=1, seed=seed * 1000 + k))[0]
        pq.write_table(table, directory / f"shard-{k:05d}.parquet", compression="zstd", compression_level=3,
                       row_group_size=row_group_rows)
    marker.write_text(json.dumps(stamp))
    return directory


def corpus_tokens(directory: str | Path) -> int:
    total = 0
    for path in sorted(Path(directory).glob("*.parquet")):
        meta = pq.ParquetFile(path).metadata
        total += sum(meta.row_group(g).column(0).num_values for g in range(meta.num_row_groups))
    return total

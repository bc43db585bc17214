"""Parquet settings for packed shards, measured on packed Zipf token ids.

    python benchmarks/bench_storage.py PACKED_SHARD.parquet [--repeat 3]

For each candidate (compression, level, dictionary encoding of the token columns, row group
size), prints bytes per token, write time and read time of the shard (best of --repeat).
"""
from __future__ import annotations

import argparse
import io
import time

import pyarrow.parquet as pq

TOKEN_COLUMNS = ["input_ids", "labels", "position_ids"]


def candidates():
    for compression, level in (("zstd", 1), ("zstd", 3), ("zstd", 6), ("zstd", 9), ("lz4", None),
                               ("snappy", None), ("none", None)):
        yield dict(compression=compression, compression_level=level, use_dictionary=False)
    for level in (1, 3):
        yield dict(compression="zstd", compression_level=level, use_dictionary=True)
        yield dict(compression="zstd", compression_level=level, use_dictionary=["position_ids"])
    yield dict(compression="zstd", compression_level=3, use_dictionary=False, row_group_size=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shard")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    table = pq.read_table(args.shard)
    tokens = int(table.column("input_ids").combine_chunks().offsets.to_numpy()[-1])
    print(f"{args.shard}: {table.num_rows} packs, {tokens:,} tokens")
    print(f"{'compression':<10} {'level':>5} {'dictionary':<14} {'rg rows':>7} {'bytes/token':>11} "
          f"{'write MB/s':>10} {'read MB/s':>10}")
    raw = tokens * 4 * 3  # three int32 token-level columns dominate
    for opts in candidates():
        best_w = best_r = float("inf")
        for _ in range(args.repeat):
            buf = io.BytesIO()
            t0 = time.perf_counter()
            pq.write_table(table, buf, write_statistics=False, **opts)
            best_w = min(best_w, time.perf_counter() - t0)
            data = buf.getvalue()
            t0 = time.perf_counter()
            pq.read_table(io.BytesIO(data))
            best_r = min(best_r, time.perf_counter() - t0)
        dictionary = opts["use_dictionary"] if isinstance(opts["use_dictionary"], bool) else "position_ids"
        print(f"{opts['compression']:<10} {str(opts['compression_level'] or '-'):>5} {str(dictionary):<14} "
              f"{opts.get('row_group_size', table.num_rows):>7} {len(data) / tokens:>11.3f} "
              f"{raw / best_w / 1e6:>10.0f} {raw / best_r / 1e6:>10.0f}", flush=True)


if __name__ == "__main__":
    main()

"""What checking a packed output costs its readers: each reader over OUT with the checks on
(sha256, rows, tokens, layout of every shard) and off (`verify=False`), best of --repeat, the
files in the page cache (the first pass warms it).

    python benchmarks/bench_reader.py OUT [--repeat 3]

Rows: `read_shard` of every column, with its parts (reading the bytes, hashing them, parsing them
alone); PackedDataset, every pack in order; `packctl stats OUT` (packed_stats). Wall and CPU
seconds (all threads). A cold cache adds the same disk time to both sides.
"""
from __future__ import annotations

import argparse
import hashlib
import time

import pyarrow as pa
import pyarrow.parquet as pq

from packctl.contract.reader import open_output, read_shard_file


def best(fn, repeat: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of the process) of the fastest of `repeat` runs:
    on a shared machine the CPU seconds say what the work costs when the wall clock cannot."""
    runs = []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0, time.process_time() - c0))
    return min(runs)


def parts_of_a_check(blobs: list[bytes], repeat: int) -> list[tuple[str, tuple[float, float], None]]:
    """The sha256 of every shard's bytes, and their parse alone."""
    return [("  sha256 of the bytes", best(lambda: [hashlib.sha256(b).hexdigest() for b in blobs], repeat), None),
            ("  parse the bytes", best(lambda: [pq.read_table(pa.BufferReader(b)) for b in blobs], repeat), None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    checked, unchecked = open_output(args.out), open_output(args.out, verify=False)
    shards = range(len(checked.shards))
    size = sum(checked.shard_path(k).stat().st_size for k in shards)
    tokens = sum(s.tokens for s in checked.shards)
    print(f"{args.out}: {len(checked.shards)} shards, {checked.num_packs:,} packs, {tokens:,} tokens, "
          f"{size / 1e9:.2f} GB")
    for k in shards:  # warm the page cache
        read_shard_file(checked.shard_path(k))

    rows: list[tuple[str, tuple[float, float], tuple[float, float] | None]] = []
    paths = [checked.shard_path(k) for k in shards]
    rows.append(("  read the bytes", best(lambda: [read_shard_file(p) for p in paths], args.repeat), None))
    rows += parts_of_a_check([read_shard_file(p) for p in paths], args.repeat)
    rows.append(("read_shard, every column",
                 best(lambda: [checked.read_shard(k) for k in shards], args.repeat),
                 best(lambda: [unchecked.read_shard(k) for k in shards], args.repeat)))

    from packctl.stats.packed import packed_stats

    rows.append(("packctl stats OUT", best(lambda: packed_stats(args.out), args.repeat),
                 best(lambda: packed_stats(args.out, verify=False), args.repeat)))
    try:
        from packctl.torch import PackedDataset
    except ImportError:
        PackedDataset = None
    if PackedDataset is not None:
        def every_pack(verify: bool) -> None:
            dataset = PackedDataset(args.out, cache_row_groups=1, verify=verify)
            for i in range(len(dataset)):
                dataset[i]

        rows.append(("PackedDataset, every pack", best(lambda: every_pack(True), args.repeat),
                     best(lambda: every_pack(False), args.repeat)))

    print(f"{'':<28} {'checked':>16} {'unchecked':>16} {'cost (wall, CPU)':>18}")
    print(f"{'':<28} {'wall':>7} {'CPU':>8} {'wall':>7} {'CPU':>8}")
    for name, on, off in rows:
        cost = f"{(on[0] / off[0] - 1) * 100:+7.1f}% {(on[1] / off[1] - 1) * 100:+7.1f}%" if off else ""
        other = f"{off[0]:6.2f}s {off[1]:7.2f}s" if off else ""
        print(f"{name:<28} {on[0]:6.2f}s {on[1]:7.2f}s {other:>16} {cost:>18}")

if __name__ == "__main__":
    main()

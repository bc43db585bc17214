"""What a shuffled DataLoader costs: PackedDataset items per second in random order against in
order, over an output made by `packctl sample` and `packctl pack` (cached under --dir).

    python benchmarks/bench_loader.py [--sequences 200000] [--items 1000] [--cache-row-groups 16]

200,000 lognormal sequences pack at capacity 4096 into ~29,000 packs (~300 MB of shards); the
default machine-friendly run is smaller (--sequences 40000). It prints:

    in order        every pack, 0, 1, 2 ...: a row group decoded once for its 128 packs
    random          --items packs in a random permutation (DataLoader(shuffle=True)): about one
                    row group decoded per item, unless it is among the --cache-row-groups kept
    ratio           random / in order (items/s)
    row-group shuffle  every pack in the order of packctl.torch.RowGroupShuffle (row groups
                    shuffled, packs shuffled within windows of --cache-row-groups row groups)

and what an item costs in parts: the first read of a shard in a process (the whole shard read and
its sha256 checked against the manifest, once), a row group read after it (its bytes read, their
sha256 compared with the one kept, decoded), and a whole shard decoded (what every random item
cost when the loader read shards). Each dataset is fresh: its shard checks are in its figures.
Each order runs twice, interleaved, and the faster run counts.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packctl.contract.reader import open_output  # noqa: E402
from packctl.torch import PackedDataset, RowGroupShuffle  # noqa: E402


def packed_output(root: Path, sequences: int) -> Path:
    """A packed output of `sequences` lognormal sequences, made once by the CLI."""
    corpus, out = root / f"corpus-{sequences}", root / f"packed-{sequences}"
    packctl = [sys.executable, "-m", "packctl"]
    if not any(corpus.glob("*.parquet")):
        subprocess.run([*packctl, "sample", "-o", str(corpus), "--sequences", str(sequences),
                        "--distribution", "lognormal", "--overwrite"], check=True)
    if not (out / "_manifest.json").exists():
        subprocess.run([*packctl, "pack", str(corpus), "-o", str(out), "--too-long", "split", "--overwrite"],
                       check=True)
    return out


def items_per_second(out: Path, rows: np.ndarray, cache_row_groups: int) -> float:
    dataset = PackedDataset(out, cache_row_groups=cache_row_groups)
    start = time.perf_counter()
    for row in rows:
        dataset[int(row)]
    return len(rows) / (time.perf_counter() - start)


def seconds(fn, repeat: int = 3) -> float:
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=40_000)
    ap.add_argument("--items", type=int, default=1_000, help="packs read in random order")
    ap.add_argument("--cache-row-groups", type=int, default=16)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/packctl-bench/loader"))
    args = ap.parse_args()
    out = packed_output(args.dir, args.sequences)
    output = open_output(out)
    size = sum(output.shard_path(k).stat().st_size for k in range(len(output.shards)))
    groups = sum(len(output.row_group_index(k).rows) for k in range(len(output.shards)))
    print(f"{out}: {len(output.shards)} shards, {groups} row groups, {output.num_packs:,} packs, "
          f"{size / 1e6:,.0f} MB; {args.cache_row_groups} row groups cached")
    for k in range(len(output.shards)):  # the page cache warm for both orders
        output.read_shard(k)

    # best of two, the orders interleaved: on a shared machine one pass can be slowed by others
    rows = np.random.default_rng(0).permutation(output.num_packs)[:args.items]
    blocks = np.array(list(RowGroupShuffle(PackedDataset(out), seed=0, window=args.cache_row_groups)))
    runs = {"in order": [], "random": [], "row-group shuffle": []}
    for _ in range(2):
        for name, order in (("in order", np.arange(output.num_packs)), ("random", rows),
                            ("row-group shuffle", blocks)):
            runs[name].append(items_per_second(out, order, args.cache_row_groups))
    in_order, shuffled, block_shuffled = (max(runs[name]) for name in runs)
    print(f"in order           {in_order:10,.0f} items/s   ({output.num_packs:,} items)")
    print(f"random             {shuffled:10,.0f} items/s   ({len(rows):,} items)   ratio "
          f"{shuffled / in_order:.3f} (random / in order)")
    print(f"row-group shuffle  {block_shuffled:10,.0f} items/s   ({len(blocks):,} items)   ratio "
          f"{block_shuffled / in_order:.3f}")

    columns = PackedDataset(out)._columns
    first = seconds(lambda: open_output(out).row_group_index(0))
    warm = open_output(out)
    warm.row_group_index(0)
    group = seconds(lambda: warm.read_row_group(0, 0, columns))
    shard = seconds(lambda: warm.read_shard(0, columns))
    print(f"first read of a shard in a process (whole-shard check)  {first * 1e3:8.1f} ms  "
          f"(x {len(output.shards)} shards = {first * len(output.shards):.2f} s per process)")
    print(f"a row group read, checked and decoded                   {group * 1e3:8.1f} ms")
    print(f"a whole shard read, checked and decoded                 {shard * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

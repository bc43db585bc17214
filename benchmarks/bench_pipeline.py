"""End-to-end `packctl pack` against the I/O floor, measured in the same run.

    python benchmarks/bench_pipeline.py [--sequences 1300000] [--dir /tmp/packctl-bench] [--repeat 3]

The I/O floor is what no packer can beat: reading the same input with pyarrow (both token
columns, threads on) plus writing the same output tables with the same Parquet settings (as many
writer threads as packctl uses), in a process with the same Arrow allocator setting as packctl's. Prints each figure (median of --repeat), the ratio, and
packctl's time per stage.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import packctl  # noqa: F401  (before pyarrow: the floor runs with the allocator setting packctl uses)
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import corpus_tokens, make_corpus  # noqa: E402

from packctl.output.encode import PARQUET_OPTIONS  # noqa: E402


def read_floor(inputs: list[Path]) -> float:
    t0 = time.perf_counter()
    for path in inputs:
        pq.read_table(path, columns=["input_ids", "labels"])
    return time.perf_counter() - t0


def write_floor(tables: list, target: Path, workers: int) -> float:
    target.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda kt: pq.write_table(kt[1], target / f"{kt[0]}.parquet", **PARQUET_OPTIONS),
                      enumerate(tables)))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(target)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=1_300_000, help="~500M tokens with zipf lengths")
    ap.add_argument("--distribution", default="zipf")
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("pack_args", nargs="*", default=["--too-long", "split", "--order", "shuffle"],
                    help="options passed to packctl pack (after --)")
    args = ap.parse_args()
    root = Path(args.dir)
    corpus = make_corpus(root / f"corpus-{args.distribution}-{args.sequences}", sequences=args.sequences,
                         distribution=args.distribution)
    inputs = sorted(corpus.glob("*.parquet"))
    in_bytes = sum(p.stat().st_size for p in inputs)
    print(f"corpus: {args.sequences:,} sequences, {corpus_tokens(corpus):,} tokens, {in_bytes / 2**20:,.0f} MiB "
          f"in {len(inputs)} files")
    out = root / "out"
    workers = max(1, min(2, os.cpu_count() or 1))
    packs, floors, reads, writes, stages = [], [], [], [], []
    for _ in range(args.repeat):
        cmd = [sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out), "--overwrite", "--json", *args.pack_args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        packs.append(time.perf_counter() - t0)
        stages.append(json.loads(proc.stdout)["metrics"]["timings"])
        manifest = json.loads((out / "_manifest.json").read_text())
        tables = [pq.read_table(out / s["path"]) for s in manifest["shards"]]
        r = read_floor(inputs)
        w = write_floor(tables, root / "floor-write", workers)
        del tables
        reads.append(r)
        writes.append(w)
        floors.append(r + w)
    out_bytes = sum(p.stat().st_size for p in out.rglob("*.parquet"))
    med = statistics.median
    print(f"output: {out_bytes / 2**20:,.0f} MiB in {len(manifest['shards'])} shards; options {' '.join(args.pack_args)}")
    print(f"{'figure':<28}{'median s':>10}{'min s':>10}{'max s':>10}")
    for name, values in (("packctl pack (whole command)", packs), ("I/O floor: read", reads),
                         (f"I/O floor: write ({workers} threads)", writes), ("I/O floor: total", floors)):
        print(f"{name:<28}{med(values):>10.2f}{min(values):>10.2f}{max(values):>10.2f}")
    ratios = [p / f for p, f in zip(packs, floors)]
    print(f"ratio pack / floor: median {med(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"each run: {' '.join(f'{r:.2f}' for r in ratios)}")
    print("packctl stages (median s): " + "  ".join(
        f"{k} {med([s[k] for s in stages]):.2f}" for k in stages[0]))


if __name__ == "__main__":
    main()

"""`packctl pack` of one corpus as Megatron `.bin/.idx` pairs and as Parquet: scan and whole run.

    python benchmarks/bench_megatron_input.py [--sequences 2000000] [--repeat 2] [--dir /tmp/packctl-megatron]

The corpus is benchmarks/corpus.py's zipf corpus (8 shards, zstd, row groups of 8,192 rows), its
`input_ids` alone (no labels, as a Megatron dataset has none); each shard is also written as a
uint16 pair (the dtype megatron-core picks for a vocabulary under 65,500), one document of one
sequence per row. Each input is packed `--repeat` times, in turn, by a `packctl pack` process of
its own (--capacity 8192 --too-long split); reported: the medians of `timings.scan` from
`_metrics.json`, of the process's wall time, and the input bytes. Both outputs' data columns are
the same (tests/integration/test_megatron_input.py); the benchmark checks their shard count.
"""
from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import make_corpus  # noqa: E402


def write_inputs(root: Path, sequences: int) -> tuple[Path, Path]:
    full = make_corpus(root / "full", sequences=sequences)
    parquet, pairs = root / "parquet", root / "megatron"
    parquet.mkdir(exist_ok=True)
    pairs.mkdir(exist_ok=True)
    for path in sorted(full.glob("*.parquet")):
        if (pairs / f"{path.stem}.idx").exists():
            continue
        table = pq.read_table(path, columns=["input_ids"])
        pq.write_table(table, parquet / path.name, compression="zstd", compression_level=3, row_group_size=8192)
        column = table.column("input_ids").combine_chunks()
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.values.to_numpy()[offsets[0]:offsets[-1]].astype(np.uint16)
        lengths = np.diff(offsets).astype(np.int32)
        pointers = (offsets[:-1] - offsets[0]) * 2
        (pairs / f"{path.stem}.bin").write_bytes(values.tobytes())
        header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(lengths) + 1)
        (pairs / f"{path.stem}.idx").write_bytes(header + lengths.tobytes() + pointers.tobytes()
                                                 + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return parquet, pairs


def pack_once(source: Path, out: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "packctl", "pack", str(source), "-o", str(out), "--capacity", "8192",
                    "--too-long", "split", "--overwrite", "-q"], check=True)
    wall = time.perf_counter() - t0
    return wall, json.loads((out / "_metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/packctl-megatron")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    inputs = dict(zip(("parquet", "megatron"), write_inputs(root, args.sequences)))
    runs: dict[str, list[tuple[float, dict]]] = {k: [] for k in inputs}
    pack_once(inputs["parquet"], root / "warm-up")  # compiled kernels cached before timing
    for _ in range(args.repeat):
        for kind, source in inputs.items():
            runs[kind].append(pack_once(source, root / f"out-{kind}"))
    print(f"{args.sequences:,} sequences, "
          f"{runs['parquet'][0][1]['counts']['tokens_in']:,} tokens, medians of {args.repeat}")
    print(f"{'input':10} {'bytes':>14} {'scan s':>8} {'whole run s':>12} {'shards':>7}")
    for kind, source in inputs.items():
        size = sum(p.stat().st_size for p in source.iterdir())
        scan = statistics.median(m["timings"]["scan"] for _, m in runs[kind])
        wall = statistics.median(w for w, _ in runs[kind])
        shards = runs[kind][0][1]["counts"].get("shards", "")
        print(f"{kind:10} {size:>14,} {scan:>8.2f} {wall:>12.2f} {shards!s:>7}")


if __name__ == "__main__":
    main()

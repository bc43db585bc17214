"""A corpus of tens of millions of documents as Megatron .bin/.idx and as Parquet, packed under MPI.

    python benchmarks/bench_megatron_scale.py --dir /data/scale [--documents 20000000] [--ranks 8]

1. Writes (or reuses) the same synthetic documents twice: N/8 documents per file, 8 Megatron
   indexed-dataset pairs (`shard-K.bin`/`.idx`, uint16 tokens, one sequence per document) and 8
   Parquet files (`input_ids` list<int32>, zstd, 65,536-row row groups), so a document has the
   same global sample id in both.
   Lengths: lognormal (median 33 tokens, mean about 55, a tail to 16k), tokens uniform below 50,000.
2. Under `mpiexec -n R`, for each input kind: `pack --plan-only`, `pack` (materialized), and for
   .bin/.idx `materialize PLAN`; prints wall time, each stage's time (the slowest rank), each rank's
   peak RSS (max and mean), output bytes, and whether the outputs hold the same data (every shard's
   data columns compared) whichever the input kind and whichever the path (pack or plan + materialize).

Ranks beyond the machine's cores share them: on a 2-core machine, 8 ranks show that the plan and
its bytes do not depend on the rank count and what each rank holds, not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FILES = 8
VOCAB = 50_000
IDX_MAGIC = b"MMIDIDX\x00\x00"
UINT16_CODE = 8  # Megatron's dtype code of numpy.uint16
MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
PACKCTL = [sys.executable, "-m", "packctl"]


def document_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(np.ceil(rng.lognormal(3.5, 1.0, n)), 2, 16_384).astype(np.int64)


def write_idx(path: Path, lengths: np.ndarray, itemsize: int) -> None:
    """Megatron's .idx layout: header, then sequence lengths (int32), byte pointers (int64) and
    document indices (int64, one sequence per document)."""
    count = len(lengths)
    pointers = np.zeros(count, dtype=np.int64)
    np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(IDX_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", UINT16_CODE))
        f.write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(count + 1, dtype=np.int64).tobytes())


def make_corpus(directory: Path, documents: int, seed: int = 0) -> tuple[Path, Path]:
    """The corpus in directory/megatron and directory/parquet (reused when already written)."""
    stamp = {"documents": documents, "seed": seed, "files": FILES}
    marker = directory / "corpus.json"
    megatron, parquet = directory / "megatron", directory / "parquet"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return megatron, parquet
    for d in (megatron, parquet):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    per_file = -(-documents // FILES)
    for k in range(FILES):
        rng = np.random.default_rng([seed, k])
        n = min(per_file, documents - k * per_file)
        lengths = document_lengths(rng, n)
        tokens = rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.uint16)
        tokens.tofile(megatron / f"shard-{k:05d}.bin")
        write_idx(megatron / f"shard-{k:05d}.idx", lengths, 2)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        with pq.ParquetWriter(parquet / f"shard-{k:05d}.parquet", pa.schema([("input_ids", pa.list_(pa.int32()))]),
                              compression="zstd", compression_level=1) as writer:
            for lo in range(0, n, 65_536):
                hi = min(lo + 65_536, n)
                values = pa.array(tokens[offsets[lo]:offsets[hi]].astype(np.int32))
                column = pa.ListArray.from_arrays(pa.array((offsets[lo:hi + 1] - offsets[lo]).astype(np.int32)), values)
                writer.write_table(pa.table({"input_ids": column}))
    marker.write_text(json.dumps(stamp))
    return megatron, parquet


def launch(ranks: int, args: list[str]) -> float:
    cmd = ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else []) + PACKCTL + args
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def size_of(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def same_data(a: Path, b: Path) -> bool:
    """Whether two outputs hold the same shards' columns, shard by shard (the file metadata names
    the input paths, so whole files differ between input kinds)."""
    shards = [json.loads((out / "_manifest.json").read_text())["shards"] for out in (a, b)]
    if [s["path"] for s in shards[0]] != [s["path"] for s in shards[1]]:
        return False
    return all(pq.read_table(a / s["path"]).replace_schema_metadata(None).equals(
        pq.read_table(b / s["path"]).replace_schema_metadata(None)) for s in shards[0])


def report(label: str, out: Path, wall: float) -> dict:
    metrics = json.loads((out / "_metrics.json").read_text())
    ranks = metrics.get("ranks") or []
    rss = [r.get("peak_rss_bytes", 0) for r in ranks] if isinstance(ranks, list) else []
    stages = {k: v for k, v in metrics.get("timings", {}).items() if k != "compile"}
    row = {"run": label, "wall_s": round(wall, 1), "bytes": size_of(out),
           "stages_s": {k: round(v, 1) for k, v in stages.items()},
           "peak_rss_mib_max": round(max(rss) / 2**20) if rss else None,
           "peak_rss_mib_mean": round(sum(rss) / len(rss) / 2**20) if rss else None}
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--documents", type=int, default=20_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--compare", action="store_true", help="compare the data columns of every output (slow)")
    args = parser.parse_args()
    started = time.perf_counter()
    megatron, parquet = make_corpus(args.dir, args.documents)
    print(f"corpus: {args.documents:,} documents, written or reused in {time.perf_counter() - started:.0f} s; "
          f".bin/.idx {size_of(megatron) / 2**30:.2f} GiB, Parquet {size_of(parquet) / 2**30:.2f} GiB")
    common = ["--capacity", str(args.capacity), "--too-long", "split", "--order", "shuffle", "--overwrite"]
    rows, outs = [], {}
    for kind, source in (("megatron", megatron), ("parquet", parquet)):
        for mode, extra in (("plan", ["--plan-only"]), ("packed", [])):
            out = args.dir / f"out-{kind}-{mode}"
            wall = launch(args.ranks, ["pack", str(source), "-o", str(out), *common, *extra])
            rows.append(report(f"{kind} {mode}", out, wall))
            outs[kind, mode] = out
        out = args.dir / f"out-{kind}-materialized"
        wall = launch(args.ranks, ["materialize", str(outs[kind, "plan"]), "-o", str(out), "--overwrite"])
        rows.append(report(f"{kind} plan -> materialize", out, wall))
        outs[kind, "materialized"] = out
    plan, packed = rows[0]["bytes"], rows[1]["bytes"]
    print(f"plan / materialized bytes: {plan / packed:.4f}")
    if args.compare:
        reference = outs["megatron", "packed"]
        for key, out in outs.items():
            if key[1] != "plan" and out != reference:
                print(f"{key[0]} {key[1]}: same data columns as megatron packed: {same_data(out, reference)}")

if __name__ == "__main__":
    main()

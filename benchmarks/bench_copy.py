"""`packctl pack` against a plain copy of the same input, and packctl's packs against its peers'.

    python benchmarks/bench_copy.py [--corpora code prose chat zipf] [--repeat 3] [--dir /tmp/packctl-bench]

Per corpus (benchmarks/realtext.py builds code, prose and chat from real text; zipf is the
synthetic corpus of benchmarks/corpus.py):

- time: the whole `packctl pack` process against a plain copy, a separate Python process that
  reads each input file with pyarrow and writes it again with zstd (benchmarks/copy_parquet.py),
  into a fresh directory. The two run in turn, pack then copy, --repeat times after one warm-up
  of each; medians, and the median of the ratios pair by pair, of wall time and of CPU time
  (user + system, which moves less when other work shares the machine). Beside them, the same plain copy of
  packctl's own output (its shards hold more columns than the input: labels, position ids,
  cu_seqlens ...), which tells what writing those columns costs by itself.
- packs: packctl at its default --window, packctl with one window over the whole corpus, TRL's
  `pack_dataset` (called as SFTTrainer calls it: `datasets.map` batches of 1,000 rows, each
  packed on its own by best-fit decreasing; strategy "bfd_split" where packctl splits, "bfd"
  where it truncates), best-fit decreasing over the whole corpus (an independent plain-Python
  implementation, the bound a one-pass packer aims at) and ceil(tokens / capacity).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import make_corpus  # noqa: E402

# corpus -> (capacity, --too-long)
SETTINGS = {"code": (8192, "split"), "prose": (8192, "split"), "chat": (4096, "truncate"), "zipf": (4096, "split")}
TRL_BATCH = 1000


def corpus_dir(name: str, root: Path, zipf_sequences: int) -> Path:
    if name == "zipf":
        return make_corpus(root / f"corpus-zipf-{zipf_sequences}", sequences=zipf_sequences, distribution="zipf")
    from realtext import build
    return build(name, root)


def lengths_of(directory: Path) -> np.ndarray:
    parts = [pc.list_value_length(pq.read_table(p, columns=["input_ids"])["input_ids"]).to_numpy()
             for p in sorted(directory.glob("*.parquet"))]
    return np.concatenate(parts).astype(np.int64)


def items_of(lengths: np.ndarray, capacity: int, too_long: str) -> np.ndarray:
    """What gets packed: split -> full pieces of `capacity` plus the rest; truncate -> at most `capacity`."""
    if too_long == "truncate":
        return np.minimum(lengths, capacity)
    full = lengths // capacity
    rest = lengths % capacity
    return np.concatenate([np.full(int(full.sum()), capacity, np.int64), rest[rest > 0]])


def bfd_bins(items: np.ndarray, capacity: int) -> int:
    """Best-fit decreasing over all items at once: each item into the fullest bin it fits."""
    from sortedcontainers import SortedList

    free = SortedList()  # (free space, bin id) of bins not full
    bins = 0
    for item in np.sort(items)[::-1].tolist():
        k = free.bisect_left((item, -1))
        if k == len(free):
            space, b = capacity, bins
            bins += 1
        else:
            space, b = free.pop(k)
        if space - item > 0:
            free.add((space - item, b))
    return bins


def trl_packs(directory: Path, capacity: int, too_long: str) -> tuple[int, float]:
    import datasets
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    table = pa.concat_tables(pq.read_table(p, columns=["input_ids"]) for p in sorted(directory.glob("*.parquet")))
    dataset = datasets.Dataset(table)
    t0 = time.perf_counter()
    packed = pack_dataset(dataset, capacity, strategy="bfd_split" if too_long == "split" else "bfd",
                          map_kwargs={"batch_size": TRL_BATCH})
    return len(packed), time.perf_counter() - t0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pack(directory: Path, out: Path, args: list[str]) -> tuple[float, float, dict]:
    """(wall s, CPU s user + system, packctl's --json) of one whole `packctl pack` process."""
    cmd = [sys.executable, "-m", "packctl", "pack", str(directory), "-o", str(out), "--overwrite", "--json", *args]
    cpu, t0 = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return elapsed, children_cpu() - cpu, json.loads(proc.stdout)


def run_copy(directory: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one plain copy process."""
    cpu, t0 = children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, str(HERE / "copy_parquet.py"), str(directory), str(out)], check=True)
    return time.perf_counter() - t0, children_cpu() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--zipf-sequences", type=int, default=250_000, help="~70M tokens, like the code corpus")
    ap.add_argument("--no-peers", action="store_true", help="time only, skip the packs comparison")
    args = ap.parse_args()
    root = Path(args.dir)
    med = statistics.median
    rows = []
    for name in args.corpora:
        capacity, too_long = SETTINGS[name]
        directory = corpus_dir(name, root, args.zipf_sequences)
        lengths = lengths_of(directory)
        in_bytes = sum(p.stat().st_size for p in directory.glob("*.parquet"))
        pack_args = ["--capacity", str(capacity), "--too-long", too_long]
        print(f"\n{name}: {len(lengths):,} documents, {int(lengths.sum()):,} tokens, longest {int(lengths.max()):,}, "
              f"median {int(np.median(lengths)):,}; {in_bytes / 2**20:,.0f} MiB; packctl pack {' '.join(pack_args)}",
              flush=True)
        out_pack, out_copy = root / f"out-pack-{name}", root / f"out-copy-{name}"
        run_pack(directory, out_pack, pack_args)  # warm-up (numba cache, page cache)
        run_copy(directory, out_copy)
        packs_s, copies_s, out_copies_s, stages, result = [], [], [], [], None
        packs_cpu, copies_cpu = [], []
        for _ in range(args.repeat):
            t, cpu, result = run_pack(directory, out_pack, pack_args)
            packs_s.append(t)
            packs_cpu.append(cpu)
            stages.append(result["metrics"]["timings"])
            t, cpu = run_copy(directory, out_copy)
            copies_s.append(t)
            copies_cpu.append(cpu)
            out_copies_s.append(run_copy(out_pack / "data", root / f"out-copy-packed-{name}")[0])
        shutil.rmtree(root / f"out-copy-packed-{name}", ignore_errors=True)
        ratios = [p / c for p, c in zip(packs_s, copies_s)]
        out_bytes = sum(p.stat().st_size for p in out_pack.rglob("*.parquet"))
        copy_bytes = sum(p.stat().st_size for p in out_copy.glob("*.parquet"))
        print(f"  pack  s: median {med(packs_s):.2f} (min {min(packs_s):.2f}, max {max(packs_s):.2f}); "
              f"{out_bytes / 2**20:,.0f} MiB written")
        print(f"  copy  s: median {med(copies_s):.2f} (min {min(copies_s):.2f}, max {max(copies_s):.2f}); "
              f"{copy_bytes / 2**20:,.0f} MiB written")
        print(f"  ratio pack/copy: median {med(ratios):.2f}; each pair: {' '.join(f'{r:.2f}' for r in ratios)}")
        cpu_ratios = [p / c for p, c in zip(packs_cpu, copies_cpu)]
        print(f"  CPU s (user + system): pack {med(packs_cpu):.2f}, copy {med(copies_cpu):.2f}; ratio median "
              f"{med(cpu_ratios):.2f}; each pair: {' '.join(f'{r:.2f}' for r in cpu_ratios)}")
        print(f"  copy of packctl's output s: median {med(out_copies_s):.2f} (min {min(out_copies_s):.2f}, "
              f"max {max(out_copies_s):.2f}); pack / that: {med([p / c for p, c in zip(packs_s, out_copies_s)]):.2f}")
        print("  packctl stages (median s): " + "  ".join(f"{k} {med([s[k] for s in stages]):.2f}" for k in stages[0]))
        row = {"corpus": name, "documents": len(lengths), "tokens": int(lengths.sum()), "longest": int(lengths.max()),
               "pack_s": med(packs_s), "copy_s": med(copies_s), "ratio": med(ratios), "cpu_ratio": med(cpu_ratios),
               "copy_out_s": med(out_copies_s), "ratio_out": med([p / c for p, c in zip(packs_s, out_copies_s)]),
               "packs_packctl": result["counts"]["packs"]}
        if not args.no_peers:
            _, _, whole = run_pack(directory, out_pack, [*pack_args, "--window", str(len(lengths))])
            items = items_of(lengths, capacity, too_long)
            row["packs_packctl_whole"] = whole["counts"]["packs"]
            row["packs_trl"], trl_s = trl_packs(directory, capacity, too_long)
            row["packs_bfd_whole"] = bfd_bins(items, capacity)
            row["packs_ceil"] = math.ceil(int(items.sum()) / capacity)
            print(f"  packs: packctl (--window 100000) {row['packs_packctl']:,}; packctl (one window) "
                  f"{row['packs_packctl_whole']:,}; TRL pack_dataset (batches of {TRL_BATCH}) {row['packs_trl']:,} "
                  f"in {trl_s:.1f} s; BFD over the whole corpus {row['packs_bfd_whole']:,}; "
                  f"ceil(tokens/C) {row['packs_ceil']:,}")
        shutil.rmtree(out_pack, ignore_errors=True)
        shutil.rmtree(out_copy, ignore_errors=True)
        rows.append(row)
    print(f"\nmedians of {args.repeat} runs in one session")
    print("| corpus | tokens | documents | longest | pack s | copy s | pack/copy | pack/copy CPU | copy of output s "
          "| pack/that | packs packctl / one window / TRL / BFD whole / ceil |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peers = (f"{r['packs_packctl']:,} / {r['packs_packctl_whole']:,} / {r['packs_trl']:,} / {r['packs_bfd_whole']:,}"
                 f" / {r['packs_ceil']:,}" if "packs_trl" in r else f"{r['packs_packctl']:,}")
        print(f"| {r['corpus']} | {r['tokens']:,} | {r['documents']:,} | {r['longest']:,} | {r['pack_s']:.2f} | "
              f"{r['copy_s']:.2f} | {r['ratio']:.2f} | {r['cpu_ratio']:.2f} | {r['copy_out_s']:.2f} | "
              f"{r['ratio_out']:.2f} | {peers} |")


if __name__ == "__main__":
    main()

"""Distributed packing: sort throughput and stage times for 1, 2 and 4 ranks.

    python benchmarks/bench_mpi.py [--keys 8000000] [--sequences 200000] [--ranks 1 2 4]

1. The sample sort alone: (key, gid, payload) int64 triples, keys/s per rank count.
2. `packctl pack` of a generated corpus under `mpiexec -n R` for each order: wall time, rank 0's
   stage times, bytes exchanged between ranks, and whether every output file is identical to the
   single-process run (manifest compared without timings).
Ranks beyond the machine's cores share them: on a 2-core machine 4 ranks show the overhead of
the exchange, not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import corpus_tokens, make_corpus  # noqa: E402

MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def launch(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [MPIEXEC, "-n", str(ranks), *args] if ranks > 1 else args
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)


def fingerprint(out: Path):
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest.pop("timings")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=8_000_000)
    ap.add_argument("--sequences", type=int, default=200_000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--orders", nargs="+", default=["input", "shuffle", "curriculum"])
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    args = ap.parse_args()
    if MPIEXEC is None:
        sys.exit("no mpiexec: pip install 'packctl[mpi]'")

    print(f"1. sample sort of {args.keys:,} (key, gid, payload) triples")
    print(f"{'ranks':>5} {'seconds':>8} {'M keys/s':>9} {'max/mean per rank':>18}")
    for ranks in args.ranks:
        res = json.loads(launch(ranks, [sys.executable, str(HERE / "mpi_sort_worker.py"), str(args.keys)]).stdout)
        print(f"{ranks:>5} {res['seconds']:>8.2f} {args.keys / res['seconds'] / 1e6:>9.2f} {res['imbalance']:>18.3f}")

    root = Path(args.dir)
    corpus = make_corpus(root / f"mpi-lognormal-{args.sequences}", sequences=args.sequences,
                         distribution="lognormal", shards=8, row_group_rows=8192)
    print(f"\n2. packctl pack of {args.sequences:,} sequences ({corpus_tokens(corpus):,} tokens, 8 files), "
          "--too-long split --window 20000")
    print(f"{'order':<11} {'ranks':>5} {'wall s':>7} {'scan':>6} {'order':>6} {'plan':>6} {'mater.':>7} "
          f"{'MiB exchanged':>14} {'identical':>9}")
    out = root / "mpi-out"
    for order in args.orders:
        reference = None
        for ranks in args.ranks:
            t0 = time.perf_counter()
            launch(ranks, [sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out), "--overwrite", "-q",
                           "--too-long", "split", "--window", "20000", "--order", order])
            wall = time.perf_counter() - t0
            metrics = json.loads((out / "_metrics.json").read_text())
            t = metrics["timings"]
            sent = sum(r["bytes_sent"] for r in metrics.get("ranks", []))
            current = fingerprint(out)
            reference = reference or current
            print(f"{order:<11} {ranks:>5} {wall:>7.2f} {t['scan']:>6.2f} {t['order']:>6.2f} {t['plan']:>6.2f} "
                  f"{t['materialize']:>7.2f} {sent / 2**20:>14.1f} {str(current == reference):>9}", flush=True)


if __name__ == "__main__":
    main()

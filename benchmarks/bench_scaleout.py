"""Scale-out: how evenly `mpiexec -n N packctl pack` shares the work, per order and rank count.

    python benchmarks/bench_scaleout.py [--sequences 250000] [--ranks 2 4 8] [--window 100000] [--options '--token-transfer read']

For each order (input, shuffle, curriculum) and rank count it runs `packctl pack` on a generated
lognormal corpus and prints, from _metrics.json's `ranks`:

- tokens written per rank, max/mean (1.00 = every rank writes the same share),
- seconds per stage per rank, max/mean over ranks (scan, order, plan, materialize),
- bytes exchanged between ranks (MiB, all ranks),
- whether the output files are identical to the single-process run.

Ranks beyond the machine's cores share them (a 2-core machine runs 8 ranks oversubscribed): wall
times then show contention, the balance figures do not depend on it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import corpus_tokens, make_corpus  # noqa: E402

MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
STAGES = ("scan", "order", "plan", "materialize")


def launch(ranks: int, args: list[str]) -> None:
    cmd = [MPIEXEC, "-n", str(ranks), *args] if ranks > 1 else args
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)


def digest(out: Path) -> str:
    """Every output file's bytes (the manifest without its timings)."""
    h = hashlib.sha256()
    for path in sorted(out.rglob("*.parquet")):
        h.update(path.relative_to(out).as_posix().encode())
        h.update(path.read_bytes())
    manifest = json.loads(next(out.glob("*manifest.json")).read_text())
    manifest.pop("timings", None)
    h.update(json.dumps(manifest, sort_keys=True).encode())
    return h.hexdigest()


def ratio(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=250_000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--orders", nargs="+", default=["input", "shuffle", "curriculum"])
    ap.add_argument("--window", type=int, default=100_000)
    ap.add_argument("--options", default="", help="more `packctl pack` options, e.g. '--token-transfer read'")
    ap.add_argument("--per-rank", action="store_true", help="also print every rank's stage seconds")
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    args = ap.parse_args()
    args.extra = shlex.split(args.options)
    if MPIEXEC is None:
        sys.exit("no mpiexec: pip install 'packctl[mpi]'")

    root = Path(args.dir)
    corpus = make_corpus(root / f"scaleout-lognormal-{args.sequences}", sequences=args.sequences,
                         distribution="lognormal", shards=8, row_group_rows=8192)
    print(f"packctl pack of {args.sequences:,} sequences ({corpus_tokens(corpus):,} tokens, 8 files), "
          f"--too-long split --window {args.window} {' '.join(args.extra)}")
    head = " ".join(f"{s[:6]:>6}" for s in STAGES)
    print(f"{'order':<11} {'ranks':>5} {'wall s':>7} {'tokens max/mean':>15}   seconds max/mean: {head} "
          f"{'MiB exch.':>9} {'identical':>9}")
    out = root / "scaleout-out"
    for leftover in root.glob(".scaleout-out.packctl-*"):  # of a benchmark run that was stopped
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    for order in args.orders:
        launch(1, [sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out), "--overwrite", "-q",
                   "--too-long", "split", "--window", str(args.window), "--order", order, *args.extra])
        reference = digest(out)
        for ranks in args.ranks:
            t0 = time.perf_counter()
            launch(ranks, [sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out), "--overwrite",
                           "-q", "--too-long", "split", "--window", str(args.window), "--order", order, *args.extra])
            wall = time.perf_counter() - t0
            per_rank = json.loads((out / "_metrics.json").read_text())["ranks"]
            tokens = ratio([r["tokens_written"] for r in per_rank])
            stages = " ".join(f"{ratio([r['timings'][s] for r in per_rank]):>6.2f}" for s in STAGES)
            exchanged = sum(r["bytes_sent"] for r in per_rank) / 2**20
            detail = " / ".join(f"{r['tokens_written'] / 1e6:.1f}M" for r in per_rank)
            print(f"{order:<11} {ranks:>5} {wall:>7.2f} {tokens:>15.3f}   {'':>17}{stages} {exchanged:>9.1f} "
                  f"{str(digest(out) == reference):>9}   ({detail})", flush=True)
            if args.per_rank:
                for r in per_rank:
                    t = r["timings"]
                    print(f"{'':<17}rank {r['rank']}: " + " ".join(f"{s} {t[s]:.2f}" for s in STAGES))


if __name__ == "__main__":
    main()

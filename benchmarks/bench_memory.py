"""Peak RSS of `packctl pack` for a corpus and one 4x larger, at the same --memory-budget.

    python benchmarks/bench_memory.py [--sequences 100000] [--budget 256MiB] [--dir /tmp/packctl-bench]

Memory should stay flat (within 10%): tokens are held only between reading and writing, within
the budget (spilled to disk beyond it); only lengths and ids grow with the corpus.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import corpus_tokens, make_corpus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=100_000)
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--distribution", default="lognormal")
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    ap.add_argument("pack_args", nargs="*", default=["--too-long", "split", "--order", "shuffle"])
    args = ap.parse_args()
    root = Path(args.dir)
    rows = []
    for scale in (1, 4):
        n = args.sequences * scale
        corpus = make_corpus(root / f"mem-{args.distribution}-{n}", sequences=n, distribution=args.distribution,
                             shards=2 * scale, row_group_rows=4096)
        proc = subprocess.run([sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(root / "mem-out"), "--overwrite", "--json",
                               "--memory-budget", args.budget, *args.pack_args],
                              capture_output=True, text=True, check=True)
        t = json.loads(proc.stdout)["metrics"]["throughput"]
        rows.append((n, corpus_tokens(corpus), t["peak_rss_bytes"], t["spilled_bytes"], t["blocks_read_twice"]))
    print(f"budget {args.budget}, options {' '.join(args.pack_args)}")
    print(f"{'sequences':>10} {'tokens':>13} {'peak RSS MiB':>13} {'spilled MiB':>12} {'blocks read twice':>18}")
    for n, tokens, rss, spilled, reread in rows:
        print(f"{n:>10,} {tokens:>13,} {rss / 2**20:>13.0f} {spilled / 2**20:>12.0f} {reread:>18}")
    print(f"peak RSS ratio 4x / 1x: {rows[1][2] / rows[0][2]:.3f}")


if __name__ == "__main__":
    main()

"""Each algorithm's kernel under --limit budgets run with none, against its token-only kernel: what
one kernel per algorithm would cost packing by tokens alone.

    python benchmarks/bench_limits_kernels.py [--n 1000000] [--capacity 4096] [--repeats 3]

Lengths are lognormal (median about 700 tokens, a tail past the capacity cut to it; `split` gets
them uncut), in one window. For every row of plan/algorithms.py KERNELS it times
`run(lengths, capacity, max_seqs, options)` and `run_limits(lengths, extra, limits, ...)` with an
n x 0 `extra` and no limits, the best of --repeats after a compiling call, checks that both give
the same bins, and prints a markdown row: seconds of each, their ratio limits / tokens, and the
verdict at the 10% bound (`merge`: the token-only entry can call the limits kernel). Each
algorithm runs in a process of its own: a limits kernel written for k >= 1 budgets may not survive
k = 0 (its row then says how the process ended).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

from packctl.plan.algorithms import KERNELS
from packctl.plan.bins import KernelOptions

BOUND = 1.10


def lognormal_lengths(n: int, capacity: int, seed: int = 0, *, cut: bool = True) -> np.ndarray:
    lengths = np.maximum(np.random.default_rng(seed).lognormal(np.log(700), 1.0, n).astype(np.int64), 1)
    return np.minimum(lengths, capacity) if cut else lengths


def best_of(repeats: int, run) -> tuple[float, object]:
    run()  # compiles (or loads the cache)
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - started)
    return best, result


def same_bins(a, b) -> bool:
    return all(np.array_equal(getattr(a, name), getattr(b, name)) for name in vars(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithms", default=",".join(KERNELS))
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the row, in this process
    args = parser.parse_args()
    options = KernelOptions(seed=0, align=1, pool_size=128, pool_strategy="closest")
    if not args.one:
        print(f"{args.n:,} lognormal lengths, capacity {args.capacity}, best of {args.repeats}\n")
        print("| algorithm | tokens-only s | limits kernel, no limit s | ratio | same bins | verdict |")
        print("|---|---:|---:|---:|---|---|")
    for name in args.algorithms.split(","):
        if args.one:
            print(row(name, args, options), flush=True)
            continue
        child = subprocess.run([sys.executable, __file__, "--one", "--n", str(args.n), "--capacity", str(args.capacity),
                                "--repeats", str(args.repeats), "--algorithms", name], capture_output=True, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith(f"| {name} |")]
        print(lines[0] if child.returncode == 0 and lines else
              f"| {name} | | | | | keep: the limits kernel with no limit ended its process "
              f"(exit {child.returncode}: {(child.stderr.strip().splitlines() or ['?'])[-1][:60]}) |", flush=True)


def row(name: str, args, options: KernelOptions) -> str:
    kernel = KERNELS[name]
    lengths = lognormal_lengths(args.n, args.capacity, cut=not kernel.cuts_items)
    extra, limits = np.zeros((len(lengths), 0), np.int64), np.zeros(0, np.int64)
    max_seqs = len(lengths) + 1
    tokens_s, tokens_bins = best_of(args.repeats, lambda: kernel.run(lengths, args.capacity, max_seqs, options))
    limits_s, limits_bins = best_of(args.repeats, lambda: kernel.run_limits(lengths, extra, limits, args.capacity,
                                                                             max_seqs, options))
    ratio = limits_s / tokens_s
    same = same_bins(tokens_bins, limits_bins)
    verdict = "merge" if same and ratio <= BOUND else "keep"
    return f"| {name} | {tokens_s:.3f} | {limits_s:.3f} | {ratio:.2f} | {'yes' if same else 'no'} | {verdict} |"

if __name__ == "__main__":
    main()

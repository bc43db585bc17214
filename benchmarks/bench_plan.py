"""Planning throughput: `packctl.plan.pack_lengths` on lengths only, one core.

    python benchmarks/bench_plan.py [--n 1000000] [--capacities 4096 16384] [--repeat 3]

Prints, per distribution, capacity and algorithm: sequences/s (best of --repeat, after a JIT
warm-up), bins, bins / ceil(sum/C) and bins / L2 (Martello-Toth lower bound).
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from packctl.plan.metrics import martello_toth_l2  # noqa: E402
from packctl.plan import ALGORITHMS, pack_lengths  # noqa: E402
from packctl.sample import sample_lengths  # noqa: E402


def lengths_for(distribution: str, n: int, capacity: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        lengths = rng.integers(1, capacity + 1, n)
    else:
        lengths, _ = sample_lengths(rng, n, distribution, max_length=capacity)
    return np.minimum(lengths, capacity).astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--capacities", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--distributions", nargs="+", default=["zipf", "lognormal", "rl-longtail", "uniform"])
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for algorithm in args.algorithms:  # compile every kernel before timing
        pack_lengths(np.array([3, 2, 1], np.int64), 4, algorithm)
    print(f"n = {args.n:,} sequences per run; seq/s = best of {args.repeat}")
    print(f"{'distribution':<12} {'C':>6} {'algorithm':<8} {'Mseq/s':>8} {'bins':>10} "
          f"{'bins/ceil':>10} {'bins/L2':>8}")
    for distribution in args.distributions:
        for capacity in args.capacities:
            lengths = lengths_for(distribution, args.n, capacity)
            ceil_bound = math.ceil(int(lengths.sum()) / capacity)
            l2 = martello_toth_l2(lengths, capacity)
            for algorithm in args.algorithms:
                best = math.inf
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    bins = pack_lengths(lengths, capacity, algorithm)
                    best = min(best, time.perf_counter() - t0)
                print(f"{distribution:<12} {capacity:>6} {algorithm:<8} {args.n / best / 1e6:>8.2f} "
                      f"{bins.num_bins:>10,} {bins.num_bins / ceil_bound:>10.4f} {bins.num_bins / l2:>8.4f}",
                      flush=True)


if __name__ == "__main__":
    main()

"""`--balance-cost`: how evenly data-parallel ranks share vision work and attention cost.

    python benchmarks/bench_balance_cost.py [--n 200000] [--capacity 8192] [--max-tiles 1]

The corpus is `packctl sample --modality image` (packctl.sample.sample_image_rows), packed by bfd
under --limit images=8 and image_tokens=C/2 (rows over a limit left out, as --too-long drop
does), then balanced over D ranks x M micro-batches, as `pack` balances (a sequence with a cost
stays in its pack; sequences of none may move), three ways: round robin of the planner's packs
(what a strided sampler does), `--dp-size` alone (attention cost), and `--dp-size --balance-cost
image_tokens`. For each it prints a markdown row of the per-step max/mean over ranks of the
attention cost and of the image tokens: the mean over steps and `weighted` (sum over steps of
the slowest rank / sum of the mean rank: 1.02 means ranks wait 2% of a step on the slowest),
and the balancing time.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from packctl.plan.balance import balance_plan, imbalance_summary
from packctl.plan.windows import WindowOptions, plan_windows
from packctl.sample import SampleSpec, sample_image_rows
from packctl.specs import BalanceSpec


def vision_grid(result, column: int, d: int) -> np.ndarray:
    """steps x ranks: the column's sum of each rank's packs in each step, after balancing."""
    grid = np.zeros((result.num_steps, d))
    np.add.at(grid, (result.step, result.dp_rank), result.plan.extra_loads()[:, column].astype(np.float64))
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--max-tiles", type=int, default=1)
    parser.add_argument("--shapes", default="8x1,8x4,16x8,32x2,64x4")
    args = parser.parse_args()
    capacity = args.capacity
    lengths, _, images, image_tokens = sample_image_rows(np.random.default_rng(0), SampleSpec(
        sequences=args.n, max_length=capacity, modality="image", max_tiles=args.max_tiles))
    extra = np.column_stack([images, image_tokens]).astype(np.int64)
    limits = (8, capacity // 2)
    options = WindowOptions(capacity=capacity, align=1, algorithm="bfd", too_long="drop", window=100_000,
                            limits=limits)
    plan = plan_windows(np.arange(args.n), lengths.astype(np.int64), options, extra=extra)
    # as pack balances it (packctl.pipeline.plan.balance): a sequence with a cost stays in its pack
    costly = (plan.piece_extra > 0).any(axis=1)
    print(f"{args.n:,} samples, C {capacity}, limits images=8 image_tokens={limits[1]}: {plan.num_bins:,} packs, "
          f"{len(plan.dropped):,} rows over a limit left out\n")
    print("| D x M | balance | attention mean | attention weighted | image tokens mean | image tokens weighted "
          "| seconds |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        d, m = (int(x) for x in shape.split("x"))
        base = BalanceSpec(dp_size=d, micro_batches=m, capacity=capacity, limits=limits)
        rows = []
        for name, spec in (("--dp-size", base), ("--balance-cost image_tokens",
                                                 BalanceSpec(**{**base.__dict__, "cost_column": 1}))):
            t0 = time.perf_counter()
            result = balance_plan(plan, spec, pinned=costly)
            seconds = time.perf_counter() - t0
            assert (result.plan.extra_loads() <= np.array(limits)).all()
            rows.append((name, imbalance_summary(result.after_attention),
                         imbalance_summary(vision_grid(result, 1, d)), f"{seconds:.2f}"))
        # round robin of the planner's packs: the `before` grids (the same for both runs)
        rows.insert(0, ("round robin", imbalance_summary(result.before_attention),
                        imbalance_summary(result.before_cost_column), ""))
        for name, att, vis, seconds in rows:
            print(f"| {d} x {m} | {name} | {att['mean']:.4f} | {att['weighted']:.4f} | {vis['mean']:.4f} | "
                  f"{vis['weighted']:.4f} | {seconds} |")

if __name__ == "__main__":
    main()

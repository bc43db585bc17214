"""Packs with --group-column against the same sequences packed one by one, and the lower bound.

    python benchmarks/bench_groups.py [--sequences 100000] [--capacity 8192] [--algorithm bfd]
                                      [--dp-size 8] [--micro-batches 4]

For a preference corpus (pairs) and rollout corpora (4 or 8 responses per prompt), from
`packctl sample --groups`: packs of `plan_windows` with and without groups, the lower bound
ceil(sum of padded lengths / capacity) (the same for both: groups add no tokens), and the planning
time (median of 5, after one warm-up run that compiles the kernels). The table is docs/algorithms.md's
"Groups" section.

`--group-scope step` columns: the same groups kept within steps of dp-size x micro-batches packs
(`plan_windows` with `step_packs`): packs, the share of steps that hold all D x M packs, planning
time. The last corpus has groups of 16 sequences of up to capacity / 4 tokens: most are longer
than a pack, so one pack per group cannot hold them ("-").
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from packctl.plan.align import round_up
from packctl.plan.groups import GroupTooLong
from packctl.plan.windows import WindowOptions, plan_windows
from packctl.sample import SampleSpec, generate

# (name, sample options, group size): sequences are capped at capacity / group size, so every group fits
CORPORA = (("preference, lognormal", dict(groups="preference", distribution="lognormal"), 2),
           ("rollout x4, lognormal", dict(groups="rollout", group_size=4, distribution="lognormal"), 4),
           ("rollout x4, rl-longtail", dict(groups="rollout", group_size=4, distribution="rl-longtail"), 4),
           ("rollout x8, lognormal", dict(groups="rollout", group_size=8, distribution="lognormal"), 8),
           ("rollout x16, lognormal, groups over a pack", dict(groups="rollout", group_size=16,
                                                                distribution="lognormal"), 4))


def _timed(fn, repeats: int = 5):
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return result, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=100_000)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--algorithm", default="bfd")
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    options = WindowOptions(capacity=args.capacity, align=1, algorithm=args.algorithm, too_long="error",
                            window=10**9)
    step_packs = args.dp_size * args.micro_batches
    stepped = WindowOptions(capacity=args.capacity, align=1, algorithm=args.algorithm, too_long="error",
                            window=10**9, step_packs=step_packs)
    print(f"| corpus | sequences | groups | mean group tokens | lower bound | packs, groups | packs, no groups "
          f"| packs, step scope ({args.dp_size}x{args.micro_batches}) | full steps | plan s, groups "
          "| plan s, no groups | plan s, step scope |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, kind, size in CORPORA:
        spec = SampleSpec(sequences=args.sequences, shards=1, max_length=args.capacity // size, **kind)
        table = generate(spec)[0]
        lengths = np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy()).astype(np.int64)
        group = table.column("group_id").to_numpy()
        gids = np.arange(len(lengths), dtype=np.int64)
        new_group = np.concatenate([[True], group[1:] != group[:-1]])
        bound = -(-int(round_up(lengths, 1).sum()) // args.capacity)
        try:
            grouped, t_grouped = _timed(lambda: plan_windows(gids, lengths, options, new_group=new_group))
            packed = f"{grouped.num_bins:,} ({grouped.num_bins / bound - 1:+.2%})"
            t_packed = f"{t_grouped:.3f}"
        except GroupTooLong:
            packed = t_packed = "-"
        single, t_single = _timed(lambda: plan_windows(gids, lengths, options))
        steps, t_steps = _timed(lambda: plan_windows(gids, lengths, stepped, new_group=new_group))
        full = float(np.mean(np.diff(steps.step_bins) == step_packs))
        num_groups = int(new_group.sum())
        print(f"| {name} | {len(lengths):,} | {num_groups:,} | {lengths.sum() / num_groups:,.0f} | {bound:,} | "
              f"{packed} | {single.num_bins:,} ({single.num_bins / bound - 1:+.2%}) | "
              f"{steps.num_bins:,} ({steps.num_bins / bound - 1:+.2%}) | {full:.1%} | {t_packed} | "
              f"{t_single:.3f} | {t_steps:.3f} |")


if __name__ == "__main__":
    main()

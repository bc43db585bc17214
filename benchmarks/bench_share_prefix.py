"""Packs of groups sharing a prompt, with and without --share-prefix: tokens, packs, attention.

    python benchmarks/bench_share_prefix.py [--groups 20000] [--capacity 16384] [--algorithm bfd]

Real-text-like lengths: prompts lognormal (median 400 tokens, sigma 0.9), responses lognormal
(median 250, sigma 1.0), as chat and RL corpora have them; each group is a DPO pair (2 rows) or a
GRPO group of 4, 8 or 16 rollouts of one prompt, so its rows agree on the prompt and part ways at
the first response token: p = the prompt length. A group whose rows do not fit one pack unshared
is drawn again (both plans must hold every group).

For each corpus: the tokens stored and the packs of `plan_windows` with and without sharing (the
same planner `pack` runs, `shared` = p - 1 on every row of a group), the lower bound of each, and
the causal attention cost (visible query-key pairs, plan/prefix.py `sharing_counts`) flat and as
trees. The table is docs/performance.md's "Shared prefixes" section.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from packctl.plan.prefix import piece_parents, prefix_pieces, sharing_counts
from packctl.plan.windows import WindowOptions, plan_windows

CORPORA = (("DPO pairs", 2), ("GRPO x4", 4), ("GRPO x8", 8), ("GRPO x16", 16))


def draw(rng: np.random.Generator, groups: int, size: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Row lengths and each row's prompt length, `groups` groups of `size` rows that fit `capacity` unshared."""
    lengths, prompts = [], []
    while len(lengths) < groups * size:
        prompt = max(1, int(rng.lognormal(np.log(400), 0.9)))
        responses = np.maximum(1, rng.lognormal(np.log(250), 1.0, size).astype(np.int64))
        if size * prompt + responses.sum() > capacity:
            continue
        lengths += (prompt + responses).tolist()
        prompts += [prompt] * size
    return np.array(lengths, np.int64), np.array(prompts, np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=20_000)
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--algorithm", default="bfd")
    args = parser.parse_args()
    options = WindowOptions(capacity=args.capacity, align=1, algorithm=args.algorithm, too_long="error",
                            window=10**9)
    rng = np.random.default_rng(0)
    print(f"capacity {args.capacity}, --algorithm {args.algorithm}, {args.groups:,} groups a corpus")
    print("| corpus | rows | tokens, flat | tokens, shared | saved | packs, flat | packs, shared | fewer packs "
          "| attention pairs, flat | attention pairs, shared | attention saved | plan s, shared |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, size in CORPORA:
        lengths, prompts = draw(rng, args.groups, size, args.capacity)
        gids = np.arange(len(lengths), dtype=np.int64)
        new_group = (gids % size) == 0
        group_starts = np.append(gids[new_group], len(gids))
        shared = np.where(prompts >= 2, prompts - 1, 0)
        flat = plan_windows(gids, lengths, options, new_group=new_group)
        started = time.perf_counter()
        tree = plan_windows(gids, lengths, options, new_group=new_group, shared=shared)
        seconds = time.perf_counter() - started
        parents = piece_parents(tree, group_starts)
        counts = sharing_counts(tree.piece_start, tree.piece_len, parents, prefix_pieces(tree.bin_offsets, parents))
        stored = int(tree.piece_len.sum())
        saved = counts["attention_flat"] - counts["attention_tree"]
        print(f"| {name} | {len(lengths):,} | {int(lengths.sum()):,} | {stored:,} "
              f"| {1 - stored / lengths.sum():.1%} | {flat.num_bins:,} | {tree.num_bins:,} "
              f"| {1 - tree.num_bins / flat.num_bins:.1%} | {counts['attention_flat']:.3e} "
              f"| {counts['attention_tree']:.3e} | {saved / counts['attention_flat']:.1%} | {seconds:.2f} |")


if __name__ == "__main__":
    main()

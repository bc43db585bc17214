"""Packing under two budgets: a synthetic vision-language corpus packed by tokens and images.

    python benchmarks/bench_limits.py [--n 1000000] [--capacities 8192 16384] [--repeat 3] [--orders]

The corpus is `packctl sample --modality image` (packctl.sample.sample_image_rows: ~40% text-only
rows, one 576-token tile an image, image tokens inside the length), rows clipped to the capacity;
rows over a limit are left out (as --too-long drop does) and counted. For each capacity, limit
(images=8, image_tokens=C/4 in whole tiles, both) and algorithm it prints a markdown row: packs,
packs over the lower bound max(ceil(sum tokens / C), ceil(sum COL / N)), the share of packs full
in each budget (within 1% of it, or with less room than the smallest nonzero cost: which one
binds), and planning throughput (M samples/s, best of --repeat after
a warm-up, one core). `buffer48` is a runtime packer's policy, simulated here: samples stream into
a buffer of 48; a pack takes, in arrival order, every buffered sample that fits every budget
(first fit over the buffer), is emitted, and the buffer refills (the setting of OLMo-core PR #824).
`--orders` compares the order ffd and bfd take items in: decreasing tokens (packctl's) against a
normalized max or sum over the budgets.
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numba  # noqa: E402
import numpy as np  # noqa: E402

from packctl.plan import ALGORITHMS, pack_lengths  # noqa: E402
from packctl.plan.bins import whole_items_into_bins  # noqa: E402
from packctl.plan.fit import best_fit_limits, first_fit_limits, first_fit_limits_bin_bound  # noqa: E402
from packctl.sample import SampleSpec, sample_image_rows  # noqa: E402

BUFFER = 48
COLUMNS = ("images", "image_tokens")


def vlm_corpus(n: int, capacity: int, max_tiles: int = 1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, extra n x 2 [images, image_tokens]) of a synthetic VLM corpus whose rows fit `capacity`."""
    spec = SampleSpec(sequences=n, modality="image", max_length=capacity, max_tiles=max_tiles, seed=seed).validate()
    lengths, _, images, image_tokens = sample_image_rows(np.random.default_rng(seed), spec)
    return lengths.astype(np.int64), np.stack([images, image_tokens], axis=1).astype(np.int64)


@numba.njit(cache=False)
def _buffer_kernel(lengths, extra, limits, capacity, buffer_size):
    """Pack of each sample under first fit over a sliding buffer (see the module docstring)."""
    n = lengths.size
    k = limits.size
    pack_of = np.empty(n, np.int64)
    buffer = np.empty(buffer_size, np.int64)
    spent = np.empty(k, np.int64)
    held = 0
    next_item = 0
    packs = 0
    while True:
        while held < buffer_size and next_item < n:
            buffer[held] = next_item
            held += 1
            next_item += 1
        if held == 0:
            break
        load = 0
        for j in range(k):
            spent[j] = 0
        kept = 0
        for i in range(held):
            item = buffer[i]
            fits = load + lengths[item] <= capacity
            for j in range(k):
                fits = fits and spent[j] + extra[item, j] <= limits[j]
            if fits:
                pack_of[item] = packs
                load += lengths[item]
                for j in range(k):
                    spent[j] += extra[item, j]
            else:
                buffer[kept] = item
                kept += 1
        held = kept
        packs += 1
    return pack_of, packs


def pack_buffer(lengths, extra, limits, capacity):
    pack_of, packs = _buffer_kernel(lengths, extra, limits, capacity, BUFFER)
    order = np.argsort(pack_of, kind="stable")
    return whole_items_into_bins(lengths, order, pack_of[order], packs)


def pack(algorithm, lengths, extra, limits, capacity):
    if algorithm == "buffer48":
        return pack_buffer(lengths, extra, limits, capacity)
    return pack_lengths(lengths, capacity, algorithm, extra=extra, limits=limits)


def full(loads: np.ndarray, limit: int, costs: np.ndarray) -> np.ndarray:
    """Packs full in a cost column: within 1% of the limit, or with less room than its smallest
    positive cost (no image fits any more)."""
    smallest = int(costs[costs > 0].min()) if (costs > 0).any() else 1
    return (loads >= 0.99 * limit) | (limit - loads < smallest)


def lower_bound(lengths, extra, limits, capacity) -> int:
    bound = math.ceil(int(lengths.sum()) / capacity)
    for total, limit in zip(extra.sum(axis=0).tolist(), limits.tolist()):
        bound = max(bound, math.ceil(total / limit))
    return bound


def settings_for(capacity: int) -> list[tuple[str, list[int], list[int]]]:
    tiles = capacity // 4 // 576 * 576  # a quarter of the pack, in whole 576-token tiles
    return [("images=8", [0], [8]), (f"image_tokens={tiles}", [1], [tiles]),
            (f"images=8, image_tokens={tiles}", [0, 1], [8, tiles])]


def order_comparison(lengths, extra, limits, capacity) -> list[tuple[str, str, int]]:
    """(order, algorithm, packs) for ffd and bfd with items taken by decreasing tokens, by the
    normalized max over budgets, or by the normalized sum."""
    scale = np.concatenate([[capacity], limits]).astype(np.float64)
    dims = np.column_stack([lengths, extra]) / scale
    keys = {"tokens": lengths.astype(np.float64), "max": dims.max(axis=1), "sum": dims.sum(axis=1)}
    rows = []
    for name, key in keys.items():
        order = np.lexsort((np.arange(len(lengths)), -key))
        sizes, costs = lengths[order], np.ascontiguousarray(extra[order])
        bound = first_fit_limits_bin_bound(lengths, extra, limits, capacity, len(lengths) + 1)
        rows.append((name, "ffd", first_fit_limits(sizes, costs, limits, capacity, len(lengths) + 1, bound, 0)[1]))
        rows.append((name, "bfd", best_fit_limits(sizes, costs, limits, capacity, len(lengths) + 1)[1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--capacities", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--algorithms", nargs="+", default=[*ALGORITHMS, "buffer48"])
    ap.add_argument("--max-tiles", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--orders", action="store_true", help="compare the item orders of ffd and bfd")
    args = ap.parse_args()
    tiny_extra = np.array([[1, 1], [0, 0], [1, 1]], np.int64)
    for algorithm in args.algorithms:  # compile every kernel before timing
        pack(algorithm, np.array([3, 2, 1], np.int64), tiny_extra[:, :1].copy(), np.array([2], np.int64), 4)
        pack(algorithm, np.array([3, 2, 1], np.int64), tiny_extra, np.array([2, 2], np.int64), 4)
    print(f"n = {args.n:,} samples (synthetic VLM corpus, max tiles {args.max_tiles}); M samples/s = best of "
          f"{args.repeat}, one core\n")
    print("| C | limits | algorithm | packs | packs / bound | tokens bind | limits bind | M samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    orders = []
    for capacity in args.capacities:
        all_lengths, all_extra = vlm_corpus(args.n, capacity, args.max_tiles)
        for label, columns, limits in settings_for(capacity):
            limits = np.asarray(limits, np.int64)
            extra = np.ascontiguousarray(all_extra[:, columns])
            keep = ~(extra > limits).any(axis=1)
            lengths, extra = all_lengths[keep], extra[keep]
            bound = lower_bound(lengths, extra, limits, capacity)
            left_out = int((~keep).sum())
            label_out = label + (f" ({left_out} over)" if left_out else "")
            for algorithm in args.algorithms:
                best = math.inf
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    bins = pack(algorithm, lengths, extra, limits, capacity)
                    best = min(best, time.perf_counter() - t0)
                loads = bins.extra_loads(extra)
                tokens_full = float((bins.loads() >= 0.99 * capacity).mean())
                limits_full = " / ".join(f"{float(full(loads[:, j], limits[j], extra[:, j]).mean()):.0%}"
                                         for j in range(len(limits)))
                assert (bins.loads() <= capacity).all() and (loads <= limits).all()
                print(f"| {capacity} | {label_out} | {algorithm} | {bins.num_bins:,} | {bins.num_bins / bound:.4f} | "
                      f"{tokens_full:.0%} | {limits_full} | {len(lengths) / best / 1e6:.2f} |", flush=True)
            if args.orders:
                orders += [(capacity, label, *row, bound) for row in order_comparison(lengths, extra, limits,
                                                                                      capacity)]
    if orders:
        print("\n| C | limits | order | algorithm | packs | packs / bound |")
        print("|---|---|---|---|---|---|")
        for capacity, label, name, algorithm, packs, bound in orders:
            print(f"| {capacity} | {label} | {name} | {algorithm} | {packs:,} | {packs / bound:.4f} |")


if __name__ == "__main__":
    main()

"""Cluster-scale simulation of `mpiexec -n N packctl pack`: lengths only, N = 2..256 simulated ranks.

    python benchmarks/sim_scaleout.py [--sequences 10000000] [--ranks 2 4 8 16 32 64 128 256]

Runs the real scan split (`split_blocks`), order, planning (`plan_windows`, once: the plan never
depends on N), the planning ranks' windows, their units (`units_of`) and the writer assignment
(`assign`) for every N, on a synthetic corpus (packctl sample's distributions, 8,192-row blocks),
and prints per order and N:

- write max/mean: tokens each writer writes, max over mean (1.00 = equal shares),
- plan max/mean: sequences each rank plans,
- MiB moved by MPI (sample sort of (key, gid, length), windows to their planning rank, plan
  arrays to writers, and with exchange the tokens+labels of every piece scanned elsewhere),
- read x: with --token-transfer read, blocks decoded by all writers over the blocks needed, and
  what `auto` picks (read when <= 1.5, or <= 3 with input order).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from packctl.mpi.assign import assign, units_of
from packctl.source.parquet import Block, split_blocks
from packctl.plan.align import pack_lengths_padded, round_up
from packctl.plan.order import order_sequences
from packctl.plan.windows import WindowOptions, plan_windows
from packctl.pipeline.materialize import READ_AMPLIFICATION_LIMIT, READ_AMPLIFICATION_LIMIT_INPUT_ORDER
from packctl.sample import sample_lengths

BLOCK_ROWS = 8192


def ratio(values: np.ndarray) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0


def simulate(lengths: np.ndarray, order: str, ranks: list[int], *, capacity: int, window: int, shard_rows: int,
             algorithm: str, seed: int) -> None:
    n = len(lengths)
    block_offsets = np.append(np.arange(0, n, BLOCK_ROWS), n)
    sums = np.concatenate([[0], np.cumsum(lengths)])
    blocks = [Block(file=0, row_group=b, first_row=int(lo), rows=int(hi - lo), nbytes=int(sums[hi] - sums[lo]) * 8)
              for b, (lo, hi) in enumerate(zip(block_offsets[:-1], block_offsets[1:]))]
    t0 = time.perf_counter()
    perm = order_sequences(round_up(lengths, 1), order, seed=seed)
    plan = plan_windows(perm, lengths[perm], WindowOptions(capacity=capacity, align=1, algorithm=algorithm,
                                                           too_long="split", window=window, seed=seed))
    pack_lens = pack_lengths_padded(plan.loads(padded=True), capacity, "capacity", 1)
    print(f"\norder {order}: {plan.num_bins:,} packs, planned in {time.perf_counter() - t0:.1f} s (one process)")
    print(f"{'ranks':>5} {'write max/mean':>14} {'plan max/mean':>13} {'units/rank':>10} "
          f"{'MiB exchange':>12} {'MiB read':>9} {'read x':>7} {'auto':>8}")
    piece_block = np.searchsorted(block_offsets, plan.piece_gid, side="right") - 1
    piece_pack = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    num_windows = plan.num_windows
    for size in ranks:
        # scan: blocks by bytes; order: positions -> windows -> planning ranks (as pipeline does)
        block_bounds = split_blocks(blocks, size)
        scan_rank_of_block = np.repeat(np.arange(size), np.diff(block_bounds))
        window_cuts = -(-np.arange(size + 1) * num_windows // size)
        per_rank = [units_of(plan.window_bins[lo:hi + 1] - plan.window_bins[lo], pack_lens[plan.window_bins[lo]:
                                                                                           plan.window_bins[hi]],
                             shard_rows) for lo, hi in zip(window_cuts[:-1], window_cuts[1:])]
        assignment = assign(per_rank, size)
        writer_of_pack = np.repeat(np.arange(size), np.diff(assignment.pack_cuts))
        planner_of_pack = np.repeat(np.arange(size), np.diff(plan.window_bins[window_cuts]))
        writer_tokens = assignment.writer_tokens()
        planned = np.diff(np.minimum(window_cuts * window, n))
        # bytes moved: sort (3 int64 per sequence not already on its rank) + windows to planners
        gid_scan_rank = scan_rank_of_block[np.searchsorted(block_offsets, np.arange(n), side="right") - 1]
        position_rank = np.minimum(np.arange(n) // window * size // max(num_windows, 1), size - 1)
        sort_bytes = 0 if order == "input" else int(np.count_nonzero(gid_scan_rank[perm] != position_rank)) * 24
        # plan hand-over: pack arrays + 4 int64 per piece, for packs planned on one rank, written on another
        moved = planner_of_pack != writer_of_pack
        plan_bytes = int(np.count_nonzero(moved)) * 16 + int(np.count_nonzero(moved[piece_pack])) * 32
        piece_writer = writer_of_pack[piece_pack]
        remote = scan_rank_of_block[piece_block] != piece_writer
        token_bytes = int(plan.piece_len[remote].sum()) * 8 + int(np.count_nonzero(remote)) * 32
        needed = np.unique(piece_block)
        pairs = np.unique(piece_writer * len(blocks) + piece_block)
        block_bytes = np.array([b.nbytes for b in blocks])
        read_bytes = int(block_bytes[pairs % len(blocks)].sum())
        amplification = read_bytes / max(int(block_bytes[needed].sum()), 1)
        read = amplification <= (READ_AMPLIFICATION_LIMIT_INPUT_ORDER if order == "input" else READ_AMPLIFICATION_LIMIT)
        exchange = sort_bytes + plan_bytes + (0 if read else token_bytes)
        print(f"{size:>5} {ratio(writer_tokens):>14.3f} {ratio(planned):>13.3f} "
              f"{len(assignment.unit_tokens) / size:>10.1f} {exchange / 2**20:>12.1f} "
              f"{(read_bytes if read else 0) / 2**20:>9.1f} {amplification:>7.2f} {'read' if read else 'exchange':>8}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=10_000_000)
    ap.add_argument("--distribution", default="lognormal")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--orders", nargs="+", default=["input", "shuffle", "curriculum"])
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--window", type=int, default=100_000)
    ap.add_argument("--shard-rows", type=int, default=1024)
    ap.add_argument("--algorithm", default="bfd")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths, _ = sample_lengths(np.random.default_rng(args.seed), args.sequences, args.distribution, 32768)
    lengths = np.asarray(lengths, dtype=np.int64)
    print(f"{args.sequences:,} sequences ({int(lengths.sum()):,} tokens, {args.distribution}), capacity "
          f"{args.capacity}, {args.algorithm}, --window {args.window}, --shard-rows {args.shard_rows}, "
          f"{-(-args.sequences // BLOCK_ROWS):,} blocks of {BLOCK_ROWS:,} rows")
    for order in args.orders:
        simulate(lengths, order, args.ranks, capacity=args.capacity, window=args.window,
                 shard_rows=args.shard_rows, algorithm=args.algorithm, seed=args.seed)


if __name__ == "__main__":
    main()

"""Cluster-scale simulation of `mpiexec -n N packctl pack`: lengths only, N = 2..256 simulated ranks,
and what each rank holds at 1B sequences over 64..1024 ranks (`--memory`).

    python benchmarks/sim_scaleout.py [--sequences 10000000] [--ranks 2 4 8 16 32 64 128 256]
    python benchmarks/sim_scaleout.py --memory [--sequences 1000000000] [--ranks 64 128 256 512 1024]

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

from packctl.pipeline.assign import assign, units_of
from packctl.source.parquet import split_blocks
from packctl.plan.align import pack_lengths_padded, round_up
from packctl.plan.order import order_sequences
from packctl.plan.windows import WindowOptions, plan_windows
from packctl.pipeline.materialize import READ_AMPLIFICATION_LIMIT, READ_AMPLIFICATION_LIMIT_INPUT_ORDER
from packctl.sample import sample_lengths
from packctl.source.index import Block

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


# What one rank holds, per sequence or piece, besides the plan arrays measured below (int64 columns):
SCAN_BYTES = 8  # SequenceIndex.lengths of its scanned share (gids are implicit: gid_lo + position)
SORT_BYTES = 2 * 3 * 8  # sample sort: (key, gid, length) sent and received
PLANNED_BYTES = 2 * 8  # Ordered.gids, Ordered.lengths of the windows it plans
BASELINE_BYTES = 2 * 3 * 8  # (gid, epoch, length) of its pieces sent, and of its gids' pieces received
UNIT_BYTES = 3 * 8 + 2  # Units: bounds, tokens, epoch (int64), first_of_shard, opens_window (bool)
SHARD_ENTRY_BYTES = 200  # one pickled ShardEntry (path, rows, tokens, sha256, ...) in rank 0's shard table
RANK_REPORT_BYTES = 1500  # one pickled rank report (metrics.json's `ranks`), allgathered


def window_lengths(seed: int, window: int, size: int, distribution: str) -> np.ndarray:
    """The lengths of window `window` of the shuffled global order: a seeded stream of its own, so
    any rank's windows are made without the 1B lengths ever being in memory together."""
    lengths, _ = sample_lengths(np.random.default_rng([seed, window]), size, distribution, 32768)
    return np.asarray(lengths, dtype=np.int64)


def window_owners_table(sizes: np.ndarray, ranks: int) -> np.ndarray:
    """`packctl.pipeline.order.window_owners` over a table of window sizes (one epoch): rank r plans
    the windows whose middle sequence lies in the r-th of `ranks` equal parts of the sequences."""
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(sizes.sum())
    return np.minimum((2 * start + sizes) * ranks // (2 * total), ranks - 1)


def check_owners_table() -> None:
    """The table above is the dealing `pack` does (in-process ranks on a small uneven corpus)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from packctl.pipeline.order import window_owners
    from support.threadcomm import run_ranks

    sizes = np.array([7, 3, 9, 1, 4, 4, 8, 2, 6])
    window = np.repeat(np.arange(len(sizes)), sizes)
    opens = np.concatenate([[True] + [False] * (n - 1) for n in sizes])
    cuts = [0, 10, 11, 30, len(window)]
    owners = run_ranks(4, lambda comm: window_owners(comm, window[cuts[comm.rank]:cuts[comm.rank + 1]],
                                                     opens[cuts[comm.rank]:cuts[comm.rank + 1]], 0, 1))
    assert np.array_equal(np.concatenate(owners), np.repeat(window_owners_table(sizes, 4), sizes))


def plan_rank(windows: np.ndarray, sizes: np.ndarray, config, *, seed: int, distribution: str,
              chunk: int = 2_000_000) -> dict:
    """Plan one simulated rank's windows with the real functions (`plan_windows`, final pack lengths,
    its `RankSummary`, its `units_of`), a run of windows at a time so that at most `chunk`
    sequences' plan is in memory here; returns what the rank would hold and how long planning took."""
    import pickle

    from packctl.pipeline.assign import units_of
    from packctl.pipeline.plan import Planned
    from packctl.pipeline.report import RankSummary

    specs = config.specs()
    seconds, held, pieces, packs, units, summary, old_share = 0.0, 0, 0, 0, 0, None, 0
    k = 0
    while k < len(windows):
        run = [int(windows[k])]
        while k + len(run) < len(windows) and sum(int(sizes[w]) for w in run) < chunk:
            run.append(int(windows[k + len(run)]))
        k += len(run)
        lengths = np.concatenate([window_lengths(seed, w, int(sizes[w]), distribution) for w in run])
        gids = np.arange(len(lengths), dtype=np.int64)  # gids do not change how a window plans
        # the run is planned window by window inside (windows of specs.windows.window sequences)
        took = []
        for _ in range(2):  # the faster of two: the machine is shared, planning is not
            t0 = time.perf_counter()
            plan = plan_windows(gids, lengths, specs.windows, first_window=run[0])
            pack_lens = pack_lengths_padded(plan.loads(padded=True), config.capacity, "capacity", 1)
            took.append(time.perf_counter() - t0)
        seconds += min(took)
        arrays = ("window_bins", "bin_offsets", "piece_gid", "piece_start", "piece_len", "piece_padded")
        held += sum(getattr(plan, a).nbytes for a in arrays) + pack_lens.nbytes
        pieces += len(plan.piece_gid)
        packs += plan.num_bins
        units += len(units_of(plan.window_bins, pack_lens, config.shard_rows).tokens)
        part = RankSummary.of(Planned(plan=plan, pack_lens=pack_lens), specs.report, epoch=0, rank=0)
        summary = part if summary is None else summary + part
        old_share += len(pickle.dumps((plan, pack_lens), protocol=pickle.HIGHEST_PROTOCOL))  # what was gathered
    return {"seconds": seconds, "plan_bytes": held, "pieces": pieces, "packs": packs, "units": units,
            "summary_bytes": len(pickle.dumps(summary, protocol=pickle.HIGHEST_PROTOCOL)), "old_share": old_share}


def simulate_memory(total: int, ranks: list[int], *, capacity: int, window: int, shard_rows: int, algorithm: str,
                    seed: int, distribution: str) -> None:
    """What every rank holds at `total` sequences (--order shuffle: each window a seeded sample of
    the corpus) over each count of ranks, planning rank 0, the heaviest and the lightest for real."""
    from packctl import PackConfig

    check_owners_table()
    config = PackConfig(inputs=["corpus"], output="out", capacity=capacity, algorithm=algorithm, too_long="split",
                        window=window, shard_rows=shard_rows, order="shuffle", seed=seed)
    num_windows = -(-total // window)
    sizes = np.full(num_windows, window, dtype=np.int64)
    sizes[-1] = total - window * (num_windows - 1)
    plan_rank(np.array([0]), sizes, config, seed=seed, distribution=distribution)  # kernels compiled, warm
    started = time.perf_counter()
    print(f"{total:,} sequences ({distribution}), capacity {capacity}, {algorithm}, --window {window:,} "
          f"({num_windows:,} windows), --shard-rows {shard_rows}\n")
    print("| ranks | seq/rank | plan work max/mean (by count) | plan s: rank 0 / heaviest / lightest | "
          "plan time max/mean | peak MiB per rank | unit table MiB | rank 0 beyond share: before | after |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    cache: dict[tuple, dict] = {}
    for size in ranks:
        owners = window_owners_table(sizes, size)
        work = np.bincount(owners, weights=sizes, minlength=size)
        by_count = np.bincount(np.arange(num_windows) * size // num_windows, weights=sizes, minlength=size)
        sampled = sorted({0, int(np.argmax(work)), int(np.argmin(work))})
        figures = {}
        for r in sampled:
            mine = np.flatnonzero(owners == r)
            key = tuple(mine[[0, -1]].tolist()) if len(mine) else (r, -1, size)
            if key not in cache:
                cache[key] = plan_rank(mine, sizes, config, seed=seed, distribution=distribution) if len(mine) else {
                    "seconds": 0.0, "plan_bytes": 0, "pieces": 0, "packs": 0, "units": 0, "summary_bytes": 0,
                    "old_share": 0}
            figures[r] = cache[key]
        planned = [work[r] for r in sampled if work[r] > 0]
        rate = sum(figures[r]["seconds"] for r in sampled) / max(sum(planned), 1)  # seconds per sequence
        heavy = figures[int(np.argmax(work))]
        per_seq = {k: sum(figures[r][k] for r in sampled) / max(sum(planned), 1)
                   for k in ("plan_bytes", "pieces", "packs", "units", "old_share")}
        total_units = per_seq["units"] * total
        total_packs = per_seq["packs"] * total
        unit_table = total_units * UNIT_BYTES  # allgathered: every rank holds every unit (pipeline/assign.py)
        share = total / size
        peak_work = work.max()
        plan_stage = PLANNED_BYTES * peak_work + heavy["plan_bytes"]
        order_stage = SORT_BYTES * share
        report_stage = heavy["plan_bytes"] + BASELINE_BYTES * per_seq["pieces"] * share + heavy["summary_bytes"]
        peak = SCAN_BYTES * share + max(plan_stage, order_stage, report_stage) + unit_table
        before = per_seq["old_share"] * total  # every rank's plan, pickled, gathered on rank 0 (then merged: x2)
        after = heavy["summary_bytes"] + total_packs / shard_rows * SHARD_ENTRY_BYTES + size * RANK_REPORT_BYTES
        mib = 2**20
        print(f"| {size} | {share:,.0f} | {ratio(work):.3f} ({ratio(by_count):.3f}) | "
              f"{figures[0]['seconds']:.1f} / {heavy['seconds']:.1f} / {figures[int(np.argmin(work))]['seconds']:.1f} | "
              f"{heavy['seconds'] / (rate * work.mean()):.3f} | {peak / mib:,.0f} | {unit_table / mib:,.1f} | "
              f"{before / 2**30:,.1f} GiB | {after / mib:,.1f} MiB |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")


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
    ap.add_argument("--memory", action="store_true", help="what each rank holds at --sequences (default 1B) "
                    "over --ranks (default 64 .. 1024), planning a sample of ranks for real")
    args = ap.parse_args()
    if args.memory:
        simulate_memory(args.sequences if args.sequences != 10_000_000 else 1_000_000_000,
                        args.ranks if args.ranks != [2, 4, 8, 16, 32, 64, 128, 256] else [64, 128, 256, 512, 1024],
                        capacity=args.capacity, window=args.window, shard_rows=args.shard_rows,
                        algorithm=args.algorithm, seed=args.seed, distribution=args.distribution)
        return
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

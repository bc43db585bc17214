"""The online API inside a training loop: per-call latency, packs and balance against pure Python.

    python benchmarks/bench_online.py [--sizes 1000 10000 100000] [--capacity 16384] [--dp-size 8]
                                      [--python-up-to 10000] [--repeat 20]

One rollout batch of rl-longtail lengths (packctl sample's distribution, at most --capacity) per
size. Printed per size:

  cold    a fresh process: `import packctl` and the first `plan_packs` (numpy imported before the
          clock starts: a training job has it already), with the kernels in numba's disk cache
          (`python -m packctl.online` run first; the median and the fastest of 5 processes), and
          with an empty cache (NUMBA_CACHE_DIR a new
          folder: what the first job after an install pays without that step)
  warm    median and fastest of --repeat calls in one process: plan_packs (bfd, ffd), plan_steps
          (--dp-size ranks, one step, its defaults)
  packs   packctl ffd and bfd against a pure-Python first fit decreasing (a list scan per
          sequence, as the RL frameworks write it), and its time
  balance tokens per rank, max / mean: plan_steps against a pure-Python Karmarkar-Karp of the
          sequences over the ranks (equal counts), then over each rank's micro-batches
          (ceil(tokens / capacity) of them): how many of those micro-batches exceed the capacity
  ranks   plan_steps balance_scope="ranks" (the sequences split over the ranks by Karmarkar-Karp,
          then packed rank by rank; `auto` picks it for one step of more than 2,048 sequences)
          against balance_scope="packs" (whole packs dealt): balance, time, packs against
          plan_packs' global bfd, packs over the capacity; and verl's
          get_seqlen_balanced_partitions (packctl's compiled Karmarkar-Karp) against the
          pure-Python one at the ranks' level

The pure-Python baselines run up to --python-up-to sequences (the first fit is O(n * packs)).
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import packctl  # noqa: E402


def rollout_lengths(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    from packctl.sample import sample_lengths

    lengths, _ = sample_lengths(np.random.default_rng(seed), n, "rl-longtail", max_length=capacity)
    return np.clip(lengths, 1, capacity).astype(np.int64)


# --- pure-Python baselines, written the way the RL frameworks' packers are ------------------------

def python_ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First fit decreasing: each sequence, longest first, into the first bin with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if free >= lengths[i]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def python_kk(lengths: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp largest differencing over k parts (a heap of k-tuples of (sum, items))."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    starts = [order[g:g + k] for g in range(0, len(order), k)] if equal_size else [[i] for i in order]
    heap = []
    for g, items in enumerate(starts):
        parts = sorted([(lengths[i], [i]) for i in items] + [(0, []) for _ in range(k - len(items))],
                       key=lambda p: -p[0])
        heapq.heappush(heap, (parts[-1][0] - parts[0][0], g, parts))
    count = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = sorted([(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, reversed(b))], key=lambda p: -p[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], count, merged))
        count += 1
    return [items for _, items in heap[0][2]]


# --- measurements ----------------------------------------------------------------------------------

COLD = """
import sys, time
import numpy as np
lengths = np.load(sys.argv[1])
start = time.perf_counter()
import packctl
imported = time.perf_counter()
packs = packctl.plan_packs(lengths, int(sys.argv[2]))
done = time.perf_counter()
from packctl.jit import compile_seconds
print(f"{imported - start} {done - imported} {compile_seconds()} {packs.num_packs}")
"""


def cold(lengths: np.ndarray, capacity: int, cache: str | None, runs: int = 5) -> tuple[tuple[float, ...], float]:
    """(import s, first call s, compile s) of the run of median total among `runs` fresh
    interpreters, and the fastest total."""
    measured = sorted((_cold_once(lengths, capacity, cache) for _ in range(runs)), key=lambda r: r[0] + r[1])
    return measured[len(measured) // 2], measured[0][0] + measured[0][1]


def _cold_once(lengths: np.ndarray, capacity: int, cache: str | None) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "lengths.npy")
        np.save(path, lengths)
        env = dict(os.environ)
        if cache is not None:
            env["NUMBA_CACHE_DIR"] = cache
        out = subprocess.run([sys.executable, "-c", COLD, path, str(capacity)], capture_output=True, text=True,
                             env=env, check=True).stdout.split()
    return float(out[0]), float(out[1]), float(out[2])


def timed(fn, repeat: int) -> tuple[float, float]:
    """(median, fastest) seconds of `repeat` calls after one more: the fastest is the figure of a
    quiet core, the median what a shared machine gives."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times))


def max_over_mean(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(values.max() / values.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--capacity", type=int, default=16384)
    ap.add_argument("--dp-size", type=int, default=8)
    ap.add_argument("--python-up-to", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    capacity, d = args.capacity, args.dp_size
    subprocess.run([sys.executable, "-m", "packctl.online"], check=True, capture_output=True)  # the cache filled
    results = []
    for n in args.sizes:
        lengths = rollout_lengths(n, capacity)
        row: dict = {"sequences": n, "tokens": int(lengths.sum())}
        (row["cold_import_s"], row["cold_first_call_s"], _), row["cold_fastest_s"] = cold(lengths, capacity, None)
        with tempfile.TemporaryDirectory() as empty:  # a new empty cache
            (_, row["cold_uncached_first_call_s"], row["cold_uncached_compile_s"]), _ = cold(lengths, capacity, empty, 1)
        for algorithm in ("bfd", "ffd"):
            median, fastest = timed(lambda: packctl.plan_packs(lengths, capacity, algorithm=algorithm), args.repeat)
            row[f"warm_plan_packs_{algorithm}_ms"], row[f"warm_plan_packs_{algorithm}_fastest_ms"] = 1e3 * median, 1e3 * fastest
        row["warm_plan_packs_ms"] = row["warm_plan_packs_bfd_ms"]
        median, fastest = timed(lambda: packctl.plan_steps(lengths, d, capacity=capacity), max(3, args.repeat // 4))
        row["warm_plan_steps_ms"], row["warm_plan_steps_fastest_ms"] = 1e3 * median, 1e3 * fastest
        row["packs_ffd"] = packctl.plan_packs(lengths, capacity, algorithm="ffd").num_packs
        row["packs_bfd"] = packctl.plan_packs(lengths, capacity, algorithm="bfd").num_packs
        row["packs_lower_bound"] = -(-int(lengths.sum()) // capacity)
        for balance in ("tokens", "attention"):
            steps = packctl.plan_steps(lengths, d, capacity=capacity, balance=balance)
            figures = steps.metrics()
            row[f"packctl_{balance}_rank_tokens"] = figures["tokens"]["max"]
            row[f"packctl_{balance}_rank_attention"] = figures["attention"]["max"]
            row["packctl_packs_over_capacity"] = int((steps.packs.loads() > capacity).sum())
            row["packctl_micro_batches"] = int(steps.micro_batch.max()) + 1
        for scope in ("ranks", "packs"):
            for balance in ("tokens", "attention"):
                call = (lambda: packctl.plan_steps(lengths, d, capacity=capacity, balance=balance, balance_scope=scope))
                median, fastest = timed(call, max(3, args.repeat // 4))
                steps = call()
                figures = steps.metrics()
                key = f"{scope}_{balance}"
                row[f"{key}_ms"], row[f"{key}_fastest_ms"] = 1e3 * median, 1e3 * fastest
                row[f"{key}_rank_tokens"] = figures["tokens"]["max"]
                row[f"{key}_rank_attention"] = figures["attention"]["max"]
                row[f"{key}_packs"] = steps.packs.num_packs
                row[f"{key}_over_capacity"] = int((steps.packs.loads() > capacity).sum())
                row[f"{key}_unequal_steps"] = steps.unequal_steps
        from packctl.online.adapters import get_seqlen_balanced_partitions

        median, fastest = timed(lambda: get_seqlen_balanced_partitions(lengths, d, equal_size=False), args.repeat)
        row["verl_adapter_ms"], row["verl_adapter_fastest_ms"] = 1e3 * median, 1e3 * fastest
        if n <= args.python_up_to:
            start = time.perf_counter()
            python_kk(lengths.tolist(), d, equal_size=False)
            row["python_kk_ranks_ms"] = 1e3 * (time.perf_counter() - start)
            start = time.perf_counter()
            steps = packctl.plan_steps(lengths, d, capacity=capacity, balance="tokens", balance_scope="sequences")
            row["packctl_sequences_ms"] = 1e3 * (time.perf_counter() - start)
            row["packctl_sequences_rank_tokens"] = steps.metrics()["tokens"]["max"]
            as_list = lengths.tolist()
            start = time.perf_counter()
            row["packs_python_ffd"] = len(python_ffd(as_list, capacity))
            row["python_ffd_ms"] = 1e3 * (time.perf_counter() - start)
            start = time.perf_counter()
            ranks = python_kk(as_list, d, equal_size=True)
            over = 0
            for part in ranks:
                part_lengths = [as_list[i] for i in part]
                micro = python_kk(part_lengths, max(1, -(-sum(part_lengths) // capacity)), equal_size=False)
                over += sum(sum(part_lengths[i] for i in m) > capacity for m in micro)
            row["python_kk_ms"] = 1e3 * (time.perf_counter() - start)
            row["python_kk_rank_tokens"] = max_over_mean([sum(as_list[i] for i in p) for p in ranks])
            row["python_kk_rank_attention"] = max_over_mean([sum(as_list[i] ** 2 for i in p) for p in ranks])
            row["python_kk_micro_batches_over_capacity"] = over
        results.append(row)
        print(f"\n{n:,} sequences, {row['tokens']:,} tokens, capacity {capacity}, {d} ranks")
        print(f"  cold  import {row['cold_import_s']:.3f} s + first plan_packs {row['cold_first_call_s'] * 1e3:.1f} ms"
              f" = {row['cold_import_s'] + row['cold_first_call_s']:.3f} s, fastest {row['cold_fastest_s']:.3f} s "
              f"(cached kernels); "
              f"first call {row['cold_uncached_first_call_s']:.2f} s with an empty cache "
              f"({row['cold_uncached_compile_s']:.2f} s compiling)")
        print(f"  warm  median (fastest): plan_packs bfd {row['warm_plan_packs_bfd_ms']:.2f} "
              f"({row['warm_plan_packs_bfd_fastest_ms']:.2f}) ms, ffd {row['warm_plan_packs_ffd_ms']:.2f} "
              f"({row['warm_plan_packs_ffd_fastest_ms']:.2f}) ms; plan_steps {row['warm_plan_steps_ms']:.2f} "
              f"({row['warm_plan_steps_fastest_ms']:.2f}) ms")
        line = (f"  packs ffd {row['packs_ffd']}, bfd {row['packs_bfd']}, lower bound {row['packs_lower_bound']}")
        if "packs_python_ffd" in row:
            line += (f"; Python FFD {row['packs_python_ffd']} in {row['python_ffd_ms']:.1f} ms "
                     f"({row['python_ffd_ms'] / row['warm_plan_packs_ms']:.0f}x packctl's plan_packs)")
        print(line)
        line = (f"  balance per rank max/mean (tokens, attention L^2): plan_steps balance=tokens "
                f"{row['packctl_tokens_rank_tokens']:.4f}, {row['packctl_tokens_rank_attention']:.4f}; balance=attention "
                f"{row['packctl_attention_rank_tokens']:.4f}, {row['packctl_attention_rank_attention']:.4f} "
                f"({row['packctl_micro_batches']} micro-batches a rank, {row['packctl_packs_over_capacity']} over "
                f"capacity)")
        if "python_kk_rank_tokens" in row:
            line += (f"\n          balance=tokens, balance_scope=sequences {row['packctl_sequences_rank_tokens']:.4f} "
                     f"in {row['packctl_sequences_ms']:.1f} ms")
            line += (f"\n          Python KK {row['python_kk_rank_tokens']:.4f}, {row['python_kk_rank_attention']:.4f} in "
                     f"{row['python_kk_ms']:.1f} ms, {row['python_kk_micro_batches_over_capacity']} micro-batches over "
                     f"capacity")
        print(line)
        for balance in ("tokens", "attention"):
            print(f"  ranks balance={balance}: tokens, attention per rank " + "; ".join(
                f"{scope} {row[f'{scope}_{balance}_rank_tokens']:.4f}, {row[f'{scope}_{balance}_rank_attention']:.4f} "
                f"in {row[f'{scope}_{balance}_ms']:.1f} ({row[f'{scope}_{balance}_fastest_ms']:.1f}) ms, "
                f"{row[f'{scope}_{balance}_packs']} packs, {row[f'{scope}_{balance}_over_capacity']} over capacity, "
                f"{row[f'{scope}_{balance}_unequal_steps']} unequal" for scope in ("ranks", "packs"))
                + f" (plan_packs bfd {row['packs_bfd']} packs)")
        line = (f"  verl get_seqlen_balanced_partitions {row['verl_adapter_ms']:.2f} "
                f"({row['verl_adapter_fastest_ms']:.2f}) ms")
        if "python_kk_ranks_ms" in row:
            line += f"; pure-Python Karmarkar-Karp over the ranks {row['python_kk_ranks_ms']:.1f} ms"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

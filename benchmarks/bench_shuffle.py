"""Pack order and epochs under --order shuffle, before and after stratified pack order and exchanges.

    python benchmarks/bench_shuffle.py [--corpus DIR ...] [--algorithms bfd ffd ...] [--epochs 3]

For every corpus and algorithm it plans, exactly as `pack` does (`plan_corpus`, epoch e with its
own seed), `--order shuffle --too-long split` at capacity 4096, twice:

    before   the packs in the order the algorithm opens them, exact decreasing sort
             (`--pack-order planner`, no exchanges: what packctl wrote before)
    after    the defaults: stratified pack order, epochs 1.. exchanging sequences at equal cost

and prints, per row: packs of epoch 0 and the extra packs of "after" (over all epochs); the worst
|Spearman(position, longest sequence)| over windows of at least 20 packs, and over the whole
epoch; the median longest sequence and mean sequences per pack in each quarter of epoch 0; the
share of packs of epochs 1.. (the worst epoch) that repeat a pack of two or more sequences of
epoch 0 (same sample ids), and the share of packs that hold one sequence (or one piece of a split
one): such a pack is that sequence alone in every epoch, whatever the order, and is not counted
as a repeat. Corpora default to
sample_data and three `packctl sample` corpora cached under /tmp/packctl-bench/shuffle (lognormal
and rl-longtail of 40,000 sequences, zipf of 250,000: more than one --window).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packctl.config import PackConfig
from packctl.pipeline.plan import plan_corpus
from packctl.plan.names import ALGORITHMS
from packctl.plan.order import epoch_seed
from packctl.plan.pack_order import TINY_WINDOW, spearman
from packctl.stats.whatif import read_lengths

CACHE = Path("/tmp/packctl-bench/shuffle")
SYNTHETIC = {"lognormal": 40_000, "rl-longtail": 40_000, "zipf": 250_000}


def default_corpora() -> list[Path]:
    from benchmarks.corpus import make_corpus

    found = [Path("sample_data")] if Path("sample_data").is_dir() else []
    for name, n in SYNTHETIC.items():
        found.append(make_corpus(CACHE / name, sequences=n, distribution=name, shards=4))
    return found


def epoch_plans(index, config: PackConfig, epochs: int, before: bool):
    specs = config.specs()
    return [plan_corpus(index, specs.for_epoch(epoch_seed(config.seed, e), exchanges=e > 0 and not before)).plan
            for e in range(epochs)]


def measure(plans) -> dict:
    p0 = plans[0]
    longest = np.maximum.reduceat(p0.piece_len, p0.bin_offsets[:-1])
    count = np.diff(p0.bin_offsets)
    quarters = np.array_split(np.arange(p0.num_bins), 4)
    rhos = [abs(spearman(longest[lo:hi])) for lo, hi in zip(p0.window_bins[:-1], p0.window_bins[1:])
            if hi - lo >= TINY_WINDOW]

    def pack_sets(plan):  # packs of two or more sequences, as sets of sample ids
        return {tuple(sorted(plan.piece_gid[a:b].tolist())) for a, b in zip(plan.bin_offsets[:-1], plan.bin_offsets[1:])
                if b - a > 1}

    first = pack_sets(p0)
    repeats = [len(pack_sets(p) & first) / p.num_bins for p in plans[1:]]
    return {"packs": p0.num_bins, "all_packs": sum(p.num_bins for p in plans),
            "windows": p0.num_windows, "rho_window": max(rhos) if rhos else float("nan"),
            "rho_all": spearman(longest),
            "quarters_longest": [int(np.median(longest[q])) for q in quarters],
            "quarters_seqs": [round(float(count[q].mean()), 1) for q in quarters],
            "repeated": max(repeats) if repeats else 0.0, "alone": float(np.mean(count == 1))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", nargs="*", default=None)
    parser.add_argument("--algorithms", nargs="*", default=[a for a in ALGORITHMS if a != "split"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=4096)
    args = parser.parse_args(argv)
    corpora = [Path(c) for c in args.corpus] if args.corpus else default_corpora()
    print("| corpus | algorithm | packs | extra packs | windows | max window abs(rho) before / after | "
          "rho overall before / after | median longest by quarter before / after | "
          "sequences per pack by quarter before / after | repeated packs before / after | packs of one sequence |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for corpus in corpora:
        index = read_lengths([str(corpus)])
        for algorithm in args.algorithms:
            base = dict(inputs=[str(corpus)], output="/dev/null", capacity=args.capacity, algorithm=algorithm,
                        order="shuffle", too_long="split", epochs=args.epochs)
            old = measure(epoch_plans(index, PackConfig(**base, pack_order="planner"), args.epochs, before=True))
            new = measure(epoch_plans(index, PackConfig(**base), args.epochs, before=False))
            extra = (new["all_packs"] - old["all_packs"]) / old["all_packs"]
            print(f"| {corpus.name} | {algorithm} | {old['packs']:,} | {extra:+.3%} | {new['windows']} | "
                  f"{old['rho_window']:.3f} / {new['rho_window']:.3f} | {old['rho_all']:+.3f} / {new['rho_all']:+.3f} | "
                  f"{old['quarters_longest']} / {new['quarters_longest']} | "
                  f"{old['quarters_seqs']} / {new['quarters_seqs']} | "
                  f"{old['repeated']:.1%} / {new['repeated']:.1%} | {new['alone']:.1%} |", flush=True)


if __name__ == "__main__":
    main()

"""`--source`: how close a blend comes to its target shares, in total and window by window, and
what the blend costs over packing the same tokens from one source.

    python benchmarks/bench_mixture.py [--sequences 40000] [--capacity 8192] [--window 2000] [--order shuffle]
                                       [--no-steps]

Three synthetic sources of skewed sizes (`packctl sample`: web, zipf lengths, many rows; code,
lognormal, a tenth of the rows; math, rl-longtail, a fortieth) blended 0.6 / 0.3 / 0.1 of the
tokens of web alone, so code and math are repeated (caps 4 and 8). The blend is packed with
--plan-only (no token moves: the planning cost, which is where the blend differs) and, for the
cost, the same number of tokens from one corpus of the same lengths. Prints one markdown row per
source: target, realized share, worst |share - target| over the windows, and the tolerance of
docs/mixtures.md for the smallest window; then the seconds of each run and their ratio; then
(unless --no-steps) the worst |share - target| over the optimizer steps of --dp-size 2 x 2
micro-batches for every algorithm and --step-grouping (a tenth of the tokens: one row a pair),
with the mean, the 95th percentile and the worst over the steps of at least half a step's tokens
(a window's last step holds what is left of it, and may be short).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from packctl import PackConfig, pack
from packctl.sample import SampleSpec, write_sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=40_000, help="rows of the largest source (web)")
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--window", type=int, default=2000)
    parser.add_argument("--order", default="shuffle", choices=("input", "shuffle", "curriculum"))
    parser.add_argument("--steps", action=argparse.BooleanOptionalAction, default=True,
                        help="the per-step deviation of every planner (--no-steps: leave it out)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_mixture-"))
    sources = {"web": (args.sequences, "zipf", 0.6, 1.0), "code": (args.sequences // 10, "lognormal", 0.3, 4.0),
               "math": (args.sequences // 40, "rl-longtail", 0.1, 8.0)}
    for seed, (name, (rows, distribution, _, _)) in enumerate(sources.items()):
        write_sample(root / name, SampleSpec(sequences=rows, distribution=distribution, seed=seed + 1,
                                             max_length=args.capacity))
    web_tokens = int(pc.sum(pc.list_value_length(pq.read_table(root / "web", columns=["input_ids"]).column(0))).as_py())
    options = dict(capacity=args.capacity, window=args.window, order=args.order, too_long="split", plan_only=True,
                   overwrite=True)
    blend = {name: {"path": str(root / name), "weight": w, "max_repeat": cap}
             for name, (_, _, w, cap) in sources.items()}
    pack(PackConfig(output=str(root / "warm"), sources=blend, tokens=web_tokens // 10, **options))  # kernels compiled
    started = time.perf_counter()
    result = pack(PackConfig(output=str(root / "blend"), sources=blend, tokens=web_tokens, **options))
    blend_seconds = time.perf_counter() - started
    mixture = result.metrics["mixture"]

    # one source of the blend's uses' lengths, each used once: the same tokens, no blend
    lengths = pq.read_table(root / "blend" / "data", columns=["seq_lens"]).column(0).to_numpy(zero_copy_only=False)
    lengths = np.concatenate(lengths)
    rng = np.random.default_rng(0)
    one = root / "one"
    one.mkdir(exist_ok=True)
    ids = [rng.integers(0, 30000, int(n), dtype=np.int32) for n in lengths]
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), one / "part-0.parquet")
    pack(PackConfig(inputs=[str(one)], output=str(root / "one-warm"), **options))
    started = time.perf_counter()
    single = pack(PackConfig(inputs=[str(one)], output=str(root / "one-out"), **options))
    one_seconds = time.perf_counter() - started

    longest = int(lengths.max())
    print(f"blend of {mixture['size']:,.0f} tokens, --order {args.order}, --window {args.window:,}, "
          f"capacity {args.capacity:,}")
    print("| source | target | realized | worst window deviation | uses | repeats |")
    print("|---|---|---|---|---|---|")
    for s in mixture["sources"]:
        print(f"| {s['name']} | {s['weight']:.4f} | {s['realized']:.4f} | {s['worst_window_deviation']:.4f} | "
              f"{s['uses']:,} | {s['repeats']:.2f} |")
    window_tokens = args.window * float(np.mean(lengths))
    print(f"tolerance (docs/mixtures.md) for a window of the mean {window_tokens:,.0f} tokens: about "
          f"2 x {longest:,} / {window_tokens:,.0f} = {2 * longest / window_tokens:.4f}")
    print(f"pack --plan-only: blend {blend_seconds:.2f}s, one source of the same {len(lengths):,} sequences "
          f"{one_seconds:.2f}s, ratio {blend_seconds / max(one_seconds, 1e-9):.2f}x (the blend scans every row of "
          f"every source: {result.metrics['counts']['sequences_in']:,} uses drawn from "
          f"{sum(s['rows'] for s in mixture['sources']):,} rows)")
    stages = ("scan", "order", "plan", "report")
    print("| stage | " + " | ".join(stages) + " |\n|---|" + "---|" * len(stages))
    for name, timings in (("blend", result.timings), ("one source", single.timings)):
        print(f"| {name} | " + " | ".join(f"{timings[k]:.3f}s" for k in stages) + " |")
    if args.steps:
        print("| algorithm | --step-grouping | worst window deviation | worst step deviation (per source) | "
              "mean step | p95 step | worst step of at least half a step's tokens |")
        print("|---|---|---|---|---|---|---|")
        for algorithm in ("concat", "ffd", "bfd", "ffs", "pool"):
            for grouping in ("cost", "order"):
                steps = pack(PackConfig(output=str(root / "steps"), sources=blend, tokens=web_tokens // 10,
                                        algorithm=algorithm, step_grouping=grouping, dp_size=2, micro_batches=2,
                                        **options)).metrics["mixture"]
                per = ", ".join(f"{s['name']} {s['worst_step_deviation']:.3f}" for s in steps["sources"])
                deviation, tokens = _step_deviations(root / "steps", [s["weight"] for s in steps["sources"]])
                half = tokens >= 2 * 2 * args.capacity / 2  # the short last step of a window left out
                print(f"| {algorithm} | {grouping} | {steps['worst_window_deviation']:.4f} | "
                      f"{steps['worst_step_deviation']:.3f} ({per}) | {deviation.mean():.3f} | "
                      f"{np.quantile(deviation, 0.95):.3f} | {deviation[half].max():.3f} |")


def _step_deviations(out: Path, weights: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Each step's worst |share - weight| over the sources, and its tokens, from the shards'
    `step`, `seq_lens` and `source_ids` columns."""
    table = pq.read_table(out / "data", columns=["seq_lens", "source_ids", "step"])
    per_pack = np.array([len(x) for x in table.column("seq_lens").to_pylist()])
    lens = np.concatenate(table.column("seq_lens").to_numpy(zero_copy_only=False))
    source = np.concatenate(table.column("source_ids").to_numpy(zero_copy_only=False))
    steps, at = np.unique(np.repeat(table.column("step").to_numpy(), per_pack), return_inverse=True)
    tokens = np.zeros((len(steps), len(weights)))
    np.add.at(tokens, (at, source), lens)
    total = tokens.sum(axis=1)
    return np.abs(tokens / total[:, None] - np.asarray(weights)).max(axis=1), total


if __name__ == "__main__":
    main()

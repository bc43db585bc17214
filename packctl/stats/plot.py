"""`packctl stats --plot FILE.png`: the report as one PNG (matplotlib, the `plot` extra).

Three panels, left to right:

    raw input       length histogram (capacities marked) | pack fill of the best what-if | what-if bars
    packed output   length histogram | pack fill | sequences per pack
    side by side    length histograms | pack fills | utilization and efficiency of each output

Drawn on a Figure with the Agg canvas directly, so no GUI backend and no pyplot global state.
"""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from packctl.cachedir import user_cache_dir, writable
from packctl.errors import PackctlError, require

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
BASELINE_COLOR = "#B0B0B0"


def write_plot(report: dict[str, Any], path: str | Path) -> Path:
    """Draw `report` (from `packctl.stats.stats`) into a PNG at `path`; returns the path."""
    _matplotlib_config_dir()
    require("matplotlib", "plot", "packctl stats --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(15, 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3, width_ratios=[1, 0.85, 1.3])
    kind = report["kind"]
    if kind == "input":
        _input(fig, axes, report)
    elif kind == "packed":
        _packed(fig, axes, report)
    elif kind == "epochs":  # the epochs of one OUT side by side
        _compare(fig, axes, {"outputs": report["epochs"]})
    else:
        _compare(fig, axes, report)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    # A 128-colour palette keeps the PNG a third of the size, with no visible change on flat charts.
    from PIL import Image  # a dependency of matplotlib

    image = Image.open(buffer).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT,
                                                       dither=Image.Dither.NONE)
    try:
        image.save(path, format="png", optimize=True)
    except OSError as exc:
        raise PackctlError(f"{path}: cannot write the plot ({exc.strerror or exc}); choose another --plot path") from None
    return path


def _matplotlib_config_dir() -> None:
    """Matplotlib keeps its font list in its config directory, and warns on stderr (rebuilding the
    list, seconds) when that cannot be written (an unwritable HOME): give it a cache directory of
    packctl's then. A user's MPLCONFIGDIR, or matplotlib already loaded, is left alone."""
    if "MPLCONFIGDIR" in os.environ or "matplotlib" in sys.modules:
        return
    config = os.environ.get("XDG_CONFIG_HOME")
    try:
        default = os.path.join(config if config and os.path.isabs(config) else os.path.join(Path.home(), ".config"),
                               "matplotlib")
    except (RuntimeError, KeyError):  # no HOME
        default = ""
    if not (default and writable(default)):
        folder = user_cache_dir("matplotlib")
        if folder is not None:
            os.environ["MPLCONFIGDIR"] = folder


def _length_axes(ax, histograms: list[tuple[str, dict[str, list[int]]]], capacities: list[int] = ()) -> None:
    """Power-of-two length buckets as bars; several histograms are grouped and drawn as shares."""
    top = max(len(h["counts"]) for _, h in histograms)
    edges = next(h["edges"] for _, h in histograms if len(h["counts"]) == top)
    x = np.arange(top)
    width = 0.8 / len(histograms)
    shares = len(histograms) > 1
    for k, (label, h) in enumerate(histograms):
        counts = np.zeros(top)
        counts[:len(h["counts"])] = h["counts"]
        if shares:
            counts = 100 * counts / max(counts.sum(), 1)
        ax.bar(x + (k - (len(histograms) - 1) / 2) * width, counts, width, color=COLORS[k % len(COLORS)],
               label=label if shares else None)
    ax.set_xticks(x, [_short_int(e) for e in edges[:top]], rotation=60, fontsize=8)
    ax.set_xlabel("sequence length (bucket [2^k, 2^(k+1)))")
    ax.set_ylabel("% of sequences" if shares else "sequences")
    ax.set_title("length histogram")
    for j, capacity in enumerate(capacities):
        position = np.log2(capacity) - 0.5  # bucket k is centred on k; its lower edge 2^k sits at k - 0.5
        ax.axvline(position, color="#C44E52", linestyle="--", linewidth=1)
        ax.annotate(f"C={_short_int(capacity)}", (position, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12 - 11 * j), textcoords="offset points", color="#C44E52", fontsize=8)
    if len(histograms) > 1:
        ax.legend(fontsize=8)


def _fill_axes(ax, histograms: list[tuple[str, dict[str, list]]], title: str) -> None:
    """Fill buckets (finer near full) as bars; several histograms are grouped and drawn as shares."""
    edges = histograms[0][1]["edges"]
    buckets = len(edges) - 1
    x = np.arange(buckets)
    width = 0.8 / len(histograms)
    shares = len(histograms) > 1
    for k, (label, h) in enumerate(histograms):
        counts = np.asarray(h["counts"], dtype=np.float64)
        if shares:
            counts = 100 * counts / max(counts.sum(), 1)
        ax.bar(x + (k - (len(histograms) - 1) / 2) * width, counts, width, color=COLORS[k % len(COLORS)],
               label=label if shares else None)
    ax.set_xticks(x, [f"{a:.0%}-{b:.0%}" for a, b in zip(edges[:-1], edges[1:])], rotation=60, fontsize=8)
    ax.set_yscale("log")  # the few packs that are not full are the interesting ones
    ax.set_xlabel("fill: true tokens / capacity (finer near full)")
    ax.set_ylabel("% of packs (log)" if shares else "packs (log)")
    ax.set_title(title)
    if len(histograms) > 1:
        ax.legend(fontsize=8)


def _input(fig, axes, r: dict[str, Any]) -> None:
    best = next(w for w in r["what_if"]
                if w["capacity_flag"] == r["best"]["capacity"] and w["algorithm"] == r["best"]["algorithm"])
    _length_axes(axes[0], [("input", r["length_histogram"])], [c["capacity"] for c in r["capacities"]])
    _fill_axes(axes[1], [("best", best["fill_histogram"])],
               f"pack fill: {best['algorithm']} at capacity {_short_int(best['capacity'])}")

    ax = axes[2]
    labels, values, colors, edge = [], [], [], []
    for c, cap in enumerate(r["capacities"]):
        rows = [w for w in r["what_if"] if w["capacity_flag"] == cap["capacity"]]
        for k, w in enumerate(rows):
            suffix = f"\n{_short_int(cap['capacity'])}" if len(r["capacities"]) > 1 else ""
            labels.append(w["algorithm"] + suffix)
            values.append(100 * w["utilization"])
            colors.append(COLORS[k % len(COLORS)])
            edge.append(w is best)
        labels.append("padded" + (f"\n{_short_int(cap['capacity'])}" if len(r["capacities"]) > 1 else ""))
        values.append(100 * cap["padded_batching"]["utilization"])
        colors.append(BASELINE_COLOR)
        edge.append(False)
    x = np.arange(len(values))
    bars = ax.bar(x, values, color=colors, edgecolor=["black" if e else "none" for e in edge],
                  linewidth=[2 if e else 0 for e in edge])
    for rect, value, is_best in zip(bars, values, edge):
        # Inside the bar, upright: a dozen bars side by side leave no room for level labels.
        ax.annotate(f"{value:.2f}%", (rect.get_x() + rect.get_width() / 2, value), xytext=(0, -4),
                    textcoords="offset points", ha="center", va="top", rotation=90, fontsize=8, color="white",
                    fontweight="bold" if is_best else "normal")
    labels = [label.replace("\n", " ★\n", 1) if is_best and "\n" in label else label + (" ★" if is_best else "")
              for label, is_best in zip(labels, edge)]
    ax.set_xticks(x, labels, fontsize=8, rotation=45)
    ax.set_ylim(0, 108)
    ax.set_ylabel("utilization %: true / computed tokens")
    ax.set_title("what if: every algorithm vs padded batching")
    fig.suptitle(f"packctl stats: {r['sequences']:,} sequences, {r['tokens']:,} tokens — recommended "
                 f"{best['algorithm']} at capacity {best['capacity']:,}", fontsize=11)


def _packed(fig, axes, r: dict[str, Any]) -> None:
    _length_axes(axes[0], [("packed", r["length_histogram"])], [r["capacity"]])
    _fill_axes(axes[1], [("packs", r["fill_histogram"])], "pack fill")
    ax = axes[2]
    histogram = r["sequences_per_pack"]["histogram"]
    ax.bar(np.arange(len(histogram)), histogram, width=0.9, color=COLORS[2])
    ax.set_xlabel("sequences in the pack")
    ax.set_ylabel("packs")
    ax.set_title("sequences per pack")
    fig.suptitle(f"packctl stats {r['path']}: {r['algorithm']}, {r['packs']:,} packs of {r['capacity']:,}, "
                 f"utilization {r['utilization']:.2%}, efficiency {r['packing_efficiency']:.2%}", fontsize=11)


def _compare(fig, axes, r: dict[str, Any]) -> None:
    outputs = r["outputs"]
    names = [o["path"] for o in outputs]
    _length_axes(axes[0], [(n, o["length_histogram"]) for n, o in zip(names, outputs)])
    _fill_axes(axes[1], [(n, o["fill_histogram"]) for n, o in zip(names, outputs)], "pack fill")
    ax = axes[2]
    metrics = [("utilization", "utilization"), ("packing_efficiency", "efficiency"), ("bin_balance", "bin balance")]
    x = np.arange(len(metrics))
    width = 0.8 / len(outputs)
    for k, (name, o) in enumerate(zip(names, outputs)):
        values = [100 * o[m] for m, _ in metrics]
        bars = ax.bar(x + (k - (len(outputs) - 1) / 2) * width, values, width, color=COLORS[k % len(COLORS)],
                      label=name)
        for rect, value in zip(bars, values):
            ax.annotate(f"{value:.2f}", (rect.get_x() + rect.get_width() / 2, value), xytext=(0, 2),
                        textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks(x, [label for _, label in metrics])
    ax.set_ylim(0, 108)
    ax.set_ylabel("percent (bin balance x 100)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("side by side")
    fig.suptitle("packctl stats: " + " vs ".join(names), fontsize=11)


def _short_int(value: int) -> str:
    """4096 -> '4k', 1000 -> '1000', 65536 -> '64k', 1048576 -> '1M'."""
    value = int(value)
    if value >= 2**20 and value % 2**20 == 0:
        return f"{value // 2**20}M"
    if value >= 2**10 and value % 2**10 == 0:
        return f"{value // 2**10}k"
    return str(value)

"""Terminal output: a progress display per stage and the summary table of a pack run."""
from __future__ import annotations

from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgressBar, TextColumn, TimeElapsedColumn
from rich.table import Table

from packctl.pipeline import PackResult, Progress


class RichProgress(Progress):
    """One progress line per stage, on stderr."""

    def __init__(self, console: Console):
        self._bar = RichProgressBar(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), console=console, transient=False)
        self._bar.start()
        self._previous = None

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        if self._previous is not None:
            task = self._bar.tasks[self._previous]
            self._bar.update(self._previous, total=task.completed or 1, completed=task.completed or 1)
        task_id = self._bar.add_task(name, total=total)
        self._previous = task_id
        return lambda n: self._bar.advance(task_id, n)

    def close(self) -> None:
        if self._previous is not None:
            task = self._bar.tasks[self._previous]
            self._bar.update(self._previous, total=task.completed or 1, completed=task.completed or 1)
        self._bar.stop()


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def summary_table(result: PackResult) -> Table:
    m: dict[str, Any] = result.metrics
    c = result.counts
    pad = m["padding"]
    spp = m["sequences_per_pack"]
    table = Table(title=f"packctl pack -> {result.output}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("algorithm / order", f"{m['algorithm']} / {m['order']}"),
        ("sequences in -> packed", f"{c['sequences_in']:,} -> {c['sequences_packed']:,}"),
        ("dropped / truncated / split", f"{c['sequences_dropped']:,} / {c['sequences_truncated']:,} / "
                                        f"{c['sequences_split']:,}"),
        ("tokens packed", f"{c['tokens_packed']:,} of {c['tokens_in']:,}"),
        ("packs (lower bound)", f"{m['packs']:,} ({m['lower_bound_packs']:,})"),
        ("utilization", _pct(m["utilization"])),
        ("packing efficiency", _pct(m["packing_efficiency"])),
        ("bin balance", f"{m['bin_balance']:.4f}"),
        ("padding: alignment / tail", f"{pad['alignment_tokens']:,} / {pad['tail_tokens']:,}"),
        ("sequences per pack", f"{spp['min']} / {spp['mean']:.2f} / {spp['max']} (min/mean/max)"),
        ("vs padded batching", f"{m['padded_batching']['estimated_gain']:.2f}x fewer tokens"),
        ("shards", f"{len(result.shards)}"),
        ("time", "  ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())),
        ("throughput", f"{m['throughput']['sequences_per_s']:,.0f} seq/s, "
                       f"{m['throughput']['tokens_per_s'] / 1e6:,.1f} M tok/s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table

"""Terminal output: a progress display per stage (bars on a terminal, log lines elsewhere) and the
summary table of a pack run."""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

from rich.console import Console
from rich.measure import Measurement
from rich.progress import (BarColumn, Progress as RichProgressBar, ProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from packctl.runtime import Progress

if TYPE_CHECKING:  # the stats and verify reports need none of the packing pipeline
    from packctl.pipeline import PackResult


# What each stage counts: pack's stages, verify's checks, sample's and export's writing.
STAGE_UNITS = {"scan": "blocks", "plan": "sequences", "materialize": "packs",
               "structure": "shards", "conservation": "files", "attention": "packs",
               "write": "shards", "export": "shards"}


def counted(n: int, unit: str) -> str:
    """A count and its unit, singular for one: counted(1, 'blocks') -> '1 block', 2,000 sequences."""
    if n == 1 and unit.endswith("s"):
        unit = unit[:-1]
    return f"{n:,} {unit}".rstrip()


def rate(per_second: float) -> str:
    """A rate that never reads 0 when something was done: three significant digits under 100
    (0.5, 8.25, 42.1, 25), whole numbers with separators above (1,234)."""
    return f"{per_second:,.0f}" if per_second >= 99.95 else f"{per_second:.3g}"


class _Rate(ProgressColumn):
    """Items per second of a stage, in its unit: '1,234 packs/s', '0.5 blocks/s'."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        unit = task.fields.get("unit", "")
        return Text(f"{rate(speed)} {unit}/s" if speed else f"- {unit}/s", style="dim")


class _Count(ProgressColumn):
    """Done/total of a stage with thousands separators: '25,899/36,910' (done alone when the total
    is not known)."""

    def render(self, task) -> Text:
        done = f"{int(task.completed):,}"
        return Text(done if task.total is None else f"{done}/{int(task.total):,}", style="progress.download")


# Columns the bars leave free at the right of the terminal: the terminal echoes Ctrl-C as "^C"
# after the last bar; on a full-width line that wraps, and the live display, one line off, then
# redraws its first bar below the old one.
ECHO_ROOM = 2


class _Bars(RichProgressBar):
    """rich's progress bars, drawn ECHO_ROOM columns narrower than the terminal."""

    def __init__(self, *columns, console: Console, **options):
        self._terminal = console
        super().__init__(*columns, console=console, **options)

    def get_renderables(self):
        from rich.constrain import Constrain

        yield Constrain(self.make_tasks_table(self.tasks), width=max(self._terminal.width - ECHO_ROOM, 20))


class RichProgress(Progress):
    """One progress bar per stage, on stderr: done/total in the stage's unit, rate, elapsed, ETA.
    A stage that ends shows its full bar; a stage stopped (Ctrl-C, an error) keeps its bar at the
    count it reached."""

    def __init__(self, console: Console):
        self._bar = _Bars(TextColumn("{task.description:<12}"), BarColumn(),
                          _Count(),
                          TextColumn("{task.fields[unit]}"), _Rate(), TimeElapsedColumn(),
                          TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)
        self._bar.start()
        self._previous = None
        self._closed = False

    def _end_previous(self) -> None:
        """The stage before ends complete: its bar full at the count it reached (a total counted
        ahead, such as blocks of which some were empty, is not left short)."""
        if self._previous is not None:
            task = self._bar.tasks[self._previous]
            done = task.completed or task.total or 1
            self._bar.update(self._previous, total=done, completed=done)

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        self._end_previous()
        task_id = self._bar.add_task(name, total=total, unit=STAGE_UNITS.get(name, ""))
        self._previous = task_id
        return lambda n: self._bar.advance(task_id, n)

    def close(self, stopped: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not stopped:
            self._end_previous()
        elif self._previous is not None:
            self._bar.stop_task(self._previous)  # its bar stays at the count reached, its clock stops
        self._bar.stop()


def compile_seconds() -> float:
    """Seconds spent compiling kernels so far (0 while none is loaded: packctl.jit counts them)."""
    jit = sys.modules.get("packctl.jit")
    return jit.compile_seconds() if jit is not None else 0.0


class LogProgress(Progress):
    """Progress as log lines, for runs without a terminal (Slurm logs, CI): a line when a stage
    starts and ends, and one every `interval` seconds in between with done/total, rate and ETA.

        packctl: materialize 12,800/36,982 packs (35%), 2,310 packs/s, eta 10s
    """

    def __init__(self, stream: TextIO | None = None, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._stream, self._interval, self._clock = stream or sys.stderr, interval, clock
        self._lock = threading.Lock()
        self._stage: list | None = None  # [name, total, done, started, last line, compile seconds at start]
        self._closed = False

    def _line(self, text: str) -> None:
        print(f"packctl: {text}", file=self._stream, flush=True)

    def _finish(self, stopped: bool = False) -> None:
        if self._stage is not None:
            name, total, done, started, _, compiled = self._stage
            seconds = self._clock() - started
            compiling = min(compile_seconds() - compiled, seconds)
            unit = STAGE_UNITS.get(name, "")
            working = seconds - compiling
            speed = f", {rate(done / working)} {unit}/s" if working > 0 and unit and done else ""
            if compiling >= 0.05:
                speed += f" (after {compiling:.1f}s compiling kernels, once per install)"
            if stopped:
                of = f" of {total:,}" if total else ""
                self._line(f"{name} stopped: {counted(done, unit)}{of} in {seconds:.1f}s{speed}")
            elif unit:
                self._line(f"{name} done: {counted(done, unit)} in {seconds:.1f}s{speed}")
            else:  # a stage of no countable parts
                self._line(f"{name} done in {seconds:.1f}s")
            self._stage = None

    def stage(self, name: str, total: int | None) -> Callable[[int], None]:
        with self._lock:
            self._finish()
            now = self._clock()
            self._stage = [name, total, 0, now, now, compile_seconds()]
            unit = STAGE_UNITS.get(name, "")
            self._line(f"{name}: {counted(total, unit)}" if total is not None else f"{name}")
        return self._advance

    def _advance(self, n: int) -> None:
        with self._lock:
            if self._stage is None:
                return
            self._stage[2] += n
            name, total, done, started, last, _ = self._stage
            now = self._clock()
            if now - last < self._interval:
                return
            self._stage[4] = now
            unit = STAGE_UNITS.get(name, "")
            speed = done / (now - started) if now > started else 0.0
            text = f"{name} {done:,}/{total:,} {unit}".rstrip() if total else f"{name} {counted(done, unit)}"
            if total:
                text += f" ({done / total:.0%})"
            if speed:
                text += f", {rate(speed)} {unit}/s"
                if total and done < total:
                    text += f", eta {(total - done) / speed:.0f}s"
            self._line(text)

    def close(self, stopped: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._finish(stopped)


@contextmanager
def command_progress(err: Console | None) -> Iterator[Progress | None]:
    """The progress bars of a long command (verify, sample, export) on `err` when it is a terminal;
    None (nothing shown) for --json, -q, and without a terminal, so that a pipe or a log holds
    the command's result and nothing else (an error stays one line). An exception leaves the
    stage it stopped in where it stopped.

        with command_progress(console(stderr=True)) as progress:
            export(..., progress=progress)
    """
    if err is None or not err.is_terminal:
        yield None
        return
    progress = RichProgress(err)
    try:
        yield progress
    except BaseException:
        progress.close(stopped=True)
        raise
    progress.close()


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _groups_row(g: dict[str, Any]) -> tuple[str, str]:
    where = "one pack" if g["scope"] == "pack" else "one step"
    spread = g["packs_per_group"]
    return ("groups", f"{g['groups']:,} kept within {where} ({g['groups_of_two_or_more']:,} of 2+ members), "
                      f"packs per group {spread['mean']:.2f} / {spread['max']} (mean/max)")


def _tokens_row(result: PackResult) -> tuple[str, str]:
    """Tokens packed of the tokens in: per epoch with --epochs (each epoch packs the input once),
    planned with --plan-only (no token moved).

        tokens packed   1,170,955 of 1,170,955 per epoch (x3: 3,512,865)
    """
    c, m = result.counts, result.metrics
    label = "tokens planned" if result.plan_only else "tokens packed"
    epochs = m.get("epochs")
    if not epochs:
        return label, f"{c['tokens_packed']:,} of {c['tokens_in']:,}"
    per_epoch = {e["tokens_packed"] for e in epochs}
    each = f"{per_epoch.pop():,}" if len(per_epoch) == 1 else "/".join(f"{e['tokens_packed']:,}" for e in epochs)
    return label, f"{each} of {c['tokens_in']:,} per epoch (x{len(epochs)}: {c['tokens_packed']:,})"


def _throughput_row(result: PackResult) -> tuple[str, str]:
    """Sequences and tokens a second of this run: with --plan-only the tokens were planned, not
    moved; a resumed run leaves out the tokens of the shards it kept (metrics.json `throughput`)."""
    speed = result.metrics["throughput"]
    text = f"{speed['sequences_per_s']:,.0f} seq/s, {speed['tokens_per_s'] / 1e6:,.1f} M tok/s"
    if result.plan_only:
        text += " planned"
    notes = []
    if result.timings.get("compile", 0) >= 0.01:
        notes.append("compiling left out")
    if speed.get("resumed_shards"):
        notes.append(f"{counted(speed['resumed_shards'], 'shards')} kept from the interrupted run left out")
    return "throughput", text + (f" ({'; '.join(notes)})" if notes else "")


def pack_table(result: PackResult) -> Table:
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
                                        f"{c['sequences_split']:,}"
                                        + (f" ({c['over_limit']:,} dropped over a --limit)" if c.get("over_limit")
                                           else "")),
        _tokens_row(result),
        ("packs (lower bound)", f"{m['packs']:,} ({m['lower_bound_packs']:,})"),
        ("utilization", _pct(m["utilization"])),
        ("packing efficiency", _pct(m["packing_efficiency"])),
        ("bin balance", f"{m['bin_balance']:.4f}"),
        ("padding: alignment / tail", f"{pad['alignment_tokens']:,} / {pad['tail_tokens']:,}"),
        ("sequences per pack", f"{spp['min']} / {spp['mean']:.2f} / {spp['max']} (min/mean/max)"),
        ("vs padded batching", f"{m['padded_batching']['estimated_gain']:.2f}x fewer tokens"),
        *([_groups_row(m["groups"])] if "groups" in m else []),
        *([("epochs", f"{len(m['epochs'])}, one output each: {result.output}/epoch-00000 ... (sequences: of "
                      "each epoch; tokens, packs: of all)")] if "epochs" in m else []),
        ("shards", f"{len(result.shards)}"),
        ("time", "  ".join(f"{k} {v:.2f}s" for k, v in result.timings.items() if k != "compile" or v >= 0.01)),
        _throughput_row(result),
    ]
    b = m.get("balance")
    if b:
        rows += [
            ("DP balance", f"{b['steps']:,} steps x {b['dp_size']} ranks, {b['cost']} (a={b['attn_coeff']:g})"),
            ("  attention max/mean", f"{b['before']['attention']['mean']:.3f} -> {b['after']['attention']['mean']:.3f} "
                                     f"(worst step {b['after']['attention']['max']:.3f})"),
            ("  tokens max/mean", f"{b['before']['tokens']['mean']:.3f} -> {b['after']['tokens']['mean']:.3f}"),
        ]
    if m.get("limits"):
        from packctl.stats.packed import binding_of  # here: --help loads no stats code

        rows += limit_rows({**m, "layout": {"capacity": m["capacity"]}, "binding": binding_of(m)})
    rows += blend_rows(m.get("mixture"))
    rows += share_prefix_rows(m.get("share_prefix"), m["counts"])
    rows += scale_out_rows(m.get("scale_out"))
    for key, value in rows:
        table.add_row(key, value)
    return table


def blend_rows(mixture: dict[str, Any] | None) -> list[tuple[str, str]]:
    """--source: one row per source, its realized share against its weight, its worst window
    (and step) deviation, its uses and repeats. None without a blend."""
    if not mixture:
        return []
    rows = [("blend", f"share of {mixture['unit']}, worst window ±{mixture['worst_window_deviation']:.2%}"
                      + (f", worst step ±{mixture['worst_step_deviation']:.2%}"
                         if mixture.get("worst_step_deviation") is not None else ""))]
    for src in mixture["sources"]:
        rows.append((f"  {src['name']}", f"{src['realized']:.2%} of target {src['weight']:.2%}, {src['uses']:,} uses "
                                         f"of {src['rows_used']:,} rows ({src['repeats']:.2f} passes, cap "
                                         f"{src['max_repeat']:g})"))
    return rows


def tokenize_table(result) -> Table:
    """The summary of `packctl tokenize`: what was read, written and dropped, and how fast."""
    c, t = result.counts, result.metrics.get("throughput") or {}
    table = Table(title=f"packctl tokenize -> {result.output}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right", overflow="fold")
    rows = [
        ("records in -> rows out", f"{c['records']:,} -> {c['rows']:,}"),
        ("tokens (trained on)", f"{c['tokens']:,} ({c['loss_tokens']:,})"),
        ("masked fraction", _pct(c["masked_fraction"])),
        ("dropped", f"{c['dropped']:,}" + "".join(f"\n{n:,} {reason}" for reason, n in c["dropped_by_reason"].items())),
        ("shards", f"{len(result.shards)}"),
    ]
    if t.get("tokens_per_s"):
        rows.append(("throughput", f"{t['tokens_per_s'] / 1e6:,.2f} M tok/s, {t['records_per_s']:,.0f} records/s "
                                   f"({t['workers']} worker{'s' if t['workers'] != 1 else ''} x {t['ranks']} "
                                   f"rank{'s' if t['ranks'] != 1 else ''})"))
    for key, value in rows:
        table.add_row(key, value)
    return table


def scale_out_rows(so: dict[str, Any] | None) -> list[tuple[str, str]]:
    """How evenly the ranks of an MPI run shared it (metrics.json `scale_out`); none for one process."""
    if not so:
        return []
    stages = so["stage_seconds"]
    return [
        ("ranks", f"{so['ranks']}, tokens by {so['token_transfer']} (reads would decode "
                  f"{so['read_amplification']:.2f}x), {so['bytes_exchanged'] / 2**20:,.1f} MiB exchanged"),
        ("  tokens written max/mean", f"{so['tokens_written']['max_over_mean']:.3f} "
                                      f"({so['tokens_written']['max']:,.0f} / {so['tokens_written']['mean']:,.0f})"),
        ("  seconds max/mean", "  ".join(f"{k} {v['max']:.2f}/{v['mean']:.2f}" for k, v in stages.items())),
    ]


# --- packctl stats ------------------------------------------------------------------------------

_EIGHTHS = " ▏▎▍▌▋▊▉"
BAR_WIDTH = 28


def bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of block characters, `width` cells for `top`: bar(3, 4, 4) -> '███'."""
    if top <= 0 or value <= 0:
        return ""
    eighths = max(1, round(8 * width * value / top))  # anything above zero shows
    return "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")


def histogram_table(title: str, labels: list[str], counts: list[int], *, width: int = BAR_WIDTH,
                    weights: list[int] | None = None) -> Histogram:
    """Label, bar, count and share of each bucket (and the share of `weights`, e.g. tokens)."""
    return Histogram(title, labels, counts, width=width, weights=weights)


class Histogram:
    """A histogram table (`histogram_table`) drawn within the width it is printed in: its bars
    are `width` cells at most, shorter where the terminal is narrow (at least `MIN_BAR`), so
    that labels and numbers stay whole on one line."""

    MIN_BAR = 4

    def __init__(self, title: str, labels: list[str], counts: list[int], *, width: int = BAR_WIDTH,
                 weights: list[int] | None = None) -> None:
        self.title, self.labels, self.counts, self.width, self.weights = title, labels, counts, width, weights

    def table(self, width: int) -> Table:
        """The table with bars `width` cells long at most."""
        table = Table(title=self.title, title_justify="left", show_header=False, box=None, padding=(0, 1))
        table.add_column(justify="right", style="dim", overflow="fold")
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(justify="right", overflow="fold")
        table.add_column(justify="right", style="dim", overflow="fold")
        if self.weights is not None:
            table.add_column(justify="right", overflow="fold")
        total = sum(self.counts) or 1
        weight_total = sum(self.weights or []) or 1
        top = max(self.counts, default=0)
        for k, (label, count) in enumerate(zip(self.labels, self.counts)):
            cells = [label, bar(count, top, width), f"{count:,}", f"{count / total:.1%}"]
            if self.weights is not None:
                cells.append(f"{self.weights[k] / weight_total:.1%} of tokens")
            table.add_row(*cells)
        return table

    def _bar_width(self, console, options) -> int:
        full = _natural_width(console, options, self.table(self.width))
        return max(self.MIN_BAR, self.width - max(0, full - options.max_width))

    def __rich_console__(self, console, options):
        yield self.table(self._bar_width(console, options))

    def __rich_measure__(self, console, options) -> Measurement:
        widest = Measurement.get(console, options, self.table(self.width))
        return Measurement(Measurement.get(console, options, self.table(self.MIN_BAR)).maximum, widest.maximum)


class FittedTable:
    """A rich Table (built as one: `add_column`, `add_row`) drawn within the width it is printed
    in, no number cut: the columns that do not fit beside the others go to a second table (a
    third ...), as many in each, each table repeating the first `keys` columns, which name the
    rows. The what-if of the README at 60 columns:

             C  algorithm    packs     +L2    util    effic
         8,192  concat      30,276  +4,828  83.99%   84.05%
        ...
             C  algorithm       padding   split   plan
         8,192  concat       39,709,039   2,458  0.01s

    A cell wider than even its column beside the keys folds onto the next line, whole."""

    def __init__(self, *, keys: int = 1, **options: Any) -> None:
        self.keys, self.options = keys, options
        self.columns: list[tuple[str, dict[str, Any]]] = []
        self.rows: list[tuple[tuple[str, ...], dict[str, Any]]] = []

    def add_column(self, header: str = "", **options: Any) -> None:
        self.columns.append((header, options))

    def add_row(self, *cells: Any, **options: Any) -> None:
        self.rows.append((cells, options))

    def table(self, picked: list[int] | None = None, *, first: bool = True) -> Table:
        """The table of the columns `picked` (all by default); the title only on the first."""
        picked = list(range(len(self.columns))) if picked is None else picked
        table = Table(**{**self.options, **({} if first else {"title": None})})
        for k in picked:
            header, options = self.columns[k]
            table.add_column(header, **{**options, "no_wrap": False, "overflow": "fold"})
        for cells, options in self.rows:
            table.add_row(*(cells[k] if k < len(cells) else "" for k in picked), **options)
        return table

    def tables(self, console, options) -> list[Table]:
        """As many tables as the width needs, the columns in their order."""
        def fits(picked: list[int]) -> bool:
            return _natural_width(console, options, self.table(picked)) <= options.max_width

        every = list(range(len(self.columns)))
        if fits(every):
            return [self.table(every)]
        keys, rest = every[:self.keys], every[self.keys:]
        groups: list[list[int]] = [[]]
        for k in rest:  # as many columns in each table as fit, in order
            if groups[-1] and not fits(keys + groups[-1] + [k]):
                groups.append([])
            groups[-1].append(k)
        size = -(-len(rest) // len(groups))  # as many tables, and as many columns in each as may be
        even = [rest[i:i + size] for i in range(0, len(rest), size)]
        if len(even) == len(groups) and all(fits(keys + group) for group in even):
            groups = even
        return [self.table(keys + group, first=i == 0) for i, group in enumerate(groups)]

    def __rich_console__(self, console, options):
        yield from self.tables(console, options)

    def __rich_measure__(self, console, options) -> Measurement:
        return Measurement.get(console, options, self.table())


def _natural_width(console, options, table: Table) -> int:
    """The width `table` takes where nothing bounds it (rich's measure stops at the width given)."""
    return Measurement.get(console, options.update_width(_UNBOUNDED), table).maximum


_UNBOUNDED = 100_000


def _trimmed(edges: list, counts: list[int]) -> tuple[list, list[int]]:
    """Buckets from the first to the last non-empty one: (lower edges + last upper edge, counts)."""
    nonzero = [i for i, c in enumerate(counts) if c]
    if not nonzero:
        return edges[:1], []
    lo, hi = nonzero[0], nonzero[-1] + 1
    return edges[lo:hi + 1], counts[lo:hi]


def length_histogram_table(histogram: dict[str, list[int]], title: str = "sequence lengths") -> Table:
    """Sequences per length bucket, with each bucket's share of the sequences and of the tokens."""
    nonzero = [i for i, c in enumerate(histogram["counts"]) if c]
    lo = nonzero[0] if nonzero else 0
    edges, counts = _trimmed(histogram["edges"], histogram["counts"])
    tokens = histogram.get("tokens")
    labels = [f"{a:,} - {b - 1:,}" for a, b in zip(edges[:-1], edges[1:])]
    return histogram_table(title, labels, counts, weights=tokens[lo:lo + len(counts)] if tokens else None)


def fill_histogram_table(histogram: dict[str, list], title: str = "pack fill (true tokens / capacity)") -> Table:
    edges, counts = histogram["edges"], histogram["counts"]
    first = next((i for i, c in enumerate(counts) if c), len(counts) - 1)  # empty low buckets say nothing
    labels = [f"[{a:.0%}, {b:.0%}" + ("]" if i == len(counts) - 1 else ")")
              for i, (a, b) in enumerate(zip(edges[:-1], edges[1:]))]
    return histogram_table(title, labels[first:], counts[first:])


def per_pack_histogram_table(histogram: list[int], title: str = "sequences per pack", buckets: int = 12) -> Table:
    """The bincount of sequences per pack, grouped into at most `buckets` ranges."""
    lo = next((i for i, c in enumerate(histogram) if c), 0)
    values = histogram[lo:]
    step = max(1, -(-len(values) // buckets))
    labels, counts = [], []
    for k in range(0, len(values), step):
        a, b = lo + k, lo + min(k + step, len(values)) - 1
        labels.append(f"{a}" if a == b else f"{a} - {b}")
        counts.append(sum(values[k:k + step]))
    return histogram_table(title, labels, counts)


def _packs_line(m: dict[str, Any]) -> str:
    return (f"{m['packs']:,}  (lower bounds: ceil(sum/C) {m['lower_bound_packs']:,}, "
            f"Martello-Toth L2 {m['lower_bound_packs_l2']:,})")


def _lengths_line(lengths: dict[str, Any]) -> str:
    p = lengths["percentiles"]
    return (f"min {lengths['min']:,} · mean {lengths['mean']:,.1f} · "
            + " · ".join(f"{k} {v:,}" for k, v in p.items()) + f" · max {lengths['max']:,}")


def _padding_line(pad: dict[str, Any]) -> str:
    return (f"alignment {pad['alignment_tokens']:,} + tail {pad['tail_tokens']:,} = "
            f"{_pct(pad['fraction_of_written'])} of {pad['written_tokens']:,} written")


def _gain_line(pb: dict[str, Any]) -> str:
    return (f"{pb['estimated_gain']:.2f}x fewer tokens ({pb['tokens']:,} in padded batches of {pb['batch_size']} "
            f"vs {pb['packed_tokens']:,} packed)")


def _order_line(q: dict[str, Any] | None) -> str:
    """Spearman(position, longest sequence): overall and the worst window (docs/stats.md)."""
    if not q:
        return "n/a"
    line = f"Spearman(position, longest sequence) {q['spearman_overall']:+.3f} overall"
    if not q["windows_recorded"]:
        return line + " (windows not recorded)"
    sized = q["windows"] - q["tiny_windows"]
    if q["worst_abs_spearman"] is not None:
        line += (f"; worst window |rho| {q['worst_abs_spearman']:.3f} (window {q['worst_window']}), "
                 f"{q['windows_over_bound']} of {sized} window(s) over {q['bound']:g}")
    if q["tiny_windows"]:
        line += f"; {q['tiny_windows']} window(s) under {q['tiny_window_packs']} {q.get('window_unit', 'packs')}"
    return line


def epochs_renderables(r: dict[str, Any]) -> list:
    """The OUT of `pack --epochs K`: one row per epoch, then how much each epoch repeats epoch 0."""
    table = FittedTable(title=f"packctl stats {r['path']}: {len(r['epochs'])} epochs", title_justify="left")
    for column in ("epoch", "packs", "utilization", "Spearman overall", "worst window |rho|",
                   "same packs as epoch 0", "of 2+ sequences", "packs of 1 sequence"):
        table.add_column(column, justify="left" if column == "epoch" else "right")
    for report, o in zip(r["epochs"], r["overlap"]):
        q = report.get("pack_order") or {}
        worst = q.get("worst_abs_spearman")
        table.add_row(str(o["epoch"]), f"{o['packs']:,}", _pct(report["utilization"]),
                      f"{q.get('spearman_overall', 0.0):+.3f}", "n/a" if worst is None else f"{worst:.3f}",
                      "-" if o["epoch"] == 0 else _pct(o["same_as_epoch_0"]),
                      "-" if o["epoch"] == 0 else _pct(o["same_as_epoch_0_two_or_more"]),
                      _pct(o["packs_of_one_sequence"]))
    return [table]


def packed_overview_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of a packed output's overview, shared by the single and side-by-side views."""
    c, lay, spp = r["counts"], r["layout"], r["sequences_per_pack"]
    rows = [
        ("algorithm / order", f"{r['algorithm']} / {r['order']}"),
        ("layout", f"capacity {lay['capacity']:,}, align {lay['align']}, pad to {lay['pad_to']}"
                   + (f" (multiple {lay['pack_multiple']})" if lay["pad_to"] == "multiple" else "")),
        ("packs", _packs_line(r)),
        ("sequences / tokens", f"{r['sequences']:,} / {r['tokens']:,}"),
        ("utilization", _pct(r["utilization"])),
        ("waste ratio", _pct(r["waste_ratio"])),
        ("packing efficiency", _pct(r["packing_efficiency"])),
        ("bin balance", f"{r['bin_balance']:.4f}"),
        ("padding", _padding_line(r["padding"])),
        ("sequences per pack", f"{spp['min']} / {spp['mean']:.2f} / {spp['max']} (min / mean / max)"),
        ("lengths", _lengths_line(r["lengths"])),
        ("dropped / truncated / split", f"{c['sequences_dropped']:,} / {c['sequences_truncated']:,} / "
                                        f"{c['sequences_split']:,}  (of {c['sequences_in']:,} in)"),
        ("vs padded batching", _gain_line(r["padded_batching"])),
        ("pack order", _order_line(r.get("pack_order"))),
        *limit_rows(r),
        *share_prefix_rows(r.get("share_prefix"), r["counts"]),
    ]
    bt = r.get("batching")
    if bt:
        shapes = ", ".join(f"{s['rows']}x{s['padded_len']} ({s['micro_batches']})" for s in bt["shapes"][:6])
        more = f" and {bt['distinct_shapes'] - 6} more" if bt["distinct_shapes"] > 6 else ""
        rows += [
            ("micro-batches", f"{bt['micro_batches']:,} of at most {bt['max_tokens']:,} tokens, "
                              f"{bt['sequences_per_batch']['mean']:.1f} sequences on average"),
            ("shapes (rows x len)", f"{bt['distinct_shapes']}: {shapes}{more}"),
            ("padding", f"{_pct(bt['padding_fraction'])} of {bt['written_tokens']:,} written "
                        f"({bt['empty_rows']:,} empty rows)"),
            ("  naive padding", f"{_pct(bt['naive']['padding_fraction'])} (batches of {bt['naive']['batch_size']} "
                                f"in input order): {_pct(bt['padding_saved_vs_naive'])} of it saved"),
        ]
    dp = r.get("dp_balance")
    if dp:
        rows += [
            ("DP balance", f"{dp['steps']:,} steps x {dp['dp_size']} ranks"
                           + (f" x {dp['micro_batches']} micro-batches" if dp["micro_batches"] else "")),
            ("  tokens max/mean", f"mean {dp['tokens']['mean']:.3f}, worst {dp['tokens']['max']:.3f} "
                                  f"(step {dp['tokens']['worst_step']})"),
            (f"  attention (a={dp['attn_coeff']:g})", f"mean {dp['attention']['mean']:.3f}, worst "
                                                      f"{dp['attention']['max']:.3f} (step {dp['attention']['worst_step']})"),
        ]
        rr = dp.get("round_robin")
        if rr:
            rows += [("  round robin would be", f"tokens mean {rr['tokens']['mean']:.3f} · attention mean "
                                                f"{rr['attention']['mean']:.3f}, worst {rr['attention']['max']:.3f}")]
    return rows + scale_out_rows(r.get("scale_out"))


def share_prefix_rows(s: dict[str, Any] | None, counts: dict[str, Any]) -> list[tuple[str, str]]:
    """--share-prefix: the groups stored as trees, the tokens and the attention pairs they save."""
    if not s:
        return []
    tokens_in = counts.get("tokens_in") or 0
    share = f" ({s['tokens_saved'] / tokens_in:.1%} of the input)" if tokens_in else ""
    return [("shared prefixes", f"{s['groups_shared']:,} groups: {s['tokens_saved']:,} tokens saved{share}, "
                                f"attention {s['attention_saved_fraction']:.1%} fewer pairs "
                                f"({s['attention_flat']:,} -> {s['attention_tree']:,})")]


def limit_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """--limit: one row per budget (tokens first): utilization and packs at the limit, the binding
    budget marked in its value (labels stay the same, so outputs line up side by side). None
    without limits."""
    limits = r.get("limits")
    if not limits:
        return []
    packs = r["packs"] or 1
    binding = r.get("binding")

    def binds(name: str) -> str:
        return " · binds" if binding == name else ""
    rows = [("budgets", f"tokens and {', '.join(limits)}; binding: {binding or 'none (no packs)'}"),
            ("  tokens", f"capacity {r['layout']['capacity']:,}: utilization {_pct(r['utilization'])}, "
                         f"{r['packs_at_capacity']:,} packs at it ({r['packs_at_capacity'] / packs:.1%}){binds('tokens')}")]
    for name, f in limits.items():
        rows.append((f"  {name}", f"limit {f['limit']:,}: utilization {_pct(f['utilization'])} ({f['total']:,} in all), "
                                  f"{f['packs_at_limit']:,} packs at it ({f['packs_at_limit'] / packs:.1%}){binds(name)}"))
    return rows


def mixture_table(m: dict[str, Any], title: str) -> Table:
    """A blend of sources (--source), one row per source: weight, realized share, worst window
    (and step) deviation, what it gives, and its draw (rows used, repeats) where known."""
    table = Table(title=title, title_justify="left")
    steps = any(s.get("worst_step_deviation") is not None for s in m["sources"])
    for name in ("source", "weight", "realized", "worst window", *(("worst step",) if steps else ()),
                 "sequences", "tokens", "rows used", "repeats"):
        table.add_column(name, justify="left" if name == "source" else "right")

    def off(x: float | None) -> str:
        return "" if x is None else f"±{x:.2%}"
    for src in m["sources"]:
        used = src.get("rows_used")
        table.add_row(src["name"], f"{src['weight']:.2%}", f"{src['realized']:.2%}",
                      off(src.get("worst_window_deviation")),
                      *((off(src.get("worst_step_deviation")),) if steps else ()),
                      f"{src.get('sequences', src.get('uses', 0)):,}", f"{src['tokens']:,}",
                      "" if used is None else f"{used:,} of {src['rows']:,}",
                      "" if src.get("repeats") is None else f"{src['repeats']:.2f} (cap {src['max_repeat']:g})")
    return table


def packed_renderables(r: dict[str, Any]) -> list:
    from rich.columns import Columns

    table = Table(title=f"packctl stats {r['path']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in packed_overview_rows(r):
        table.add_row(key, value)
    blend = [mixture_table(r["mixture"], f"realized blend (share of {r['mixture']['unit']})")] if r.get(
        "mixture") else []
    return [table, *blend, Columns([length_histogram_table(r["length_histogram"]),
                                    fill_histogram_table(r["fill_histogram"]),
                                    per_pack_histogram_table(r["sequences_per_pack"]["histogram"])], padding=(0, 4))]


def compare_renderables(r: dict[str, Any]) -> list:
    from rich.columns import Columns

    outputs = r["outputs"]
    table = Table(title="packctl stats: side by side", title_justify="left")
    table.add_column("", style="bold")
    for o in outputs:  # side by side, the values wrapped at spaces, a word longer than its column folded
        table.add_column(o["path"], overflow="fold")
    rows = [packed_overview_rows(o) for o in outputs]
    labels = list(dict.fromkeys(label for per in rows for label, _ in per))
    for label in labels:
        table.add_row(label, *[dict(per).get(label, "") for per in rows])
    fills = [fill_histogram_table(o["fill_histogram"], title=f"pack fill: {o['path']}") for o in outputs]
    lengths = [length_histogram_table(o["length_histogram"], title=f"lengths: {o['path']}") for o in outputs]
    return [table, Columns(fills, padding=(0, 4)), Columns(lengths, padding=(0, 4))]


def what_if_table(r: dict[str, Any]) -> FittedTable:
    """One row per (capacity, algorithm), then padded batching; the best row bold green with a star.

    `+L2`: packs above the Martello-Toth lower bound (over whole groups with --group-column);
    with --limit, each limited column's utilization and `binds`, the budget whose total alone
    needs the most packs (`binding_budget`), instead of +L2, efficiency, padding, split and plan
    time;
    `no groups`: the packs of the same options without groups; `padding`: alignment + tail tokens;
    `DP imb`: with --dp-size, the slowest rank over the mean rank of the balanced cost, summed over
    steps (metrics.json `balance.after.<cost>.weighted`)."""
    from rich import box

    best = r["best"]
    grouped = r.get("groups") is not None
    balanced = any("balance" in row for row in r["what_if"])
    limited = [name for name in next((row["limits"] for row in r["what_if"] if row.get("limits")), {})]
    title = f"what if: {r['sequences']:,} sequences" + (
        f" in {r['groups']['groups']:,} groups (--group-column {r['groups']['column']})" if grouped else "")
    table = FittedTable(keys=2, title=title + ", " + ", ".join(
        f"--capacity {c['capacity']}" for c in r["capacities"]), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
        padding=(0, 1), pad_edge=False, collapse_padding=True)
    # with --dp-size the balance replaces packing efficiency (close to utilization), to fit 80 columns
    # with --limit each budget's utilization and the binding one replace efficiency, padding, split
    # and plan time, to fit 80 columns, and +L2 (a bound of tokens alone, not of every budget)
    names = ("C", "algorithm", "packs", *(("no groups",) if grouped else ()), *(() if limited else ("+L2",)), "util",
             *(("DP imb",) if balanced else () if limited else ("effic",)),
             *((*limited, "binds") if limited else ("padding", "split", "plan")))
    for name in names:
        table.add_column(name, justify="left" if name == "algorithm" else "right", no_wrap=True)
    for cap in r["capacities"]:
        for k, row in enumerate(w for w in r["what_if"] if w["capacity_flag"] == cap["capacity"]):
            is_best = row["capacity_flag"] == best["capacity"] and row["algorithm"] == best["algorithm"]
            groups = row.get("group_cost") if grouped else None
            table.add_row(
                f"{row['capacity_flag']:,}" if k == 0 else "", row["algorithm"] + (" ★" if is_best else ""), f"{row['packs']:,}",
                *((f"{groups['packs_without_groups']:,}",) if grouped else ()),
                *(() if limited else (f"+{row['packs'] - (groups or row)['lower_bound_packs_l2']:,}",)),
                _pct(row["utilization"]),
                *((f"{row['balance']['after'][row['balance']['cost']]['weighted']:.3f}",) if balanced
                  else () if limited else (_pct(row["packing_efficiency"]),)),
                *(_limit_cells(row) if limited else
                  (f"{row['padding']['alignment_tokens'] + row['padding']['tail_tokens']:,}",
                   f"{row['counts']['sequences_split']:,}", f"{row['plan_seconds']:.2f}s")),
                style="bold green" if is_best else None)
        pb = cap["padded_batching"]
        cells = ([""] * (len(limited) + 1 + balanced) if limited
                 else ["", f"{pb['padding_tokens']:,}", "", ""])
        table.add_row("", f"padded b={pb['batch_size']}", f"{pb['batches']:,}", *(("",) if grouped else ()),
                      *(() if limited else ("",)), _pct(pb["utilization"]), *cells, style="dim", end_section=True)
    return table


def _limit_cells(row: dict[str, Any]) -> tuple[str, ...]:
    """A what-if row's --limit cells: each limited column's utilization (in --limit order), and
    the binding budget (the one whose total alone needs the most packs; `binding_budget`)."""
    limits = row.get("limits") or {}
    return (*(f"{f['utilization']:.0%}" for f in limits.values()), row.get("binding") or "none")


def input_renderables(r: dict[str, Any]) -> list:
    from rich.text import Text

    s = r["settings"]
    head = Table(title=f"packctl stats: {len(r['inputs'])} file(s), column '{r['tokens_column']}'",
                 show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    head.add_row("sequences / tokens", f"{r['sequences']:,} / {r['tokens']:,}")
    head.add_row("lengths", _lengths_line(r["lengths"]))
    g = r.get("groups")
    if g:
        head.add_row(f"groups ('{g['column']}')",
                     f"{g['groups']:,} groups, {g['grouped_sequences']:,} sequences in groups of 2 or more (largest "
                     f"{g['largest']:,}), packed whole; tokens per group {_lengths_line(g['group_tokens'])}")
    total = r["tokens"] or 1
    for cap in r["capacities"]:
        over = cap["over_capacity"]
        lost = over["tokens_lost"]
        line = f"{over['sequences']:,} sequences, {over['token_share']:.1%} of the tokens"
        if over["sequences"]:
            line += (f"; drop loses {lost['drop']:,} tokens ({lost['drop'] / total:.1%}), truncate {lost['truncate']:,} "
                     f"({lost['truncate'] / total:.1%}), split keeps all in {over['pieces_added']['split']:,} extra "
                     "pieces")
            if cap.get("pack_stops_at"):
                line += (f"; --too-long error: pack stops at {cap['pack_stops_at']}, so these rows assume "
                         f"--too-long {cap['too_long']}")
            else:
                line += f"; rows with --too-long {cap['too_long']}"
        head.add_row(f"over --capacity {cap['capacity']:,}", line)
    head.add_row("settings", f"order {s['order']}, window {s['window']:,}, align {s['align']} (cp {s['cp_size']}, "
                             f"tp {s['tp_size']}{'' if s.get('sequence_parallel', True) else ' no SP'}, "
                             f"seq-multiple {s['seq_multiple']}), pad to {s['pad_to']}, "
                             f"max seqs per pack {s['max_seqs_per_bin'] or 'no limit'}")
    t = r["stats_seconds"]
    head.add_row("time", f"read lengths {t['read_lengths']:.2f}s, plan {t['plan']:.2f}s, "
                         f"metrics {t['metrics']:.2f}s, total {t['total']:.2f}s")
    blend = [mixture_table(r["mixture"], f"the blend before packing (share of {r['mixture']['unit']}, window "
                                         f"{r['mixture']['window']:,})")] if r.get("mixture") else []
    return [head, *blend, length_histogram_table(r["length_histogram"]), what_if_table(r),
            Text.assemble(("recommended: ", "bold green"), r["recommendation"])]


def stats_renderables(report: dict[str, Any]) -> list:
    """Rich tables for a report of `packctl.stats.stats` (packed, compare or input)."""
    kind = report["kind"]
    if kind == "packed":
        return packed_renderables(report)
    if kind == "compare":
        return compare_renderables(report)
    if kind == "epochs":
        return epochs_renderables(report)
    return input_renderables(report)


def verify_time_line(report) -> str:
    """How long verify took and which check took most of it, with the flag that skips the
    attention checks when they did:

        time 461.0s, attention 350.2s of it (--no-attention skips the attention and contamination checks)
    """
    slowest = report.slowest()
    line = f"time {report.seconds:.1f}s"
    if slowest is None:
        return line
    line += f", {slowest} {report.checks[slowest].seconds:.1f}s of it"
    if slowest in ("attention", "contamination"):
        line += " (--no-attention skips the attention and contamination checks)"
    return line


def verify_table(report, *, max_violations: int = 20):
    """`packctl verify`: a table of the checks (packctl.verify.VerifyReport), then the first broken
    rules and the verdict."""
    from rich.console import Group
    from rich.text import Text

    from packctl.verify.report import CHECKS

    style = {"ok": "green", "failed": "bold red", "skipped": "dim"}
    table = Table(title=f"packctl verify {report.output}", title_justify="left")
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("time", justify="right")
    table.add_column("result")
    for name in CHECKS:
        check = report.checks.get(name)
        if check is None:
            continue
        lines = check.lines or [""]
        took = "" if check.seconds is None else f"{check.seconds:.1f}s"
        for i, line in enumerate(lines):
            table.add_row(name if i == 0 else "", Text(check.status if i == 0 else "", style=style[check.status]),
                          took if i == 0 else "", Text(line))
    parts: list[Any] = [table, Text(verify_time_line(report), style="dim")]
    for v in report.violations[:max_violations]:
        parts.append(Text(f"FAIL {v}", style="red"))
    if len(report.violations) > max_violations:
        parts.append(Text(f"... {len(report.violations) - max_violations} more (--json lists them all)", style="red"))
    verdict = "ok" if report.ok else f"FAILED: {len(report.violations)} broken rule(s)"
    parts.append(Text(f"verdict: {verdict}", style="bold green" if report.ok else "bold red"))
    return Group(*parts)

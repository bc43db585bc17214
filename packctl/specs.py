"""The frozen spec of each stage of `packctl pack`, built once per run from the options
(`PackConfig.specs()`): a stage receives what it needs, not every option. The choices they hold
are the enums of packctl/enums.py.

    specs = PackConfig(inputs=["sample_data"], output="out", capacity=4096, cp_size=2,
                       order="shuffle", too_long="split").specs()
    specs.order      OrderSpec(order=<Order.SHUFFLE>, seed=0, align=4, window=100000, ...)
    specs.windows    WindowOptions(capacity=4096, align=4, algorithm='bfd', too_long=<TooLong.SPLIT>, ...)
    specs.lengths    LengthSpec(mode=<Mode.PACK>, capacity=4096, pad_to=<PadTo.CAPACITY>, ...)
    specs.balance    None (no --dp-size)

The stages, in run order, and the spec each takes (packctl/pipeline/__init__.py draws them):

    scan         ScanSpec       columns, checks, memory budget
    order        OrderSpec      sort key, seed, windows, groups (GroupSpec: where groups must fit)
    plan         WindowOptions  algorithm, capacity, over-long policy (packctl/plan/windows.py)
    balance      BalanceSpec    ranks, micro-batches, cost (packctl/plan/balance.py)
    lengths      LengthSpec     each pack's written length, shape buckets, batch shapes
    write        WriteSpec      shard rows, token transfer, what the shards record
    report       ReportSpec     what the metrics name

Everything here is plain data: no numpy, no pyarrow, so the options and `--help` stay light.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from packctl.enums import (  # noqa: F401  (the choices, spelled where the specs that hold them are)
    BalanceScope,
    BatchUnit,
    Cost,
    CurriculumOrder,
    GroupScope,
    LrScaling,
    Mode,
    Order,
    PackOrder,
    PadTo,
    PoolStrategy,
    StepGrouping,
    TokenTransfer,
    TooLong,
)


@dataclass(frozen=True)
class CarriedColumns:
    """The input columns a run reads beside its tokens and labels, declared here once, a field
    each with its flag in `FLAGS`. Resolve checks them in every file's schema (source/parquet.py),
    scan reads their values per sequence, materialize writes them; a kind that has no such columns
    refuses them by flag (`given`):

        CarriedColumns(keep=("doc_id",), weight="w").given()
        -> {"--keep-columns": ("doc_id",), "--weight-column": "w"}

    A new carried column is one field here, its option (config.py) and where it is read and written.
    """

    keep: tuple[str, ...] = ()  # --keep-columns: copied per sequence into its pack
    weight: str | None = None  # --weight-column: each sequence's loss weight (seq_weights)
    group: str | None = None  # --group-column: a group's members are packed together
    limits: tuple[str, ...] = ()  # --limit COL=N: COL per sequence, COL_sum per pack, in --limit order
    prefix: str | None = None  # --prefix-column: each row's prompt length, bounding the shared prefix

    FLAGS: ClassVar[dict[str, str]] = {"keep": "--keep-columns", "weight": "--weight-column",
                                       "group": "--group-column", "limits": "--limit",
                                       "prefix": "--prefix-column"}

    def given(self) -> dict[str, Any]:
        """The flags of the columns this run reads, with their values, in declaration order."""
        return {flag: getattr(self, field) for field, flag in self.FLAGS.items() if getattr(self, field)}

    @property
    def per_sequence(self) -> tuple[str, ...]:
        """The columns whose values materialize copies beside each sequence (kept, then weight)."""
        return tuple(dict.fromkeys([*self.keep, *([self.weight] if self.weight else [])]))


@dataclass(frozen=True)
class ScanSpec:
    """What scan reads from every input block and checks there."""

    tokens_column: str
    labels_column: str | None
    carried: CarriedColumns
    skip_empty: bool
    pad_token_id: int
    memory_budget: int  # decoded tokens held at once, per rank
    count_loss_tokens: bool  # per-sequence loss tokens, for the step sums of --dp-size
    share_prefix: bool = False  # --share-prefix: each row compared with the row before (source/prefix.py)


@dataclass(frozen=True)
class OrderSpec:
    """How sequences are ordered and cut into windows (`packctl.pipeline.order`)."""

    order: Order
    curriculum_order: CurriculumOrder
    seed: int
    align: int  # curriculum sorts by the padded length
    window: int  # sequences (with groups: groups) per planning window
    epochs: int
    skip_empty: bool
    mixture: MixtureSpec | None = None  # --source: the blend the order draws its uses from


@dataclass(frozen=True)
class MixtureSpec:
    """A blend of named sources (`--source NAME=PATH:WEIGHT[:MAX_REPEAT]`, docs/mixtures.md): the
    gids of source k are `gid_starts[k]:gid_starts[k+1]` (its files, after those of the sources
    before it). `weights` are normalized to sum 1; `unit` says what a weight is a fraction of
    (tokens or sequences); the output holds `size` units (--tokens), or as many as the source
    `epochs_of` gives used once, or (both None) the most that repeats no source."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    max_repeats: tuple[float, ...]
    gid_starts: tuple[int, ...]
    file_starts: tuple[int, ...] = ()  # the files of source k: file_starts[k]:file_starts[k+1]
    unit: str = "tokens"
    size: int | None = None
    epochs_of: str | None = None
    seed: int = 0  # the base --seed: every epoch draws the same uses, each in its own order


@dataclass(frozen=True)
class GroupSpec:
    """Where the groups of --group-column must fit: one pack (`scope` pack: its capacity), or one
    optimizer step (`scope` step: at most `dp_size` x `micro_batches` packs, as `windows` plans them)."""

    column: str
    scope: GroupScope
    capacity: int  # the planner's bin size
    align: int
    dp_size: int | None = None
    micro_batches: int | None = None


@dataclass(frozen=True)
class WindowOptions:
    """How a run plans its windows (`PackConfig.specs().windows`; plan/windows.py plans them).

    `capacity` must be a multiple of `align`; algorithm "batch" (`--mode batch`) makes padded
    micro-batches of at most `max_tokens` (`batch_lengths`, with optional `buckets`)."""

    capacity: int
    align: int
    algorithm: str
    too_long: str
    window: int
    max_seqs_per_bin: int | None = None
    seed: int = 0
    pool_size: int = 128
    pool_strategy: str = "closest"
    max_tokens: int | None = None
    buckets: Any = None  # np.ndarray of batch mode --shape-buckets lengths, or None
    # --group-scope step (with `new_group`): steps of at most `step_packs` packs, or closed once they
    # hold `step_tokens` padded tokens; groups are then kept whole within a step, not a pack
    step_packs: int | None = None
    step_tokens: int | None = None
    # the order of each window's packs once planned (plan/pack_order.py; with --dp-size, of its steps)
    pack_order: str = "planner"
    # epochs 1.. of --epochs: seeded exchanges of sequences between a window's packs at equal cost
    # (plan/exchange.py), so they differ pack by pack from epoch 0 in as many packs
    exchanges: bool = False
    # --limit COL=N: the most each pack may hold of each limited column, beside `capacity` (the
    # per-sequence values come to plan_windows as `extra`, one column each, in this order)
    limits: tuple[int, ...] = ()

    @property
    def step_scope(self) -> bool:
        return self.step_packs is not None or self.step_tokens is not None


@dataclass(frozen=True)
class BalanceSpec:
    """What to balance and how (the `--dp-size` family of options)."""

    dp_size: int
    micro_batches: int | None = None  # packs per rank per step; None with step_tokens
    step_tokens: int | None = None  # close a step once it holds this many tokens
    cost: str = "attention"
    attn_coeff: float = 0.0
    scope: str = "sequences"
    equal_counts: bool = True
    capacity: int = 0  # the planner's bin size (a pack's padded load never exceeds it)
    max_seqs_per_bin: int | None = None
    max_iterations: int | None = None  # local-search moves per step (None: 16 x dp_size)
    grouping: str = "cost"  # how a window's packs are cut into steps: "cost" or "order"
    padded_cost: bool = False  # costs of the aligned lengths (batch mode: every row's padded length)
    seed: int = 0  # order of the steps inside a window
    # "planner": with grouping "cost" a seeded random order, the short last step last; with
    # "order" the planner's; else a window's steps in that --pack-order (plan/pack_order.py)
    step_order: str = "planner"
    # --limit: the most a pack may hold of each limited column (sequence moves keep within them)
    limits: tuple[int, ...] = ()
    # --balance-cost COL: COL's index among the limits; its sum is balanced with `cost`
    cost_column: int | None = None


@dataclass(frozen=True)
class LengthSpec:
    """Each pack's written length and the over-long policy's bounds (`final_pack_lengths`)."""

    mode: Mode
    capacity: int  # --capacity: the pack length with --pad-to capacity, the longest row in batch mode
    plan_capacity: int  # the bin size the planner fills (see PackConfig.plan_capacity)
    pad_to: PadTo
    pack_multiple: int
    align: int
    too_long: TooLong
    shape_buckets: int | None = None
    max_tokens: int | None = None  # batch mode: rows x padded length of a micro-batch


@dataclass(frozen=True)
class StepSpec:
    """What balancing adds beyond `BalanceSpec` (the kernel's spec): the learning-rate scale of each
    step, the warm-up steps that show every shape first, and whether group members stay in their pack."""

    lr_scaling: LrScaling
    ref_batch_size: float | None
    batch_unit: BatchUnit
    warmup_shapes: bool
    pin_groups: bool  # --group-column with --group-scope pack: members never move between packs


@dataclass(frozen=True)
class WriteSpec:
    """How packs are dealt out to writers and written."""

    shard_rows: int
    epochs: int
    token_transfer: TokenTransfer
    order: Order  # `--token-transfer auto` reads its own blocks only in input order
    pad_token_id: int
    memory_budget: int
    carried: CarriedColumns  # kept columns, the weight and --limit columns are written per sequence
    share_prefix: bool = False  # --share-prefix: parent_segments, and each branch's positions and first label


@dataclass(frozen=True)
class ReportSpec:
    """What `_metrics.json` names and how it sums the run (`packctl.pipeline.report`)."""

    algorithm: str
    order: Order
    mode: Mode
    capacity: int  # a pack's capacity, or in batch mode the micro-batch budget max_tokens
    align: int
    epochs: int
    seed: int
    group_scope: GroupScope | None  # None without --group-column
    shape_buckets: int | None
    balance: dict[str, Any] | None  # the --dp-size options as metrics.json's balance records them
    limits: dict[str, int] = dataclasses.field(default_factory=dict)  # --limit COL=N, in --limit order
    share_prefix: bool = False  # --share-prefix: metrics.json's share_prefix


@dataclass(frozen=True)
class Specs:
    """Every stage's spec of one run (`PackConfig.specs()`); `for_epoch(e)` gives epoch e's, whose
    shuffle, ffs packing and step grouping use the epoch's own seed."""

    scan: ScanSpec
    order: OrderSpec
    groups: GroupSpec | None
    windows: WindowOptions
    lengths: LengthSpec
    balance: BalanceSpec | None  # None without --dp-size
    steps: StepSpec | None
    write: WriteSpec
    report: ReportSpec

    def for_epoch(self, seed: int, exchanges: bool = True) -> "Specs":
        """The same specs with `seed` in every stage that draws random numbers, and for an epoch
        after the first (`exchanges`) the windows' packs exchanging sequences (plan/exchange.py)."""
        if seed == self.order.seed and exchanges == self.windows.exchanges:
            return self
        replace = dataclasses.replace
        return replace(self, order=replace(self.order, seed=seed),
                       windows=replace(self.windows, seed=seed, exchanges=exchanges),
                       balance=replace(self.balance, seed=seed) if self.balance is not None else None)

"""The options of `packctl pack`: one dataclass shared by the CLI, TOML config files and the API.

Every field is a CLI flag (`capacity` -> `--capacity`, `too_long` -> `--too-long`) and a TOML key
(either spelling). Precedence: defaults < `--config FILE` < flags given on the command line.

    >>> cfg = PackConfig(inputs=["sample_data"], output="out", capacity=4096, cp_size=2)
    >>> cfg.align, cfg.resolved_pack_multiple
    (4, 4)
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packctl.contract.schema import INT32_MAX, RESERVED_COLUMNS, limit_sum_name
from packctl.errors import PackctlError
from packctl.plan.names import ALGORITHMS
from packctl.enums import AddSpecial, LossOn, RecordFormat
from packctl.urls import is_url, refuse_url
from packctl.specs import (BalanceScope, BalanceSpec, BatchUnit, CarriedColumns, Cost, CurriculumOrder, GroupScope,
                           GroupSpec, LengthSpec, LrScaling, Mode, Order, OrderSpec, PackOrder, PadTo, PoolStrategy, ReportSpec,
                           ScanSpec, Specs, StepGrouping, StepSpec, TokenTransfer, TooLong, WindowOptions,
                           WriteSpec)

INT64_MAX = 2**63 - 1
# Bytes one pack costs while it is built: input_ids, labels and position_ids, int32 per token.
PACK_BYTES_PER_TOKEN = 3 * 4
MAX_EPOCHS = 99_999

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_bytes(value: str | float, option: str = "memory_budget") -> int:
    """`"4GiB"`, `"512M"`, `"1e9"` or a number -> bytes, at least 1 and at most 2^63-1 (sizes are
    int64 wherever they are counted); anything else is refused naming the option.

    >>> parse_bytes("2G"), parse_bytes(1024), parse_bytes("1.5k")
    (2147483648, 1024, 1536)
    """
    flag = f"--{option.replace('_', '-')}"
    example = "expected a size such as 4GiB, 512M or 1000000"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise PackctlError(f"{flag} {value!r}: {example}")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        text = value.strip().lower().replace("_", "")
        digits, unit = text, ""
        if not _is_number(text):  # a number and a unit: 4GiB, 512 M
            digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
            unit = text[len(digits):].strip()
        if not _is_number(digits):
            raise PackctlError(f"{flag} {value!r}: {example}")
        if unit not in _UNITS:
            raise PackctlError(f"{flag} {value!r}: unknown unit {unit!r}; {example}")
        number = int(digits) if digits.lstrip("+-").isdigit() else float(digits)  # int: exact, however long
    if isinstance(number, float) and not math.isfinite(number):
        raise PackctlError(f"{flag} {value!r}: not a finite size; {example}")
    scaled = number * _UNITS[unit]
    if scaled < 1:
        raise PackctlError(f"{flag} {value!r}: must be at least 1 byte; {example}")
    if scaled > INT64_MAX:
        raise PackctlError(f"{flag} {value!r}: more than 2^63-1 bytes; give the memory one process may use, "
                           "e.g. 8GiB")
    return int(scaled)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def default_memory_budget() -> int:
    """A quarter of physical memory: room for the token cache without crowding the machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


# The groups of `packctl pack --help`, in the order it shows them; every option names its own.
PANELS = ("Input", "Packing", "Order", "Balance", "Output", "Run")


def option(default: Any = dataclasses.MISSING, *, help: str, panel: str, choices: tuple[str, ...] | None = None,
           shown_default: str | None = None, flag: str | None = None, short: str | None = None,
           metavar: str | None = None, switch: bool = False, cli: type | None = None,
           factory: Any = dataclasses.MISSING, planning: bool = False) -> Any:
    """A PackConfig field with everything the CLI, the TOML file and the validation need: its help,
    its group in --help (`panel`, one of PANELS), its choices, its default (`shown_default` where
    the real one depends on other options), the flag when it is not `--field-name`, a short flag,
    the name of its value in --help (`metavar`: `--limit COL=N`; N, NUMBER or TEXT by its type
    otherwise), `switch` for --x/--no-x booleans, the type typed on the command line (`cli`) when
    it is not the field's, and `planning` when it changes which packs `pack` plans (then
    `packctl stats INPUT` takes it too, for its what-if)."""
    if panel not in PANELS:
        raise ValueError(f"panel {panel!r}: one of {PANELS}")
    metadata = {"help": help, "panel": panel, "choices": choices, "shown_default": shown_default, "flag": flag,
                "short": short, "metavar": metavar, "switch": switch, "cli": cli, "planning": planning}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class PackConfig:
    """Everything `packctl pack` needs, one field per option: its `help` (below) is what
    `packctl pack --help` prints, and the field name is the flag (`too_long` -> `--too-long`) and the
    TOML key (either spelling)."""

    inputs: list[str] = option(panel="Input", factory=list, help="Parquet files, directories (every *.parquet below) or globs.")
    output: str = option("", panel="Output", metavar="OUT", help="Output directory OUT (required); refused if it exists unless --overwrite.",
                         short="-o")
    capacity: int = option(4096, panel="Packing", help="Tokens per pack (the bin size).")
    algorithm: str = option("bfd", panel="Packing", planning=True, choices=ALGORITHMS, help="Packing algorithm (docs/algorithms.md).")
    pool_size: int = option(128, panel="Packing", planning=True, help="Items waiting in the pool of --algorithm pool (at most this many packs of "
                                      "reordering).")
    pool_strategy: str = option("closest", panel="Packing", planning=True, choices=PoolStrategy.values(),
                                help="--algorithm pool places the largest item that fits, or the oldest.")
    order: str = option("input", panel="Order", planning=True, choices=Order.values(),
                        help="Sequence order: as read, seeded shuffle, or by padded length (ties by global id).")
    curriculum_order: str = option("asc", panel="Order", planning=True, choices=CurriculumOrder.values(), help="Direction of --order curriculum.")
    pack_order: str = option("auto", panel="Order", planning=True, choices=PackOrder.values(),
                             help="Order of each window's packs (with --dp-size, steps): auto (shuffle with --order "
                                  "shuffle, else planner), planner (as the algorithm opens them), shuffle (stratified, "
                                  "seeded), longest or mean (ascending by the longest or mean sequence).")
    seed: int = option(0, panel="Order", planning=True, help="Seed of --order shuffle, of --algorithm ffs and of step grouping.")
    epochs: int = option(1, panel="Order", help="Epochs to write, each a full pass in its own shuffled order and packing, one "
                                 "output each (OUT/epoch-00000, ...; docs/training.md); needs --order shuffle.")
    window: int = option(100_000, panel="Packing", planning=True, help="Sequences per planning window (global positions; each window is packed "
                                       "on its own).")
    cp_size: int = option(1, panel="Packing", planning=True, help="Context-parallel size; with cp > 1 each sequence is padded to a multiple of "
                                  "2*cp (Transformer Engine's THD split into 2*cp chunks).")
    tp_size: int = option(1, panel="Packing", planning=True, help="Tensor-parallel size; with --sequence-parallel each sequence is padded to a "
                                  "multiple of cp*tp.")
    sequence_parallel: bool = option(True, panel="Packing", planning=True, switch=True, help="Megatron sequence parallelism is on (with --tp-size "
                                                             "> 1): each CP rank's share of a sequence splits "
                                                             "evenly over the tp ranks.")
    seq_multiple: int = option(1, panel="Packing", planning=True, help="Extra per-sequence length multiple (e.g. 8 or 64 for kernels that like "
                                       "aligned lengths).")
    pad_to: str = option("capacity", panel="Packing", planning=True, choices=PadTo.values(),
                         help="Every pack exactly --capacity tokens, or rounded up to --pack-multiple.")
    pack_multiple: int | None = option(None, panel="Packing", planning=True, shown_default="the alignment",
                                       help="Pack length multiple for --pad-to multiple.")
    pad_token_id: int = option(0, panel="Output", help="Token id written into padding.")
    max_seqs_per_bin: int | None = option(None, panel="Packing", planning=True, help="At most this many sequences in a pack.",
                                          shown_default="no limit")
    too_long: str = option("error", panel="Packing", planning=True, choices=TooLong.values(),
                           help="What to do with a sequence longer than the capacity.")
    sources: dict[str, dict] = option(panel="Input", metavar="NAME=PATH:WEIGHT[:MAX_REPEAT]", factory=dict, planning=True,
                                      flag="--source", cli=list, shown_default="none",
                                      help="A named source of a blend, instead of INPUT: PATH any input packctl reads, "
                                           "WEIGHT its share of the output's tokens (--mix-unit), MAX_REPEAT the most "
                                           "passes over it (default --max-repeat); repeat for every source "
                                           "(docs/mixtures.md). TOML: [sources.NAME] path, weight, max-repeat.")
    blend: str | None = option(None, panel="Input", metavar="FILE", planning=True, shown_default="none",
                               help="A Megatron blend file (weight prefix weight prefix ...): every prefix a source "
                                    "named by its file name, read as --source.")
    mix_unit: str = option("tokens", panel="Input", planning=True, choices=("tokens", "sequences"),
                           help="What a --source weight is a share of: the output's tokens, or its sequences.")
    tokens: int | None = option(None, panel="Input", planning=True, shown_default="the most that repeats no source",
                                help="Output size of a --source blend in --mix-unit units (tokens or sequences); "
                                     "sources are down- or up-sampled to it.")
    epochs_of: str | None = option(None, panel="Input", metavar="NAME", planning=True, shown_default="none",
                                   help="Size a --source blend so that source NAME is used exactly once.")
    max_repeat: float = option(1.0, panel="Input", planning=True,
                               help="The most passes over a --source (whole repeats and a seeded part) unless its "
                                    "own MAX_REPEAT says otherwise; a blend that needs more is refused.")
    tokens_column: str = option("input_ids", panel="Input", metavar="COL", planning=True, help="Input column of token ids.")
    split: str | None = option(None, panel="Input", metavar="NAME", planning=True,
                               help="The dataset split to read from a directory INPUT that holds several (the Hugging "
                                    "Face Hub's layouts: train-*.parquet beside test-*.parquet, "
                                    "data/train-00000-of-00002.parquet, train/ beside validation/); such a directory "
                                    "is refused without it.")
    labels_column: str | None = option(None, panel="Input", metavar="COL", shown_default="labels if every input file has it, else the tokens",
                                       help="Input column of labels.")
    keep_columns: list[str] = option(panel="Input", metavar="COL", factory=list, shown_default="none",
                                     help="Input columns carried into the packs, one value per sequence, as list "
                                          "columns aligned with sample_ids (repeat the flag for several).")
    weight_column: str | None = option(None, panel="Input", metavar="COL", shown_default="none",
                                       help="Input column of one float weight per sequence, written per pack as "
                                            "seq_weights (aligned with sample_ids) for packctl.torch.loss_fn.")
    tokenizer: str | None = option(None, panel="Input", metavar="DIR", planning=True, shown_default="none",
                                   help="A Hugging Face tokenizer directory: INPUT is raw text or chat records "
                                        "(.jsonl, .json, .jsonl.gz/.zst, .parquet, .txt), tokenized as they are read, "
                                        "with the labels packctl tokenize writes (docs/tokenize.md).")
    format: str = option("auto", panel="Input", planning=True, choices=tuple(f.value for f in RecordFormat),
                         help="With --tokenizer: the record format (auto: from the fields of the records).")
    loss_on: str | None = option(None, panel="Input", planning=True,
                                 shown_default="by format: text all, messages assistant, prompt-completion completion",
                                 help=f"With --tokenizer: which tokens are trained on: "
                                      f"{', '.join(rule.value for rule in LossOn)}.")
    text_column: str = option("text", panel="Input", metavar="COL", planning=True,
                              help="With --tokenizer: the record field of plain text.")
    messages_column: str = option("messages", panel="Input", metavar="COL", planning=True,
                                  help="With --tokenizer: the record field of chat messages.")
    prompt_column: str = option("prompt", panel="Input", metavar="COL", planning=True,
                                help="With --tokenizer: the record field of prompts.")
    completion_column: str = option("completion", panel="Input", metavar="COL", planning=True,
                                    help="With --tokenizer: the record field of completions.")
    tools_column: str = option("tools", panel="Input", metavar="COL", planning=True,
                               help="With --tokenizer: the record field of tool definitions (chat).")
    add_bos: str = option("auto", panel="Input", planning=True, choices=tuple(a.value for a in AddSpecial),
                          help="With --tokenizer: BOS at the start of each row: auto (as the tokenizer or the "
                               "template writes it), always or never; never doubled (as packctl tokenize --add-bos).")
    add_eos: str = option("auto", panel="Input", planning=True, choices=tuple(a.value for a in AddSpecial),
                          help="With --tokenizer: EOS at the end of each row: auto, always or never; never doubled "
                               "(as packctl tokenize --add-eos).")
    limits: dict[str, int] = option(panel="Packing", metavar="COL=N", factory=dict, planning=True, flag="--limit", cli=list, shown_default="none",
                                    help="COL=N: every pack holds at most N of the integer input column COL (images, "
                                         "image tokens, any per-sample cost) summed over its sequences, beside "
                                         "--capacity; repeat for several budgets. Written per sequence as COL and per "
                                         "pack as COL_sum (docs/cli.md#limits).")
    group_column: str | None = option(None, panel="Input", metavar="COL", planning=True, shown_default="none",
                                      help="Input column naming each row's group (preference pairs, rollouts of one "
                                           "prompt): a run of consecutive rows with one value is kept whole in one "
                                           "pack, in input order, or one step (--group-scope; "
                                           "docs/algorithms.md#groups).")
    share_prefix: bool = option(False, panel="Input", planning=True, switch=True,
                                help="Store the common prefix of a group's rows once (prompt of a preference pair, of "
                                     "rollouts): one prefix segment, then one branch per row, linked by "
                                     "parent_segments (needs --group-column; docs/shared-prefix.md).")
    prefix_column: str | None = option(None, panel="Input", metavar="COL", planning=True, shown_default="none",
                                       help="With --share-prefix: input column of each row's prompt length; a "
                                            "group shares at most the smallest of its rows' values "
                                            "(packctl tokenize writes prompt_length).")
    group_scope: str = option("pack", panel="Packing", planning=True, choices=GroupScope.values(),
                              help="Where a group is kept whole: one pack (members adjacent, in input order), or "
                                   "one optimizer step (members in any packs of the step: groups larger than a "
                                   "pack; needs --dp-size).")
    shard_rows: int = option(1024, panel="Output", help="Packs per output Parquet shard.")
    plan_only: bool = option(False, panel="Output", switch=True,
                             help="Write a plan: every column but the token columns, and where each piece's "
                                  "tokens are in the source (seq_starts), a few percent of the bytes. The loader reads "
                                  "its tokens from the source; packctl materialize writes the full output "
                                  "(docs/format.md#plans).")
    skip_empty: bool = option(False, panel="Input", planning=True, switch=True, help="Leave empty sequences out instead of refusing them; they "
                              "are counted in the manifest (sequences_skipped_empty, among sequences_dropped).")
    overwrite: bool = option(False, panel="Output", switch=True, help="Replace an existing OUT.")
    memory_budget: int | str | None = option(None, panel="Run", metavar="SIZE", cli=str, shown_default="a quarter of RAM",
                                             help="Decoded tokens held in memory at once, e.g. 8GiB (per rank).")
    resume: bool = option(False, panel="Run", switch=True, help="Continue an interrupted run of the same command and inputs, "
                          "keeping the shards it finished; on an OUT that already holds this command's output, "
                          "exit 0 \"already complete\" (docs/errors.md).")
    token_transfer: str = option("auto", panel="Run", choices=TokenTransfer.values(),
                                 help="Under MPI, how a rank gets the tokens of the packs it writes: sent by the rank "
                                      "that scanned their block, or read by itself (a filesystem every rank sees); "
                                      "auto reads when that decodes little more than the input "
                                      "(docs/distributed.md).")
    mode: str = option("pack", panel="Packing", planning=True, choices=Mode.values(),
                       help="THD packs, or padded micro-batches (dynamic batching: sequences sorted by length in "
                            "each window, grouped while rows x padded length <= --max-tokens; docs/format.md).")
    max_tokens: int | None = option(None, panel="Packing", planning=True, shown_default="--capacity",
                                    help="Batch mode: tokens of a padded micro-batch, rows x padded length.")
    seq_round: int = option(1, panel="Packing", planning=True, help="Batch mode: round a micro-batch's padded length up to this multiple.")
    shape_buckets: int | None = option(None, panel="Packing", planning=True, help="At most K distinct padded lengths (batch mode) or pack lengths "
                                                  "(--pad-to multiple), chosen for least padding: few shapes for "
                                                  "torch.compile.")
    warmup_shapes: bool = option(False, panel="Balance", planning=True, switch=True, help="With --dp-size: the first steps show every shape to "
                                                          "every rank, so each shape compiles up front.")
    dp_size: int | None = option(None, panel="Balance", planning=True, help="Data-parallel ranks: give every pack a step, dp_rank and micro_batch "
                                            "(docs/balancing.md); needs --micro-batches or --step-tokens.")
    micro_batches: int | None = option(None, panel="Balance", planning=True, help="Packs per rank per optimizer step.")
    step_tokens: int | None = option(None, panel="Balance", planning=True, help="Instead of --micro-batches: close a step once it holds this many "
                                                "tokens (steps of varying size).")
    balance: str = option("attention", panel="Balance", planning=True, choices=Cost.values(),
                          help="Cost shared out evenly over ranks (attention: a*L + L^2 per sequence).")
    balance_cost: str | None = option(
        None, panel="Balance", metavar="COL", planning=True, help="With --dp-size and --limit COL=N: also share out the sum of COL (vision work: "
                                  "images, image tokens) evenly over ranks and micro-batches, with the --balance "
                                  "cost (docs/balancing.md).")
    attn_coeff: float = option(0.0, panel="Balance", planning=True, help="a of the attention cost a*L + L^2 (12 x hidden size weighs per-token "
                                         "and attention FLOPs alike; 0: attention alone).")
    balance_scope: str = option("sequences", panel="Balance", planning=True, choices=BalanceScope.values(),
                                help="Share whole packs out, or also move single sequences between a step's packs.")
    step_grouping: str = option("cost", panel="Balance", planning=True, choices=StepGrouping.values(),
                                help="Steps of packs of similar cost (in a seeded order), or of consecutive packs.")
    equal_counts: bool = option(True, panel="Balance", planning=True, switch=True, help="Same number of packs for every rank in every step "
                                                        "(packs are split to make up the count).")
    lr_scaling: str = option("none", panel="Balance", planning=True, choices=LrScaling.values(),
                             help="Record lr_scale = (batch / --ref-batch-size)^p per step.")
    ref_batch_size: float | None = option(None, panel="Balance", planning=True, shown_default="the mean batch",
                                          help="Batch size the learning rate was tuned for, in --batch-unit.")
    batch_unit: str = option("tokens", panel="Balance", planning=True, choices=BatchUnit.values(), help="What a batch size counts.")

    @property
    def balanced(self) -> bool:
        """Whether packs get (step, dp_rank, micro_batch)."""
        return self.dp_size is not None

    @property
    def align(self) -> int:
        """Per-sequence padding multiple: what the kernels need and no more, Megatron-Bridge's rule.

            align = lcm(seq_multiple, 2*cp if cp > 1, cp*tp if sequence parallel and tp > 1)

        Transformer Engine's THD context parallelism cuts every sequence into 2*cp equal chunks;
        sequence parallelism then splits each CP rank's share (length / cp) over the tp ranks.
        Tensor parallelism alone splits heads, not tokens, and needs nothing. seq_round joins in
        batch mode. cp 2, tp 4: 8 (SP) or 4 (no SP), where 2*cp*tp would be 16.
        """
        align = self.seq_multiple
        if self.cp_size > 1:
            align = math.lcm(align, 2 * self.cp_size)
        if self.sequence_parallel and self.tp_size > 1:
            align = math.lcm(align, self.cp_size * self.tp_size)
        return math.lcm(align, self.seq_round) if self.mode == "batch" else align

    @property
    def resolved_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.capacity

    @property
    def resolved_pack_multiple(self) -> int:
        return self.pack_multiple if self.pack_multiple is not None else self.align

    @property
    def plan_capacity(self) -> int:
        """The bin size the planner fills: the capacity, or with `pad_to="multiple"` the largest
        multiple of `pack_multiple` not above it (so rounding a pack up never exceeds capacity)."""
        if self.pad_to == "multiple":
            return self.capacity // self.resolved_pack_multiple * self.resolved_pack_multiple
        return self.capacity

    @property
    def resolved_memory_budget(self) -> int:
        if self.memory_budget is None:
            return default_memory_budget()
        return parse_bytes(self.memory_budget)

    def __post_init__(self) -> None:
        # The Python API takes what callers have at hand: paths as os.PathLike (stored as str, as the
        # manifest records them) and numpy scalars (stored as the Python value). Nothing is refused
        # here: validate() names what cannot be used.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            plain = as_python(value, path=f.name == "output")
            if f.name in ("inputs", "keep_columns") and isinstance(plain, (list, tuple)):
                plain = [as_python(v, path=f.name == "inputs") for v in plain]
            if f.name == "limits" and isinstance(plain, dict):
                plain = {k: as_python(v) for k, v in plain.items()}
            if plain is not value:
                setattr(self, f.name, plain)

    def validate(self) -> PackConfig:
        """Raise PackctlError naming the option and the fix for any unusable combination, before
        any work: every value of its type and in its range, the options that go together, one pack
        within the memory budget, and every option writable into the manifest."""
        self.check_types()
        blended = bool(self.sources) or self.blend is not None
        if not self.inputs and not blended:
            raise PackctlError("no INPUT given: pass Parquet files, directories or globs")
        if not self.output:
            raise PackctlError("no output directory: pass -o OUT")
        for f in dataclasses.fields(self):
            if f.metadata.get("choices"):
                _choice(f.name, getattr(self, f.name), f.metadata["choices"])
        for name, f in FIELDS.items():
            if f.type in ("int", "int | None") and getattr(self, name) is not None:
                _in_range(name, getattr(self, name))
        if self.tokenizer is None:  # how to tokenize means nothing without a tokenizer: never silently ignored
            given = [name for name in TOKENIZE_OPTIONS[1:] if getattr(self, name) != FIELDS[name].default]
            if given:
                raise PackctlError(f"{_flag(given[0])} tells how to tokenize raw records: it needs --tokenizer DIR "
                                   "(docs/tokenize.md); INPUT of token ids takes neither")
        reserved = {*RESERVED_COLUMNS, self.tokens_column, self.labels_column or "labels"}
        clash = [c for c in self.keep_columns if c in reserved]
        if clash:
            raise PackctlError(f"--keep-columns {clash[0]}: that name is an input or output column packctl writes "
                               "itself; keep another column, or rename it in the input")
        if self.weight_column is not None and self.weight_column in (self.tokens_column,
                                                                     self.labels_column or "labels"):
            raise PackctlError(f"--weight-column {self.weight_column!r}: name an input column of one number per "
                               "sequence (not the tokens or labels)")
        self._validate_groups()
        self._validate_share_prefix()
        self._validate_limits()
        self._validate_mixture()
        if len(set(self.keep_columns)) != len(self.keep_columns):
            raise PackctlError(f"--keep-columns {', '.join(self.keep_columns)}: a column is named twice")
        if self.epochs > 1 and self.order != "shuffle":
            raise PackctlError(f"--epochs {self.epochs} with --order {self.order}: every epoch would hold the same "
                               "packs in the same order; pass --order shuffle, or pack one epoch and iterate it "
                               f"{self.epochs} times")
        align = self.align
        if align > INT32_MAX:
            raise PackctlError(f"--seq-multiple {self.seq_multiple}, --cp-size {self.cp_size} and --tp-size "
                               f"{self.tp_size} make the alignment {align}, longer than any pack (2^31-1 tokens): "
                               "lower them")
        if self.capacity < align:
            raise PackctlError(
                f"--capacity {self.capacity} is smaller than the alignment {align} "
                f"(seq-multiple {self.seq_multiple}, cp {self.cp_size}, tp {self.tp_size}): raise --capacity")
        if self.capacity % align:
            larger = (self.capacity // align + 1) * align
            raise PackctlError(
                f"--capacity {self.capacity} is not a multiple of the alignment {align}: "
                f"use --capacity {self.capacity // align * align}" + (f" or {larger}" if larger <= INT32_MAX else ""))
        multiple = self.resolved_pack_multiple
        if multiple % align:
            raise PackctlError(f"--pack-multiple {multiple} is not a multiple of the alignment {align}")
        if multiple > self.capacity:
            raise PackctlError(f"--pack-multiple {multiple} is larger than --capacity {self.capacity}")
        self._validate_mode()
        self._validate_balance()
        self._check_pack_size()
        self._check_serializable()
        return self

    def check_types(self) -> None:
        """Every option of its declared type (a whole number, a string, a list of paths ...):
        the first check of validate(), and all that may be checked before the output path is
        used. It depends on nothing but the values, so every MPI rank raises it alike."""
        for name in FIELDS:
            wanted = _type_problem(name, getattr(self, name))
            if wanted:
                raise PackctlError(f"{_flag(name)} {getattr(self, name)!r}: must be {wanted}", everywhere=True)
        if is_url(self.output):
            from packctl.store import is_written_url  # loaded for URLs only
            if not is_written_url(self.output):  # s3:// is written (output/stored.py); other URLs are refused
                refuse_url(self.output, "output")

    def _check_pack_size(self) -> None:
        """The largest pack (a micro-batch in batch mode) fits a shard and the memory budget."""
        flag, tokens = ("--max-tokens", self.resolved_max_tokens) if self.mode == "batch" else (
            "--capacity", self.capacity)
        budget = self.resolved_memory_budget
        needed = PACK_BYTES_PER_TOKEN * tokens
        if needed > budget:
            which = f"--memory-budget {_size(budget)}" + (" (a quarter of RAM)" if self.memory_budget is None else "")
            what = "micro-batch" if self.mode == "batch" else "pack"
            raise PackctlError(
                f"{flag} {tokens}: one {what} holds input_ids, labels and position_ids, 3 int32 columns of {tokens:,} "
                f"tokens ({_size(needed)}), more than {which}; lower {flag} or give --memory-budget "
                f"{_size(needed, up=True)} or more")
        if self.shard_rows * tokens > INT32_MAX:
            most = INT32_MAX // tokens
            raise PackctlError(
                f"--shard-rows {self.shard_rows} x {flag} {tokens} exceeds 2^31-1 tokens per shard (Parquet list "
                f"offsets are int32): use --shard-rows {most}" + (" or less" if most > 1 else ""))

    def _check_serializable(self) -> None:
        """Every option goes into the manifest as JSON: a value that cannot would fail the run at
        its very end, after all the work."""
        for name, value in self.to_dict().items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise PackctlError(f"{_flag(name)} {value!r}: cannot be recorded in the manifest ({exc})") from None

    def _validate_groups(self) -> None:
        """--group-column: a plain input column, and the options that would cut or count a group's
        members one by one refused."""
        self._check_group_scope()
        if self.group_column is None:
            return
        if not isinstance(self.group_column, str) or self.group_column in (
                self.tokens_column, self.labels_column or "labels", *RESERVED_COLUMNS):
            raise PackctlError(f"--group-column {self.group_column!r}: name an input column of one group value per "
                               "row (not the tokens, labels or a column packctl writes)")
        refused = [("--algorithm split", self.algorithm == "split", "it cuts sequences across packs"),
                   ("--mode batch", self.mode == "batch", "micro-batches are formed by sequence length"),
                   ("--max-seqs-per-bin", self.max_seqs_per_bin is not None, "the planner places whole groups")]
        for flag, given, why in refused:
            if given:
                raise PackctlError(f"{flag} cannot be combined with --group-column ({why}); drop one of them")
        if self.group_scope != "step":
            return
        if self.dp_size is None:
            raise PackctlError("--group-scope step needs --dp-size and --micro-batches or --step-tokens: a group is "
                               "kept within one optimizer step, so the steps are planned")
        refused = [("--too-long split", self.too_long == "split", "the pieces of a split sequence follow "
                    "each other over several steps"),
                   ("--warmup-shapes", self.warmup_shapes, "warm-up steps are formed from packs of "
                    "every shape, which would part a group's packs")]
        for flag, given, why in refused:
            if given:
                raise PackctlError(f"{flag} cannot be combined with --group-scope step ({why}); drop one of them")

    def _validate_limits(self) -> None:
        """--limit COL=N: N a whole number in [1, 2^31-1], COL an input column that is not the tokens,
        the labels, a column packctl writes or a kept column (COL is written as the limit's own int64
        column), nor one whose per-pack sum COL_sum would take such a name; batch mode takes none."""
        if not self.limits:
            return
        if self.mode == "batch":
            raise PackctlError("--limit cannot be combined with --mode batch (a budget bounds a pack; padded "
                               "micro-batches are formed by sequence length only); drop one of them")
        written = {*RESERVED_COLUMNS, self.tokens_column, self.labels_column or "labels"}
        for column, most in self.limits.items():
            given = f"--limit {column}={most}"
            if not column:
                raise PackctlError(f"{given}: name the input column before '=' (--limit images=8)")
            if isinstance(most, bool) or not isinstance(most, int):
                raise PackctlError(f"{given}: N must be a whole number >= 1 (the most a pack may hold of {column})")
            if not 1 <= most <= INT32_MAX:
                raise PackctlError(f"{given}: N must be a whole number in [1, {INT32_MAX:,}] (the most a pack "
                                   f"may hold of {column}; a pack holds at most 2^31-1 tokens)")
            if column in written:
                raise PackctlError(f"{given}: {column!r} is the tokens, the labels or a column packctl writes; "
                                   "name an input column of one whole number per sequence")
            if column in self.keep_columns:
                raise PackctlError(f"{given} with --keep-columns {column}: --limit writes {column} itself (int64, "
                                   f"one value per sequence); drop {column} from --keep-columns")
            sum_name = limit_sum_name(column)
            if sum_name in self.limits or sum_name in written or sum_name in self.keep_columns:
                raise PackctlError(f"{given}: its per-pack sum is written as {sum_name}, a name another column "
                                   "has; rename the column in the input")

    def source_entries(self) -> list[SourceEntry]:
        """The sources of a blend, in the order given, each checked: a name, one path or a list of
        them, a finite weight > 0, a cap > 0 (TOML: `max-repeat` or `max_repeat`)."""
        entries = []
        for name, table in self.sources.items():
            table = {str(k).replace("-", "_"): v for k, v in table.items()}
            unknown = sorted(set(table) - {"path", "weight", "max_repeat"})
            if unknown:
                raise PackctlError(f"--source {name}: unknown key {unknown[0]!r}; a source has path, weight and "
                                   "max-repeat")
            paths = table.get("path")
            paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
            if not name or not isinstance(paths, list) or not paths or not all(
                    isinstance(p, (str, os.PathLike)) and str(p) for p in paths):
                raise PackctlError(f"--source {name!r}: needs a path (any INPUT packctl reads), e.g. --source "
                                   f"{name or 'web'}=data/web:0.5 or path = \"data/web\" in [sources.{name or 'web'}]")
            weight, cap = table.get("weight"), table.get("max_repeat")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight <= 0:
                raise PackctlError(f"--source {name}: weight {weight!r} must be a number > 0 (its share of the "
                                   "blend; the weights are normalized to sum 1)")
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                    or not math.isfinite(cap) or cap <= 0):
                raise PackctlError(f"--source {name}: max-repeat {cap!r} must be a number > 0 (the most passes "
                                   "over the source; 1: each row at most once)")
            entries.append(SourceEntry(name=name, paths=tuple(os.fspath(p) for p in paths), weight=float(weight),
                                       max_repeat=None if cap is None else float(cap)))
        return entries

    def _validate_mixture(self) -> None:
        if not self.sources:
            if self.blend is None:
                given = [f for f, default in (("tokens", None), ("epochs_of", None), ("mix_unit", "tokens"),
                                              ("max_repeat", 1.0)) if getattr(self, f) != default]
                if given:
                    raise PackctlError(f"{_flag(given[0])} sizes a blend of sources: give the inputs as --source "
                                       "NAME=PATH:WEIGHT (docs/mixtures.md)")
            return
        if self.inputs:
            raise PackctlError(f"INPUT {self.inputs[0]} with --source: give every input as a source "
                               f"(--source NAME={self.inputs[0]}:WEIGHT), or drop --source")
        entries = self.source_entries()
        if not (isinstance(self.max_repeat, (int, float)) and not isinstance(self.max_repeat, bool)
                and math.isfinite(self.max_repeat) and self.max_repeat > 0):
            raise PackctlError(f"--max-repeat {self.max_repeat!r}: must be a number > 0 (the most passes over a "
                               "source)")
        if self.tokens is not None and self.epochs_of is not None:
            raise PackctlError("--tokens and --epochs-of both size the blend; keep one")
        if self.epochs_of is not None and self.epochs_of not in self.sources:
            raise PackctlError(f"--epochs-of {self.epochs_of}: not a source; name one of "
                               f"{', '.join(e.name for e in entries)}")
        if self.share_prefix:
            raise PackctlError("--share-prefix with --source: a blend may draw a group more than once, and a shared "
                               "prefix is stored once a group; pack the grouped source with --share-prefix on its own")

    def _validate_share_prefix(self) -> None:
        """--share-prefix: groups to share within, one pack each, and nothing that writes a
        segment per input row or cuts a pack's sequences apart (docs/shared-prefix.md lists them)."""
        if self.prefix_column is not None and not self.share_prefix:
            raise PackctlError(f"--prefix-column {self.prefix_column} needs --share-prefix (it bounds the prefix a "
                               "group shares)")
        if not self.share_prefix:
            return
        if self.group_column is None:
            raise PackctlError("--share-prefix needs --group-column COL: a prefix is shared by the rows of one group "
                               "(a preference pair, the rollouts of one prompt)")
        if self.prefix_column is not None and (not isinstance(self.prefix_column, str) or self.prefix_column in (
                self.tokens_column, self.labels_column or "labels", self.group_column, *RESERVED_COLUMNS)):
            raise PackctlError(f"--prefix-column {self.prefix_column!r}: name an input column of one whole number "
                               "per row, the length of its prompt (not the tokens, labels, groups or a column "
                               "packctl writes)")
        refused = [("--cp-size", self.cp_size > 1, "Transformer Engine's THD context-parallel split cannot express "
                    "a tree of segments"),
                   ("--group-scope step", self.group_scope == "step", "a shared group lies in one pack"),
                   ("--plan-only", self.plan_only, "a plan's readers rebuild flat sequences"),
                   ("--keep-columns", bool(self.keep_columns), "a prefix segment is no input row to take a value from"),
                   ("--weight-column", self.weight_column is not None, "a prefix segment is no input row to weigh"),
                   ("--limit", bool(self.limits), "a prefix segment is no input row to count")]
        for flag, given, why in refused:
            if given:
                raise PackctlError(f"{flag} cannot be combined with --share-prefix ({why}); drop one of them")

    def _check_group_scope(self) -> None:
        if self.group_scope != "pack" and self.group_column is None:
            raise PackctlError(f"--group-scope {self.group_scope} needs --group-column COL (the input column naming "
                               "each row's group)")

    def _validate_mode(self) -> None:
        if self.mode == "pack":
            if self.max_tokens is not None or self.seq_round != 1:
                raise PackctlError("--max-tokens and --seq-round apply to --mode batch")
            if self.shape_buckets is not None and self.pad_to != "multiple":
                raise PackctlError("--shape-buckets limits pack lengths, which only vary with --pad-to multiple "
                                   "(with --pad-to capacity every pack has one shape already)")
        else:
            if self.algorithm != "bfd" or self.pad_to != "capacity" or self.pack_multiple is not None:
                raise PackctlError("--mode batch forms padded micro-batches itself: drop --algorithm, --pad-to "
                                   "and --pack-multiple")
            if self.resolved_max_tokens < self.capacity:
                raise PackctlError(f"--max-tokens {self.resolved_max_tokens} is smaller than --capacity "
                                   f"{self.capacity} (the longest row): raise --max-tokens or lower --capacity")
        if self.warmup_shapes and self.dp_size is None:
            raise PackctlError("--warmup-shapes needs --dp-size (it orders the first steps over the ranks)")

    def _validate_balance(self) -> None:
        if not 0 <= self.attn_coeff < float("inf"):
            raise PackctlError(f"--attn-coeff {self.attn_coeff!r}: must be a number >= 0")
        if self.dp_size is None:
            given = [f"--{n.replace('_', '-')}" for n in ("micro_batches", "step_tokens", "ref_batch_size")
                     if getattr(self, n) is not None]
            if self.lr_scaling != "none":
                given.append("--lr-scaling")
            if self.balance_cost is not None:
                given.append("--balance-cost")
            if given:
                raise PackctlError(f"{', '.join(given)} need --dp-size (the number of data-parallel ranks)")
            return
        if (self.micro_batches is None) == (self.step_tokens is None):
            raise PackctlError("--dp-size needs exactly one of --micro-batches M (packs per rank per step) "
                               "or --step-tokens T")
        if self.ref_batch_size is not None and not 0 < self.ref_batch_size < float("inf"):
            raise PackctlError(f"--ref-batch-size {self.ref_batch_size!r}: must be a number > 0")
        if self.balance_cost is not None and self.balance_cost not in self.limits:
            given = ", ".join(f"--limit {c}={n}" for c, n in self.limits.items()) or "no --limit"
            raise PackctlError(f"--balance-cost {self.balance_cost}: not a limited column ({given}); it balances the "
                               f"per-pack sum of a --limit column: add --limit {self.balance_cost}=N, or name one "
                               "of the limited columns")

    @property
    def resolved_pack_order(self) -> str:
        """--pack-order with `auto` resolved: shuffle under --order shuffle, else planner."""
        if self.pack_order == PackOrder.AUTO:
            return "shuffle" if self.order == Order.SHUFFLE else "planner"
        return self.pack_order

    def carried(self) -> CarriedColumns:
        """The input columns this run reads beside tokens and labels (specs.py `CarriedColumns`)."""
        return CarriedColumns(keep=tuple(self.keep_columns), weight=self.weight_column, group=self.group_column,
                              limits=tuple(self.limits), prefix=self.prefix_column)

    def specs(self, labels_column: str | None = None) -> Specs:
        """The frozen spec of every stage (packctl/specs.py), built once per run from the options,
        which must be valid (`validate`). `labels_column`: the one scan resolved (the option may be
        None: labels if every file has them)."""
        batch = self.mode == Mode.BATCH
        align, plan_capacity = self.align, self.plan_capacity
        # a blend's steps are planned from runs of its consecutive uses, so each holds the blend
        # (docs/mixtures.md); groups under --group-scope step are planned the same way
        step_scope = ((self.group_column is not None and self.group_scope == GroupScope.STEP)
                      or (bool(self.sources) and self.group_column is None and self.balanced and not batch))
        windows = WindowOptions(
            capacity=plan_capacity, align=align, algorithm="batch" if batch else self.algorithm,
            too_long=TooLong(self.too_long), window=self.window, max_seqs_per_bin=self.max_seqs_per_bin,
            seed=self.seed, pool_size=self.pool_size, pool_strategy=PoolStrategy(self.pool_strategy),
            max_tokens=self.resolved_max_tokens if batch else None, pack_order=self.resolved_pack_order,
            step_packs=self.dp_size * self.micro_batches if step_scope and self.micro_batches is not None else None,
            step_tokens=self.step_tokens if step_scope else None, limits=tuple(self.limits.values()))
        balance = steps = None
        if self.balanced:
            balance = BalanceSpec(
                dp_size=self.dp_size, micro_batches=self.micro_batches, step_tokens=self.step_tokens,
                cost=Cost(self.balance), attn_coeff=float(self.attn_coeff),
                # a micro-batch's shape is its own: in batch mode sequences never move between them
                scope=BalanceScope.PACKS if batch else BalanceScope(self.balance_scope), padded_cost=batch,
                equal_counts=self.equal_counts, capacity=plan_capacity, max_seqs_per_bin=self.max_seqs_per_bin,
                grouping=StepGrouping(self.step_grouping), seed=self.seed, step_order=self.resolved_pack_order,
                limits=tuple(self.limits.values()),
                cost_column=list(self.limits).index(self.balance_cost) if self.balance_cost is not None else None)
            steps = StepSpec(lr_scaling=LrScaling(self.lr_scaling), ref_batch_size=self.ref_batch_size,
                             batch_unit=BatchUnit(self.batch_unit), warmup_shapes=self.warmup_shapes,
                             pin_groups=self.group_column is not None and self.group_scope == GroupScope.PACK)
        return Specs(
            scan=ScanSpec(tokens_column=self.tokens_column, labels_column=labels_column, carried=self.carried(),
                          skip_empty=self.skip_empty, pad_token_id=self.pad_token_id,
                          memory_budget=self.resolved_memory_budget, count_loss_tokens=self.balanced,
                          share_prefix=self.share_prefix),
            order=OrderSpec(order=Order(self.order), curriculum_order=CurriculumOrder(self.curriculum_order),
                            seed=self.seed, align=align, window=self.window, epochs=self.epochs,
                            skip_empty=self.skip_empty),
            groups=GroupSpec(column=self.group_column, scope=GroupScope(self.group_scope), capacity=plan_capacity,
                             align=align, dp_size=self.dp_size, micro_batches=self.micro_batches)
            if self.group_column is not None else None,
            windows=windows,
            lengths=LengthSpec(mode=Mode(self.mode), capacity=self.capacity, plan_capacity=plan_capacity,
                               pad_to=PadTo(self.pad_to), pack_multiple=self.resolved_pack_multiple, align=align,
                               too_long=TooLong(self.too_long), shape_buckets=self.shape_buckets,
                               max_tokens=self.resolved_max_tokens if batch else None),
            balance=balance,
            steps=steps,
            write=WriteSpec(shard_rows=self.shard_rows, epochs=self.epochs,
                            token_transfer=TokenTransfer(self.token_transfer), order=Order(self.order),
                            pad_token_id=self.pad_token_id, memory_budget=self.resolved_memory_budget,
                            carried=self.carried(), share_prefix=self.share_prefix),
            report=ReportSpec(algorithm=self.algorithm, order=Order(self.order), mode=Mode(self.mode),
                              capacity=self.resolved_max_tokens if batch else self.capacity, align=align,
                              epochs=self.epochs, seed=self.seed,
                              group_scope=GroupScope(self.group_scope) if self.group_column is not None else None,
                              shape_buckets=self.shape_buckets,
                              balance=self._balance_options() if self.balanced else None,
                              limits=dict(self.limits), share_prefix=self.share_prefix),
        )

    def _balance_options(self) -> dict[str, Any]:
        """The --dp-size options as `_metrics.json`'s `balance` records them."""
        return {"dp_size": self.dp_size, "micro_batches": self.micro_batches, "step_tokens": self.step_tokens,
                "cost": self.balance, "attn_coeff": float(self.attn_coeff), "scope": self.balance_scope,
                "step_grouping": self.step_grouping, "equal_counts": self.equal_counts,
                "lr_scaling": self.lr_scaling, "batch_unit": self.batch_unit,
                # --balance-cost: only when given, so metrics without it stay as they were
                **({"balance_cost": self.balance_cost} if self.balance_cost is not None else {})}

    def to_dict(self) -> dict[str, Any]:
        """Every option, resolved where a default depends on others (for the manifest). An option
        that changes nothing at its default is left out there (`--epochs 1`, `--pack-order` planner,
        `--group-scope pack`, no --plan-only, --limit, --balance-cost, tokenizer, blend or
        --share-prefix): what a run records, and so its shards' bytes, depends only on the options
        it uses."""
        out = dataclasses.asdict(self)
        out["pack_multiple"] = self.resolved_pack_multiple
        out["memory_budget"] = self.resolved_memory_budget
        if self.epochs == 1:
            del out["epochs"]
        out["pack_order"] = self.resolved_pack_order
        if out["pack_order"] == "planner":
            del out["pack_order"]
        if self.group_scope == "pack":
            del out["group_scope"]
        if not self.plan_only:
            del out["plan_only"]
        if not self.limits:
            del out["limits"]
        if self.balance_cost is None:
            del out["balance_cost"]
        if self.tokenizer is None:  # the tokenization options mean nothing without a tokenizer
            for key in TOKENIZE_OPTIONS:
                del out[key]
        if not self.sources and self.blend is None:  # the options of a blend mean nothing without one
            for name in MIXTURE_OPTIONS:
                del out[name]
        else:
            out["sources"] = {entry.name: entry.as_dict() for entry in self.source_entries()}
        if not self.share_prefix:
            del out["share_prefix"], out["prefix_column"]
        return out


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PackctlError(f"{_flag(name)} {value!r}: choose one of {', '.join(allowed)}")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def as_python(value: Any, *, path: bool = False) -> Any:
    """A numpy scalar as its Python value (np.int64(8) -> 8), and with `path` an os.PathLike as its
    str; anything else as it is: how every options object of the Python API takes what callers
    have at hand. numpy is not imported: the options load without it."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    if path and isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


# What each declared field type accepts (bool is an int in Python, and never a number here).
_TYPES = {
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list[str]": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v)),
    "dict[str, int]": ("a table of column = limit, e.g. {images = 8}",
                       lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)),
    "dict[str, dict]": ("a table of sources, e.g. [sources.web] path = \"data/web\", weight = 0.6",
                        lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(e, dict)
                                                              for k, e in v.items())),
    "int | str": ("a size such as 4GiB, 512M or 1000000",
                  lambda v: isinstance(v, (int, float, str)) and not isinstance(v, bool)),
}
_LISTS = {"inputs": "a list of paths (str or os.PathLike), e.g. ['data']",
          "keep_columns": "a list of column names"}


def _type_problem(name: str, value: Any) -> str | None:
    """What option `name` must be when `value` is not of its type (None when it is)."""
    declared = FIELDS[name].type
    optional = declared.endswith(" | None")
    if value is None and optional:
        return None
    wanted, accepts = _TYPES[declared.removesuffix(" | None")]
    if accepts(value):
        return None
    if name in _COUNTS:
        wanted = f"{wanted} of {_COUNTS[name]}"
    return _LISTS.get(name, wanted) + (" (or unset)" if optional else "")


# What a whole-number option counts, named where a value is not one: `--capacity 4096.5: must be
# a whole number of tokens`.
_COUNTS = {"capacity": "tokens", "max_tokens": "tokens", "step_tokens": "tokens", "pack_multiple": "tokens",
           "seq_multiple": "tokens", "seq_round": "tokens", "window": "sequences", "max_seqs_per_bin": "sequences",
           "pool_size": "sequences", "shard_rows": "packs", "micro_batches": "packs", "shape_buckets": "shapes",
           "epochs": "epochs", "cp_size": "ranks", "tp_size": "ranks", "dp_size": "ranks"}


def from_command_line(name: str, text: str) -> Any:
    """The value of PackConfig's number option `name` as typed on the command line: a whole number
    for a whole-number option, any number Python writes for a number option; other text is kept as
    typed, and validate() refuses it in the words it has for a value of the wrong type from a
    --config file or the Python API alike (`check_types`):

        >>> from_command_line("capacity", "4096"), from_command_line("attn_coeff", "1e-3")
        (4096, 0.001)
        >>> from_command_line("capacity", "4096.0")   # -> --capacity '4096.0': must be a whole number of tokens
        '4096.0'
    """
    declared = FIELDS[name].type.removesuffix(" | None")
    if declared == "int" and re.fullmatch(r"[+-]?[0-9]+", text.replace("_", "")):  # ASCII digits, as int() needs
        return int(text)
    if declared == "float" and re.fullmatch(r"[+-]?([0-9_.]+([eE][+-]?[0-9]+)?|inf|infinity|nan)", text.strip().lower()):
        try:
            return float(text)
        except ValueError:
            return text
    return text


def command_line_values(flags: dict[str, Any]) -> dict[str, Any]:
    """PackConfig field values from the flags of a command: each number option's text read by
    `from_command_line` (None: not given)."""
    return {name: from_command_line(name, value) if isinstance(value, str) and FIELDS[name].type.removesuffix(
        " | None") in ("int", "float") else value for name, value in flags.items()}


# The range of each whole-number option, and why its bound: (lowest, highest, why). The others are
# counts: at least 1, and at most 2^63-1 (they are held as int64).
_RANGES: dict[str, tuple[int, int, str]] = {
    "capacity": (1, INT32_MAX, "token offsets in a pack are int32"),
    "max_tokens": (1, INT32_MAX, "token offsets in a micro-batch are int32"),
    "shard_rows": (1, INT32_MAX, "a shard holds at most 2^31-1 tokens"),
    "pack_multiple": (1, INT32_MAX, "a pack holds at most 2^31-1 tokens"),
    "seq_multiple": (1, INT32_MAX, "a pack holds at most 2^31-1 tokens"),
    "seq_round": (1, INT32_MAX, "a pack holds at most 2^31-1 tokens"),
    "cp_size": (1, INT32_MAX, "a sequence is padded to a multiple of 2*cp"),
    "tp_size": (1, INT32_MAX, "a sequence is padded to a multiple of cp*tp"),
    "dp_size": (1, 2**20, "more data-parallel ranks than a cluster holds; planning works per rank and step"),
    "micro_batches": (1, INT32_MAX, "micro-batches are numbered in int32"),
    "epochs": (1, MAX_EPOCHS, "epoch folders are numbered epoch-00000 to epoch-99999"),
    "seed": (0, INT64_MAX, "seeds are 63-bit"),
    "pad_token_id": (0, INT32_MAX, "token ids are int32"),
}


def _in_range(name: str, value: int) -> None:
    low, high, why = _RANGES.get(name, (1, INT64_MAX, "counts are int64"))
    if value < low:
        raise PackctlError(f"{_flag(name)} {value}: must be a whole number >= {low}")
    if value > high:
        raise PackctlError(f"{_flag(name)} {value}: must be at most {high:,} ({why})")


def _size(n: int, *, up: bool = False) -> str:
    """Bytes for a message: 25769803764 -> '24.0GiB'; `up` rounds up, so the size given is enough."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = math.ceil(n * 10 / scale) / 10 if up else n / scale
            return f"{value:.1f}{unit}"
    return f"{n}B"


FIELDS = {f.name: f for f in dataclasses.fields(PackConfig)}
# --tokenizer and the options of how it tokenizes (recorded only with a tokenizer)
TOKENIZE_OPTIONS = ("tokenizer", "format", "loss_on", "text_column", "messages_column", "prompt_column",
                    "completion_column", "tools_column", "add_bos", "add_eos")

# The options that change what `pack` plans (declared with `planning=True`): `packctl stats INPUT`
# takes every one of them, with the same flag, help and meaning, for its what-if.
PLANNING_OPTIONS = tuple(name for name, f in FIELDS.items() if f.metadata["planning"])


def option_help(name: str, *, with_choices: bool = True) -> str:
    """The --help text of an option: its choices (unless the caller shows them otherwise, as the
    CLI does in the option's metavar), its help, its default."""
    f = FIELDS[name]
    meta = f.metadata
    text = meta["help"]
    if meta["choices"] and with_choices:
        text = f"{'|'.join(meta['choices'])}: {text}"
    shown = meta["shown_default"]
    if shown is None and f.default is not dataclasses.MISSING and f.default is not None:
        if meta["switch"]:
            shown = f"--{name.replace('_', '-')}" if f.default else None
        else:
            shown = f"{f.default:_}".replace("_", ",") if isinstance(f.default, int) else str(f.default)
    return f"{text}  [default: {shown}]" if shown else text


def choices_of(name: str) -> tuple[str, ...]:
    """The values an option accepts: choices_of("order") -> ("input", "shuffle", "curriculum")."""
    return FIELDS[name].metadata["choices"]


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into PackConfig field values (keys may use `-` or `_`).

    A `[pack]` table is read if present, else the top level. Unknown keys, a key given in both
    spellings and values of the wrong type are errors naming the key as the file spells it:

        pack.toml: too-long = 3: must be a string
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")  # TOML is UTF-8; editors may add a byte-order mark
    except FileNotFoundError:
        raise PackctlError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise PackctlError(f"{path}: is a directory; --config takes a TOML file") from None
    except UnicodeDecodeError as exc:
        raise PackctlError(f"{path}: not UTF-8 text (byte {exc.start}); a --config file is TOML, saved as "
                           "UTF-8") from None
    except OSError as exc:
        raise PackctlError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    try:  # imported here: the options and --help read no TOML
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PackctlError(f"{path}: not valid TOML ({exc})") from None
    if "pack" in data:
        if not isinstance(data["pack"], dict):
            raise PackctlError(f"{path}: pack = {_toml(data['pack'])}: must be a table of options ([pack])")
        stray = [key for key in data if key != "pack" and key.replace("-", "_") in FIELDS]
        if stray:
            raise PackctlError(f"{path}: {stray[0]} is outside the [pack] table, which is the one read when the "
                               "file has one; move it into [pack]")
        data = data["pack"]
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = _TOML_NAMES.get(key, key.replace("-", "_"))
        if name not in FIELDS:
            raise PackctlError(f"{path}: unknown key {key!r}; {_closest_key(key)}")
        if name in spelled:
            raise PackctlError(f"{path}: {spelled[name]} and {key} are the same option; keep one")
        spelled[name] = key
        if name == "inputs" and isinstance(value, str):
            value = [value]
        wanted = _type_problem(name, value)
        if wanted:
            raise PackctlError(f"{path}: {key} = {_toml(value)}: must be {wanted.removesuffix(' (or unset)')}")
        values[name] = value
    return values


# TOML keys spelled as their flag rather than their field: limit = {images = 8} is --limit images=8.
_TOML_NAMES = {"limit": "limits"}


def _closest_key(key: str) -> str:
    """The known key nearest to a misspelled one, spelled as the file spells its keys, or every
    known key when none is near: 'capacty' -> "did you mean 'capacity'?", 'too-lnog' -> "did you
    mean 'too-long'?"."""
    import difflib  # here: only a misspelled config file needs it

    close = difflib.get_close_matches(key.replace("-", "_"), sorted({*FIELDS, *_TOML_NAMES}), n=1)
    if not close:
        return f"known keys: {', '.join(sorted(FIELDS))}"
    spelled = close[0].replace("_", "-") if "-" in key else close[0]
    return f"did you mean {spelled!r}?"


def _toml(value: Any) -> str:
    """A value as TOML writes it, for messages: 'x' -> "x", [1, 2] -> [1, 2], True -> true."""
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:  # nan, inf
        return str(value).lower()


def build_config(file_values: dict[str, Any] | None = None, **flags: Any) -> PackConfig:
    """Merge config-file values with flags given on the command line (None = not given)."""
    values = dict(file_values or {})
    values.update({k: v for k, v in flags.items() if v is not None and v != []})  # [] : a repeatable flag not given
    if isinstance(flags.get("limits"), (list, tuple)) and flags["limits"]:
        values["limits"] = parse_limits(flags["limits"])
    if isinstance(flags.get("sources"), (list, tuple)) and flags["sources"]:
        values["sources"] = parse_sources(flags["sources"])
    return PackConfig(**values)


# The options of a blend of sources (docs/mixtures.md): recorded only where a run blends.
MIXTURE_OPTIONS = ("sources", "blend", "mix_unit", "tokens", "epochs_of", "max_repeat")


@dataclass(frozen=True)
class SourceEntry:
    """One source of a blend: its name, its input paths (any INPUT packctl reads), its weight as
    given (the blend normalizes the weights to sum 1) and the most passes over it (None: --max-repeat)."""

    name: str
    paths: tuple[str, ...]
    weight: float
    max_repeat: float | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.paths[0] if len(self.paths) == 1 else list(self.paths),
                               "weight": self.weight}
        if self.max_repeat is not None:
            out["max_repeat"] = self.max_repeat
        return out


def parse_sources(given: list[str]) -> dict[str, dict]:
    """The --source flags, NAME=PATH:WEIGHT[:MAX_REPEAT] each, as the table a TOML file gives
    ({NAME: {path, weight, max_repeat}}), in the order given; PATH may hold colons (the numbers
    are the last fields):

        >>> parse_sources(["web=data/web:0.6", "code=x:code:0.4:2"])
        {'web': {'path': 'data/web', 'weight': 0.6}, 'code': {'path': 'x:code', 'weight': 0.4, 'max_repeat': 2.0}}
    """
    sources: dict[str, dict] = {}
    for text in given:
        name, sign, rest = str(text).partition("=")
        name = name.strip()
        if not sign or not name or ":" not in rest:
            raise PackctlError(f"--source {text!r}: expected NAME=PATH:WEIGHT[:MAX_REPEAT], e.g. --source "
                               "web=data/web:0.6 or --source code=data/code:0.3:2")
        fields = rest.rsplit(":", 2)
        if len(fields) == 3 and _is_number(fields[1]) and _is_number(fields[2]):
            path, weight, cap = fields[0], float(fields[1]), float(fields[2])
        else:
            path, number = rest.rsplit(":", 1)
            if not _is_number(number):
                raise PackctlError(f"--source {text!r}: WEIGHT {number!r} is not a number; expected "
                                   f"NAME=PATH:WEIGHT[:MAX_REPEAT], e.g. --source {name}=data/{name}:0.5")
            weight, cap = float(number), None
        if name in sources:
            raise PackctlError(f"--source {name} is given twice; give every source one name")
        sources[name] = {"path": path, "weight": weight, **({"max_repeat": cap} if cap is not None else {})}
    return sources



def parse_limits(given: list[str]) -> dict[str, int]:
    """The --limit flags, COL=N each, as {COL: N} in the order given; a spelling that is not
    COL=N with N a whole number, or a column given twice, is refused naming it:

        >>> parse_limits(["images=8", "image_tokens=16384"])
        {'images': 8, 'image_tokens': 16384}
    """
    limits: dict[str, int] = {}
    for text in given:
        column, sign, number = str(text).rpartition("=")
        if not sign or not column.strip():
            raise PackctlError(f"--limit {text!r}: expected COL=N, an input column and the most a pack may hold of "
                               "it, e.g. --limit images=8")
        column, number = column.strip(), number.strip().replace("_", "")
        if not re.fullmatch(r"[+-]?[0-9]+", number):  # ASCII digits: int() refuses '²' that isdigit() takes
            raise PackctlError(f"--limit {text!r}: N must be a whole number >= 1 (the most a pack may hold of "
                               f"{column}), e.g. --limit {column}=8")
        if column in limits:
            raise PackctlError(f"--limit {column} is given twice ({column}={limits[column]} and {text}); keep one")
        limits[column] = int(number)
    return limits

"""The options of `packctl pack`: one dataclass shared by the CLI, TOML config files and the API.

Every field is a CLI flag (`capacity` -> `--capacity`, `too_long` -> `--too-long`) and a TOML key
(either spelling). Precedence: defaults < `--config FILE` < flags given on the command line.

    >>> cfg = PackConfig(inputs=["sample_data"], output="out", capacity=4096, cp_size=2)
    >>> cfg.align, cfg.resolved_pack_multiple
    (4, 4)
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packctl.errors import PackctlError
from packctl.schema import INT32_MAX

ALGORITHMS = ("concat", "ffd", "bfd", "mffd", "ffs", "split", "pool")
POOL_STRATEGIES = ("closest", "first")
ORDERS = ("input", "shuffle", "curriculum")
CURRICULUM_ORDERS = ("asc", "desc")
PAD_TO = ("capacity", "multiple")
TOO_LONG = ("error", "drop", "truncate", "split")
BALANCE_COSTS = ("tokens", "attention")
BALANCE_SCOPES = ("packs", "sequences")
STEP_GROUPINGS = ("cost", "order")
LR_SCALINGS = ("none", "linear", "sqrt")
BATCH_UNITS = ("sequences", "tokens")
MODES = ("pack", "batch")
TOKEN_TRANSFERS = ("auto", "exchange", "read")

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_bytes(value: str | int, option: str = "memory_budget") -> int:
    """`"4GiB"`, `"512M"`, `"1e9"` or an int -> bytes.

    >>> parse_bytes("2G"), parse_bytes(1024)
    (2147483648, 1024)
    """
    if isinstance(value, int):
        return value
    text = str(value).strip().lower().replace("_", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(number):].strip()
    try:
        scaled = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise PackctlError(f"--{option.replace('_', '-')} {value!r}: expected a size such as 4GiB, 512M or 1000000") from None
    return int(scaled)


def default_memory_budget() -> int:
    """A quarter of physical memory: room for the token cache without crowding the machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


@dataclass
class PackConfig:
    """Everything `packctl pack` needs. Field names are the flag names with `_` for `-`.

    Args:
        inputs: Parquet files, directories (every `*.parquet` below) or globs.
        output: output directory OUT; refused if it exists unless `overwrite`.
        capacity: tokens per pack (the bin size).
        algorithm: one of concat, ffd, bfd, mffd, ffs, split, pool (docs/algorithms.md).
        pool_size: items waiting in the pool of `pool` (at most this many bins of reordering).
        pool_strategy: `pool` picks the largest item that fits ("closest") or the oldest ("first").
        order: input, shuffle (seeded) or curriculum (by padded length, ties by global id).
        curriculum_order: asc or desc, for `order="curriculum"`.
        seed: seed of `shuffle` order and of the `ffs` algorithm.
        window: sequences per planning window (global positions; each window is packed on its own).
        cp_size: context-parallel size; with cp > 1 each sequence is padded to a multiple of 2*cp*tp.
        tp_size: tensor-parallel size (sequence parallelism pads to a multiple of tp).
        seq_multiple: extra per-sequence multiple (e.g. 8 or 64 for kernels that like aligned lengths).
        pad_to: "capacity" (every pack exactly `capacity` tokens) or "multiple" (rounded up to
            `pack_multiple`).
        pack_multiple: pack-length multiple for `pad_to="multiple"`; default the alignment.
        pad_token_id: token id written into padding.
        max_seqs_per_bin: at most this many sequences in a pack (None: no limit).
        too_long: what to do with a sequence longer than the capacity: error, drop, truncate, split.
        tokens_column: input column of token ids.
        labels_column: input column of labels; None uses `labels` when every input file has it,
            otherwise labels are the tokens.
        shard_rows: packs per output Parquet shard.
        skip_empty: leave empty sequences out instead of refusing them; they are counted in the
            manifest as `sequences_skipped_empty` (and in `sequences_dropped`).
        overwrite: replace an existing OUT.
        memory_budget: bytes of decoded tokens held in memory at once ("8GiB" also accepted).
        resume: continue an interrupted run with the same options and inputs, keeping the shards it
            finished (docs/errors.md); without an interrupted run, an ordinary run.
        token_transfer: how a rank gets the tokens of the packs it writes under MPI: "exchange" (sent
            by the rank that scanned their block), "read" (it reads the blocks itself: a filesystem every
            rank sees), "auto" (read when that decodes at most 1.5x the input, e.g. input order).
        mode: "pack" (THD packs) or "batch" (padded micro-batches: sequences sorted by length in
            each window, grouped while rows x padded length <= max_tokens; docs/format.md).
        max_tokens: batch mode: tokens of a padded micro-batch, rows x padded length (default
            `capacity`, the longest sequence).
        seq_round: batch mode: a micro-batch's padded length is its longest sequence rounded up
            to this multiple (with the alignment).
        shape_buckets: at most this many distinct padded lengths (batch mode, where each bucket
            also has a fixed number of rows) or pack lengths (`pad_to="multiple"`), chosen to
            minimize padding: few shapes for torch.compile.
        warmup_shapes: with dp_size, the first steps of the first window show every shape, so
            each shape compiles up front.
        dp_size: data-parallel ranks; given, every pack gets a `step`, `dp_rank` and `micro_batch`
            (docs/balancing.md). Needs `micro_batches` or `step_tokens`.
        micro_batches: packs per rank per optimizer step.
        step_tokens: instead of `micro_batches`, close a step once it holds this many tokens (then
            up to a multiple of dp_size packs): steps of varying size.
        balance: the cost shared out evenly: "tokens" or "attention" (a*L + L^2 per sequence).
        attn_coeff: `a` of the attention cost; 12 x hidden size weighs per-token FLOPs and
            attention FLOPs alike (0: attention alone).
        balance_scope: "packs" (share whole packs out) or "sequences" (then also move single
            sequences between the packs of a step, within capacity).
        step_grouping: "cost" (a window's steps made of packs of similar cost, run in a seeded
            order) or "order" (consecutive packs).
        equal_counts: every rank gets the same number of packs in every step (packs are split to
            make up the count when a step's packs are not a multiple of dp_size).
        lr_scaling: "none", "linear" or "sqrt": record `lr_scale` = (batch / ref_batch_size)^p per step.
        ref_batch_size: the batch size the learning rate was tuned for, in `batch_unit`s (None:
            the mean realized batch size).
        batch_unit: what a batch size counts: "sequences" or "tokens".
    """

    inputs: list[str] = field(default_factory=list)
    output: str = ""
    capacity: int = 4096
    algorithm: str = "bfd"
    pool_size: int = 128
    pool_strategy: str = "closest"
    order: str = "input"
    curriculum_order: str = "asc"
    seed: int = 0
    window: int = 100_000
    cp_size: int = 1
    tp_size: int = 1
    seq_multiple: int = 1
    pad_to: str = "capacity"
    pack_multiple: int | None = None
    pad_token_id: int = 0
    max_seqs_per_bin: int | None = None
    too_long: str = "error"
    tokens_column: str = "input_ids"
    labels_column: str | None = None
    shard_rows: int = 1024
    skip_empty: bool = False
    overwrite: bool = False
    memory_budget: int | str | None = None
    resume: bool = False
    token_transfer: str = "auto"
    mode: str = "pack"
    max_tokens: int | None = None
    seq_round: int = 1
    shape_buckets: int | None = None
    warmup_shapes: bool = False
    dp_size: int | None = None
    micro_batches: int | None = None
    step_tokens: int | None = None
    balance: str = "attention"
    attn_coeff: float = 0.0
    balance_scope: str = "sequences"
    step_grouping: str = "cost"
    equal_counts: bool = True
    lr_scaling: str = "none"
    ref_batch_size: float | None = None
    batch_unit: str = "tokens"

    @property
    def balanced(self) -> bool:
        """Whether packs get (step, dp_rank, micro_batch)."""
        return self.dp_size is not None

    @property
    def align(self) -> int:
        """Per-sequence padding multiple: lcm(seq_multiple, 2*cp*tp if cp > 1 else tp), and
        seq_round in batch mode."""
        parallel = 2 * self.cp_size * self.tp_size if self.cp_size > 1 else self.tp_size
        align = math.lcm(self.seq_multiple, parallel)
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

    def validate(self) -> "PackConfig":
        """Raise PackctlError naming the option and the fix for any unusable combination."""
        if isinstance(self.inputs, str) or not isinstance(self.inputs, (list, tuple)) or not all(
                isinstance(i, (str, os.PathLike)) for i in self.inputs):
            raise PackctlError(f"inputs = {self.inputs!r}: must be a list of paths")
        for name in ("output", "tokens_column", "labels_column", "algorithm", "order", "curriculum_order",
                     "pad_to", "too_long"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)) and not (name == "labels_column" and value is None):
                raise PackctlError(f"--{name.replace('_', '-')} {value!r}: must be a string")
        for name in ("seed", "pad_token_id"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise PackctlError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: must be a whole number")
        if not self.inputs:
            raise PackctlError("no INPUT given: pass Parquet files, directories or globs")
        if not self.output:
            raise PackctlError("no output directory: pass -o OUT")
        _choice("algorithm", self.algorithm, ALGORITHMS)
        _choice("pool_strategy", self.pool_strategy, POOL_STRATEGIES)
        _choice("order", self.order, ORDERS)
        _choice("curriculum_order", self.curriculum_order, CURRICULUM_ORDERS)
        _choice("pad_to", self.pad_to, PAD_TO)
        _choice("too_long", self.too_long, TOO_LONG)
        _choice("token_transfer", self.token_transfer, TOKEN_TRANSFERS)
        for name in ("capacity", "window", "cp_size", "tp_size", "seq_multiple", "shard_rows", "pool_size"):
            _positive(name, getattr(self, name))
        if self.max_seqs_per_bin is not None:
            _positive("max_seqs_per_bin", self.max_seqs_per_bin)
        if self.pack_multiple is not None:
            _positive("pack_multiple", self.pack_multiple)
        for name in ("skip_empty", "overwrite", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise PackctlError(f"{name.replace('_', '-')} = {getattr(self, name)!r}: must be true or false")
        if not 0 <= self.seed < 2**63:
            raise PackctlError(f"--seed {self.seed}: must be in [0, 2^63)")
        if not 0 <= self.pad_token_id <= INT32_MAX:
            raise PackctlError(f"--pad-token-id {self.pad_token_id}: must be in [0, {INT32_MAX}]")
        align = self.align
        if self.capacity < align:
            raise PackctlError(
                f"--capacity {self.capacity} is smaller than the alignment {align} "
                f"(seq-multiple {self.seq_multiple}, cp {self.cp_size}, tp {self.tp_size}): raise --capacity")
        if self.capacity % align:
            raise PackctlError(
                f"--capacity {self.capacity} is not a multiple of the alignment {align}: "
                f"use --capacity {self.capacity // align * align} or {(self.capacity // align + 1) * align}")
        multiple = self.resolved_pack_multiple
        if multiple % align:
            raise PackctlError(f"--pack-multiple {multiple} is not a multiple of the alignment {align}")
        if multiple > self.capacity:
            raise PackctlError(f"--pack-multiple {multiple} is larger than --capacity {self.capacity}")
        if self.shard_rows * self.capacity > INT32_MAX:
            raise PackctlError(
                f"--shard-rows {self.shard_rows} x --capacity {self.capacity} exceeds 2^31-1 tokens per shard: "
                "lower --shard-rows")
        if self.resolved_memory_budget <= 0:
            raise PackctlError("--memory-budget must be positive")
        self._validate_mode()
        self._validate_balance()
        return self

    def _validate_mode(self) -> None:
        _choice("mode", self.mode, MODES)
        _positive("seq_round", self.seq_round)
        if self.shape_buckets is not None:
            _positive("shape_buckets", self.shape_buckets)
        if not isinstance(self.warmup_shapes, bool):
            raise PackctlError(f"warmup-shapes = {self.warmup_shapes!r}: must be true or false")
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
            _positive("max_tokens", self.resolved_max_tokens)
            if self.resolved_max_tokens < self.capacity:
                raise PackctlError(f"--max-tokens {self.resolved_max_tokens} is smaller than --capacity "
                                   f"{self.capacity} (the longest row): raise --max-tokens or lower --capacity")
        if self.warmup_shapes and self.dp_size is None:
            raise PackctlError("--warmup-shapes needs --dp-size (it orders the first steps over the ranks)")

    def _validate_balance(self) -> None:
        _choice("balance", self.balance, BALANCE_COSTS)
        _choice("balance_scope", self.balance_scope, BALANCE_SCOPES)
        _choice("step_grouping", self.step_grouping, STEP_GROUPINGS)
        _choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        _choice("batch_unit", self.batch_unit, BATCH_UNITS)
        if not isinstance(self.equal_counts, bool):
            raise PackctlError(f"equal-counts = {self.equal_counts!r}: must be true or false")
        if isinstance(self.attn_coeff, bool) or not isinstance(self.attn_coeff, (int, float)) or not (
                0 <= self.attn_coeff < float("inf")):
            raise PackctlError(f"--attn-coeff {self.attn_coeff!r}: must be a number >= 0")
        if self.dp_size is None:
            given = [f"--{n.replace('_', '-')}" for n in ("micro_batches", "step_tokens", "ref_batch_size")
                     if getattr(self, n) is not None]
            if self.lr_scaling != "none":
                given.append("--lr-scaling")
            if given:
                raise PackctlError(f"{', '.join(given)} need --dp-size (the number of data-parallel ranks)")
            return
        _positive("dp_size", self.dp_size)
        if (self.micro_batches is None) == (self.step_tokens is None):
            raise PackctlError("--dp-size needs exactly one of --micro-batches M (packs per rank per step) "
                               "or --step-tokens T")
        if self.micro_batches is not None:
            _positive("micro_batches", self.micro_batches)
        if self.step_tokens is not None:
            _positive("step_tokens", self.step_tokens)
        if self.ref_batch_size is not None and (
                isinstance(self.ref_batch_size, bool) or not isinstance(self.ref_batch_size, (int, float))
                or not 0 < self.ref_batch_size < float("inf")):
            raise PackctlError(f"--ref-batch-size {self.ref_batch_size!r}: must be a number > 0")

    def to_dict(self) -> dict[str, Any]:
        """Every option, resolved where a default depends on others (for the manifest)."""
        out = dataclasses.asdict(self)
        out["pack_multiple"] = self.resolved_pack_multiple
        out["memory_budget"] = self.resolved_memory_budget
        return out


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PackctlError(f"--{name.replace('_', '-')} {value!r}: choose one of {', '.join(allowed)}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PackctlError(f"--{name.replace('_', '-')} {value!r}: must be a whole number >= 1")


FIELDS = {f.name: f for f in dataclasses.fields(PackConfig)}


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into PackConfig field values (keys may use `-` or `_`).

    A `[pack]` table is read if present, else the top level. Unknown keys are an error.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PackctlError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise PackctlError(f"{path}: not valid TOML ({exc})") from None
    if isinstance(data.get("pack"), dict):
        data = data["pack"]
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise PackctlError(f"{path}: unknown key {key!r}; known keys: {', '.join(sorted(FIELDS))}")
        if name == "inputs" and isinstance(value, str):
            value = [value]
        values[name] = value
    return values


def build_config(file_values: dict[str, Any] | None = None, **flags: Any) -> PackConfig:
    """Merge config-file values with flags given on the command line (None = not given)."""
    values = dict(file_values or {})
    values.update({k: v for k, v in flags.items() if v is not None})
    return PackConfig(**values)

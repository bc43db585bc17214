"""The rules over one shard's table beyond its packs' layout: the columns and their types
(`schema`), their lengths (`column-lengths`), and the columns that repeat or count what the packs
hold (`trl-lengths`, `loss-tokens`, `attn-cost`, `seq-weights`, the step and group rules'
collectors), then the per-pack rules (pack_rules.py).

    schema_violations      every column of the contract present, every declared column of its type
    rows_from_table        the table read as PackRows (`column-lengths`, nulls as `schema`)
    SHARD_RULES            the rest, in the order they report, each with what it needs

A shard rule is a function of `Shard` (the table, its PackRows and what the rules share, computed
once) returning the rules it finds broken. Adding one: a function and its row in SHARD_RULES (and
its line in docs/verify.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from packctl.contract.layout import Layout
from packctl.contract.schema import (BALANCE_COLUMNS, BATCH_COLUMNS, COLUMN, COLUMNS, CU_ENTRY, GROUP_IDS,
                                     LOSS_COLUMNS, NUM_LOSS_TOKENS, NUM_TOKENS, PACK_COLUMNS, PARENT_SEGMENTS,
                                     SEQ_LENGTHS,
                                     SEQ_LENS_PADDED, SEQ_LOSS_TOKENS, SEQ_WEIGHTS, SEQUENCE, STEP,
                                     STEP_LOSS_COLUMNS, STEP_LOSS_SEQUENCES, STEP_LOSS_TOKENS, SUM_SQ_SEQLEN,
                                     TOKEN, limit_columns)
from packctl.contract.thd import LossColumns, PackRows, loss_columns
from packctl.verify.pack_rules import PACK_RULES, Need, check_pack_rows, tiled_starts
from packctl.verify.violation import Violation

# A wrong type in these stops a shard's rules: the packs are read from the first, and several rules
# read where they go from the others; any other column's rules are skipped where its type is wrong.
READ_AS_NUMBERS = (*PACK_COLUMNS, *BALANCE_COLUMNS)


def schema_violations(schema: pa.Schema, format_version: int, shard: str) -> list[Violation]:
    """Rule `schema`: every column a shard of this format version holds is there, and every declared
    column present has its declared type (`packctl.contract.schema.COLUMNS`, in that order)."""
    found = []
    for column in COLUMNS:
        if column.name not in schema.names:
            if column.since is not None and format_version >= column.since:
                why = "" if column.since == 1 else f" (format version {column.since} requires it)"
                found.append(Violation("structure", "schema", f"column {column.name} is missing{why}", shard=shard))
        elif not schema.field(column.name).type.equals(column.arrow_type):
            found.append(Violation("structure", "schema", f"column {column.name} is {schema.field(column.name).type}, "
                                   f"the contract says {column.arrow_type}", shard=shard))
    return found


def readable_as_packs(schema: pa.Schema) -> bool:
    """The format's own columns are all there, and those of READ_AS_NUMBERS present have their types."""
    return all(name in schema.names for name in PACK_COLUMNS) and all(
        schema.field(name).type.equals(COLUMN[name].arrow_type) for name in READ_AS_NUMBERS if name in schema.names)


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray] | str:
    """(offsets from 0, values) of a list column, or what is wrong with it."""
    arr = table.column(name).combine_chunks()
    if arr.null_count:
        return f"column {name} has a null row"
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        return f"column {name} holds a null value"
    return offsets - offsets[0], values.to_numpy(zero_copy_only=False)


_OFFSETS = {TOKEN: "token_offsets", SEQUENCE: "seq_offsets", CU_ENTRY: "cu_offsets"}  # PackRows' offsets by level


def rows_from_table(table: pa.Table, *, shard: str | None = None) -> tuple[PackRows | None, list[Violation]]:
    """A shard's table -> PackRows (the format's own columns), or the violations that make its columns
    unusable together: the list columns of one level (tokens, sequences, cu entries) must have the
    same length row by row (`column-lengths`), no column may hold a null (`schema`)."""
    found: list[Violation] = []
    levels: dict[str, list[str]] = {}
    for name in PACK_COLUMNS:
        if COLUMN[name].is_list:
            levels.setdefault(COLUMN[name].per, []).append(name)
    read: dict[str, np.ndarray] = {}
    offsets: dict[str, np.ndarray] = {}
    for group in levels.values():
        for name in group:
            column = list_column(table, name)
            if isinstance(column, str):
                found.append(Violation("structure", "schema", column, shard=shard))
                return None, found
            offsets[name], read[name] = column
        first = offsets[group[0]]
        for name in group[1:]:
            if not np.array_equal(offsets[name], first):
                lens_a, lens_b = np.diff(first), np.diff(offsets[name])
                r = int(np.argmax(lens_a != lens_b))
                found.append(Violation(
                    "structure", "column-lengths",
                    f"{group[0]} has {lens_a[r]} entries but {name} has {lens_b[r]}; they must have the same length",
                    shard=shard, row=r, count=int(np.count_nonzero(lens_a != lens_b))))
    if found:
        return None, found
    num_tokens = table.column(NUM_TOKENS).combine_chunks()
    if num_tokens.null_count:
        return None, [Violation("structure", "schema", f"column {NUM_TOKENS} has a null row", shard=shard)]
    at = {_OFFSETS[level]: offsets[group[0]] for level, group in levels.items()}
    rows = PackRows(**at, **read, num_tokens=num_tokens.to_numpy(zero_copy_only=False))
    if PARENT_SEGMENTS in table.column_names and table.schema.field(PARENT_SEGMENTS).type.equals(
            COLUMN[PARENT_SEGMENTS].arrow_type):  # --share-prefix: the packs are trees (pack_rules.py)
        column = list_column(table, PARENT_SEGMENTS)
        if isinstance(column, str):
            return None, [Violation("structure", "schema", column, shard=shard)]
        parent_offsets, parents = column
        ragged = np.diff(parent_offsets) != np.diff(rows.seq_offsets)
        if ragged.any():
            return None, [Violation("structure", "column-lengths", f"{PARENT_SEGMENTS} does not hold one entry per "
                                    "sequence", shard=shard, row=int(np.argmax(ragged)), count=int(ragged.sum()))]
        rows.parent_segments = np.asarray(parents, dtype=np.int64)
    return rows, []


@dataclass
class StepLoss:
    """Per pack of every shard: step, recounted loss tokens and sequences with loss tokens, and the
    step_loss_tokens / step_loss_sequences it says; `check` sums them over each step (a step's
    packs may sit in several shards)."""

    parts: list = field(default_factory=list)

    def add(self, shard: str, step, loss_tokens, loss_sequences, step_tokens, step_sequences) -> None:
        self.parts.append((shard, np.arange(len(step)), *(np.asarray(a, np.int64) for a in (
            step, loss_tokens, loss_sequences, step_tokens, step_sequences))))

    def check(self) -> list[Violation]:
        """Rule `step-loss`: every pack's step_loss_tokens (step_loss_sequences) is the sum of the
        loss tokens (the sequences holding at least one) over all the packs of its step."""
        if not self.parts:
            return []
        shard = np.concatenate([np.full(len(p[1]), i) for i, p in enumerate(self.parts)])
        row, step, tokens, sequences, said_tokens, said_sequences = (
            np.concatenate([p[k] for p in self.parts]) for k in range(1, 7))
        found = []
        for name, per_pack, said in ((STEP_LOSS_TOKENS, tokens, said_tokens),
                                     (STEP_LOSS_SEQUENCES, sequences, said_sequences)):
            sums = np.bincount(step, weights=per_pack, minlength=int(step.max()) + 1).astype(np.int64)[step]
            bad = said != sums
            if bad.any():
                k = int(np.argmax(bad))
                found.append(Violation("structure", "step-loss", f"{name} is {said[k]}, but the packs of step "
                                       f"{step[k]} hold {sums[k]}", shard=self.parts[shard[k]][0], row=int(row[k]),
                                       count=int(bad.sum())))
        return found


@dataclass
class Shard:
    """One shard as the shard rules read it: its table, its packs, what the manifest says of the
    output, and the collectors of the rules checked over every shard (`steps`, `groups`)."""

    name: str
    table: pa.Table
    rows: PackRows
    layout: Layout | None
    sequences_in: int | None = None
    steps: StepLoss | None = None
    groups: Any = None  # packctl.verify.groups.GroupRule

    @cached_property
    def names(self) -> set[str]:
        return set(self.table.column_names)

    def typed(self, name: str) -> bool:
        """Column `name` is there with its declared type."""
        return name in self.names and self.table.schema.field(name).type.equals(COLUMN[name].arrow_type)

    @cached_property
    def tiles(self) -> bool:
        return tiled_starts(self.rows) is not None

    @cached_property
    def expected(self) -> LossColumns:
        """The loss columns recounted from the labels and sequence lengths."""
        return loss_columns(self.rows)

    @cached_property
    def seqs_per_row(self) -> np.ndarray:
        return np.diff(np.asarray(self.rows.seq_offsets, dtype=np.int64))


def _present(name: str) -> Need:
    return Need(f"{name} is there with its type", lambda s: s.typed(name))


LOSS_TYPED = Need("the loss columns there have their types",
                  lambda s: all(s.typed(n) for n in (*LOSS_COLUMNS, *STEP_LOSS_COLUMNS) if n in s.names))
TILED = Need("seq_lens_padded tile every pack", lambda s: s.tiles)
STEPS = Need("step and the step-loss columns are there (checked over every shard)",
             lambda s: s.steps is not None and {STEP, *STEP_LOSS_COLUMNS} <= s.names)
GROUPS = Need("group_ids is there with its type (checked over every shard)",
              lambda s: s.groups is not None and s.typed(GROUP_IDS))
LAYOUT = Need("the manifest's layout is readable", lambda s: s.layout is not None)
LIMITED = Need("the manifest's layout has limits (--limit)", lambda s: s.layout is not None and bool(s.layout.limits))
BATCH = Need("pad_to is batch (batch mode)", lambda s: s.layout.pad_to == "batch")


def trl_lengths(s: Shard) -> list[Violation]:
    """seq_lengths equals seq_lens_padded row by row (TRL takes its sequence boundaries from it).

    `seq_lengths` is TRL's name for the lengths that tile input_ids: TRL rebuilds position_ids and
    sequence boundaries from it; no null (rule `schema`)."""
    column = list_column(s.table, SEQ_LENGTHS)
    if isinstance(column, str):
        return [Violation("structure", "schema", column, shard=s.name)]
    offsets, values = column
    rows = s.rows
    padded = np.asarray(rows.seq_lens_padded)
    if np.array_equal(offsets, rows.seq_offsets) and np.array_equal(values, padded):
        return []
    same_len = np.diff(offsets) == np.diff(rows.seq_offsets)
    bad_rows = ~same_len
    for r in np.flatnonzero(same_len):
        a, b = offsets[r], rows.seq_offsets[r]
        n = offsets[r + 1] - a
        bad_rows[r] = not np.array_equal(values[a:a + n], padded[b:b + n])
    r = int(np.argmax(bad_rows))
    return [Violation("structure", "trl-lengths", f"{SEQ_LENGTHS} differs from {SEQ_LENS_PADDED}; TRL would "
                      "take other sequence boundaries than packctl's", shard=s.name, row=r,
                      count=int(np.count_nonzero(bad_rows)))]


def _per_pack_count(s: Shard, name: str, rule: str, want: np.ndarray, what: str) -> list[Violation]:
    got = s.table.column(name).to_numpy()
    bad = got != want
    if not bad.any():
        return []
    r = int(np.argmax(bad))
    return [Violation("structure", rule, f"{name} is {got[r]}, the {what} is {want[r]}", shard=s.name, row=r,
                      count=int(bad.sum()))]


def pack_loss_tokens(s: Shard) -> list[Violation]:
    """num_loss_tokens is the number of the pack's labels that are not -100 (of a tree: its rows')."""
    return _per_pack_count(s, NUM_LOSS_TOKENS, "loss-tokens", s.expected.num_loss_tokens,
                           "labels that are not -100 in the pack" if s.rows.parent_segments is None
                           else "labels that are not -100 in the pack's rows")


def attention_cost(s: Shard) -> list[Violation]:
    """sum_sq_seqlen is sum(seq_lens ** 2) (of a tree: L^2 + 2 L c, L tokens after c of its chain)."""
    return _per_pack_count(s, SUM_SQ_SEQLEN, "attn-cost", s.expected.sum_sq_seqlen,
                           "sum of seq_lens squared" if s.rows.parent_segments is None
                           else "sum of L^2 + 2 L c over segments of L tokens after c of their ancestors'")


def sequence_loss_tokens(s: Shard) -> list[Violation]:
    """seq_loss_tokens holds the labels that are not -100 of each sequence (of a tree: its row's)."""
    column = list_column(s.table, SEQ_LOSS_TOKENS)
    if isinstance(column, str):
        return [Violation("structure", "schema", column, shard=s.name)]
    offsets, values = column
    expected, seq_of_row = s.expected.seq_loss_tokens, s.seqs_per_row
    if np.array_equal(offsets, s.rows.seq_offsets) and np.array_equal(values, expected):
        return []
    per_seq = np.diff(offsets) == seq_of_row
    bad = ~per_seq if not per_seq.all() else np.bincount(
        np.repeat(np.arange(len(seq_of_row)), seq_of_row),
        weights=values != expected, minlength=len(seq_of_row)) > 0
    where = "each sequence" if s.rows.parent_segments is None else "each segment's row (0 on a prefix)"
    return [Violation("structure", "loss-tokens", f"{SEQ_LOSS_TOKENS} differs from the labels that are not -100 in "
                      f"{where}", shard=s.name, row=int(np.argmax(bad)), count=int(bad.sum()))]


def sequence_weights(s: Shard) -> list[Violation]:
    """seq_weights holds one finite weight per sequence (--weight-column)."""
    column = list_column(s.table, SEQ_WEIGHTS)
    if isinstance(column, str):
        return [Violation("structure", "seq-weights", column, shard=s.name)]
    offsets, weights = column
    ragged = np.diff(offsets) != s.seqs_per_row
    if ragged.any():
        return [Violation("structure", "seq-weights", f"{SEQ_WEIGHTS} does not hold one weight per sequence",
                          shard=s.name, row=int(np.argmax(ragged)), count=int(ragged.sum()))]
    bad = ~np.isfinite(weights)
    if bad.any():
        k = int(np.argmax(bad))
        row = int(np.searchsorted(offsets, k, side="right") - 1)
        return [Violation("structure", "seq-weights", f"{SEQ_WEIGHTS} holds {weights[k]}; weights are finite",
                          shard=s.name, row=row, sequence=k - int(offsets[row]), count=int(bad.sum()))]
    return []


def limit_sums(s: Shard) -> list[Violation]:
    """Every --limit COL=N: COL one value >= 0 per sequence, COL_sum their sum, at most N."""
    found: list[Violation] = []
    row_count = len(s.seqs_per_row)
    for column, limit in s.layout.limits.items():
        per_sequence, per_pack = limit_columns(column)
        wrong = [c for c in (per_sequence, per_pack)
                 if c.name not in s.names or not s.table.schema.field(c.name).type.equals(c.arrow_type)]
        if wrong:
            found += [Violation("structure", "schema", f"column {c.name} is " + (
                "missing" if c.name not in s.names else str(s.table.schema.field(c.name).type)) +
                f"; --limit {column}={limit} writes it as {c.type_text}", shard=s.name) for c in wrong]
            continue
        listed = list_column(s.table, column)
        if isinstance(listed, str):
            found.append(Violation("structure", "schema", listed, shard=s.name))
            continue
        offsets, values = listed
        ragged = np.diff(offsets) != s.seqs_per_row
        if ragged.any():
            found.append(Violation("structure", "limit-sums", f"{column} does not hold one value per sequence",
                                   shard=s.name, row=int(np.argmax(ragged)), count=int(ragged.sum())))
            continue
        values = np.asarray(values, dtype=np.int64)
        negative = values < 0
        if negative.any():
            k = int(np.argmax(negative))
            row = int(np.searchsorted(offsets, k, side="right") - 1)
            found.append(Violation("structure", "limit-sums", f"{column} holds {values[k]}; a cost is >= 0",
                                   shard=s.name, row=row, sequence=k - int(offsets[row]), count=int(negative.sum())))
        sums = np.add.reduceat(values, offsets[:-1]) if len(values) else np.zeros(row_count, np.int64)
        sums = np.where(np.diff(offsets) > 0, sums, 0)  # reduceat gives an empty row the next value
        said = s.table.column(per_pack.name).to_numpy().astype(np.int64)
        for rule, bad, message in (
                ("limit-sums", said != sums, lambda r: f"{per_pack.name} is {said[r]}, the sum of its {column} is "
                                                       f"{sums[r]}"),
                ("over-limit", said > limit, lambda r: f"{per_pack.name} is {said[r]}, over --limit "
                                                       f"{column}={limit}")):
            if bad.any():
                r = int(np.argmax(bad))
                found.append(Violation("structure", rule, message(r), shard=s.name, row=r, count=int(bad.sum())))
    return found


def step_loss_parts(s: Shard) -> list[Violation]:
    """step_loss_tokens and step_loss_sequences are the sums over the packs of the step (after the last shard).

    The shard's steps and recounted loss tokens are kept for `StepLoss.check`."""
    row_of_seq = np.repeat(np.arange(len(s.seqs_per_row)), s.seqs_per_row)
    s.steps.add(s.name, s.table.column(STEP).to_numpy(), s.expected.num_loss_tokens,
                np.bincount(row_of_seq, weights=s.expected.seq_loss_tokens > 0, minlength=len(s.seqs_per_row)),
                s.table.column(STEP_LOSS_TOKENS).to_numpy(), s.table.column(STEP_LOSS_SEQUENCES).to_numpy())
    return []


def group_parts(s: Shard) -> list[Violation]:
    """group_ids: one per sequence, groups whole and adjacent, or within a step (after the last shard).

    The shard's group ids are kept for `packctl.verify.groups.GroupRule.check`; `add` reports what is
    wrong with the column itself (`group-ids`, nulls as `schema`, no step column as `group-step`)."""
    return s.groups.add(s.table, s.rows, s.name)


def batch_columns(s: Shard) -> list[Violation]:
    """Batch mode: every shard has the padded_len and batch_size columns."""
    if set(BATCH_COLUMNS) <= s.names:
        return []
    return [Violation("structure", "schema", f"a batch-mode shard needs the {' and '.join(BATCH_COLUMNS)} columns",
                      shard=s.name)]


def pack_rules(s: Shard) -> list[Violation]:
    """Every per-pack rule (PACK_RULES, below)."""
    batch_shape = None
    if s.layout.pad_to == "batch" and all(s.typed(name) for name in BATCH_COLUMNS):
        batch_shape = tuple(s.table.column(name).to_numpy() for name in BATCH_COLUMNS)
    return check_pack_rows(s.rows, s.layout, shard=s.name, sequences_in=s.sequences_in, batch_shape=batch_shape)


@dataclass(frozen=True)
class ShardRule:
    """One row of the table: the rule ids the function may report, the function, what it needs."""

    rules: tuple[str, ...]
    check: Callable[[Shard], list[Violation]]
    needs: tuple[Need, ...] = ()

    @property
    def doc(self) -> str:
        """What the rules check, in one line."""
        return (self.check.__doc__ or "").strip().splitlines()[0]


SHARD_RULES = (
    ShardRule(("trl-lengths", "schema"), trl_lengths, (_present(SEQ_LENGTHS),)),
    # recounted from labels: only where the sequences tile the packs (the tiling rule reports the others)
    ShardRule(("loss-tokens",), pack_loss_tokens, (LOSS_TYPED, TILED, _present(NUM_LOSS_TOKENS))),
    ShardRule(("attn-cost",), attention_cost, (LOSS_TYPED, TILED, _present(SUM_SQ_SEQLEN))),
    ShardRule(("loss-tokens", "schema"), sequence_loss_tokens, (LOSS_TYPED, TILED, _present(SEQ_LOSS_TOKENS))),
    ShardRule(("seq-weights",), sequence_weights, (LOSS_TYPED, TILED, _present(SEQ_WEIGHTS))),
    ShardRule(("step-loss",), step_loss_parts, (LOSS_TYPED, TILED, STEPS)),
    ShardRule(("limit-sums", "over-limit", "schema"), limit_sums, (LIMITED,)),
    ShardRule(("group-ids", "group-step", "group-whole", "group-adjacent"), group_parts, (GROUPS,)),
    ShardRule(("schema",), batch_columns, (LAYOUT, BATCH)),
    ShardRule(tuple(dict.fromkeys(r.rule for r in PACK_RULES)), pack_rules, (LAYOUT,)),
)


def check_shard_rules(shard: Shard) -> list[Violation]:
    """Every rule of SHARD_RULES whose needs hold, in order."""
    found: list[Violation] = []
    for rule in SHARD_RULES:
        if all(need.holds(shard) for need in rule.needs):
            found += rule.check(shard)
    return found

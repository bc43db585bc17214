"""Structure: every rule of the output contract (docs/format.md), over whole shards with numpy.

`check_pack_rows` takes the columns of a run of packs as `packctl.contract.thd.PackRows` (what the writer
builds before it writes a shard) and returns the rules they break; it does no I/O, so the writer
can run it as its own assert. `check_shard` reads one shard of an output directory (checksum,
schema, metadata, row and token counts) and runs `check_pack_rows` on it; `check_counts` holds the
manifest's `counts` against what the shards contain.

A pack these rules accept (capacity 16, align 4, pad id 0; `.` = -100):

    input_ids      a0 a1 a2 a3 a4  0  0  0 b0 b1 b2 b3 b4 b5  0  0
    labels          .  a1 a2 a3 a4  .  .  .  .  b1 b2 b3 b4 b5  .  .
    position_ids    0  1  2  3  4  5  6  7  0  1  2  3  4  5  6  7
    seq_lens [5, 6]   seq_lens_padded [8, 8]   cu_seqlens [0, 5, 11]   cu_seqlens_padded [0, 8, 16]

Every rule is a vectorized comparison over the flat columns of the whole shard; a broken rule is
reported once, at its first offending shard / row / sequence, with the number of places it breaks.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from packctl.arrays import offsets_of, positions_in_segments, row_cumsums
from packctl.contract.manifest import (COUNT_KEYS, OPTIONAL_COUNT_KEYS, ManifestProblem, inside, metrics_path,
                                       read_manifest)
from packctl.contract.reader import check_shard_bytes, read_shard_file, unlisted_parquet
from packctl.contract.schema import (BALANCE_COLUMNS, GROUP_IDS_COLUMN, IGNORE_INDEX, LOSS_FIELDS, PACK_SCHEMA,
                                     STEP_LOSS_FIELDS, TRL_LENGTHS_COLUMN, TRL_LENGTHS_FIELD, WEIGHTS_COLUMN)
from packctl.contract.thd import PackRows, loss_columns
from packctl.errors import PackctlError


@dataclass(frozen=True)
class Violation:
    """One broken rule, located as precisely as the rule allows.

    `count` is the number of places (rows, sequences or tokens) that break it; the message
    describes the first one.
    """

    check: str  # structure, conservation, attention, contamination, cp
    rule: str
    message: str
    shard: str | None = None
    row: int | None = None
    sequence: int | None = None
    count: int = 1

    def __str__(self) -> str:
        where = [part for part in (
            self.shard,
            None if self.row is None else f"row {self.row}",
            None if self.sequence is None else f"sequence {self.sequence}",
        ) if part is not None]
        more = f" ({self.count} places)" if self.count > 1 else ""
        prefix = " ".join(where) + ": " if where else ""
        return f"{prefix}{self.message} [{self.check}: {self.rule}]{more}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Layout:
    """The manifest's `layout`: what every pack of the output must look like."""

    capacity: int
    align: int
    pad_to: str
    pack_multiple: int
    pad_token_id: int
    ignore_index: int = IGNORE_INDEX
    cp_size: int = 1
    tp_size: int = 1

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], where: str = "the manifest") -> "Layout":
        return cls.from_dict(manifest.get("layout"), where)

    @classmethod
    def from_dict(cls, layout: Any, where: str = "the manifest") -> "Layout":
        """From a layout dict: the manifest's, or `packctl.pipeline.manifest.layout_of(config)` in the writer."""
        if not isinstance(layout, dict):
            raise PackctlError(f"{where}: no 'layout' object; the output was not written by packctl pack "
                               "(or by a version that predates format version 1)")
        try:
            return cls(capacity=int(layout["capacity"]), align=int(layout["align"]), pad_to=str(layout["pad_to"]),
                       pack_multiple=int(layout.get("pack_multiple") or layout["align"]),
                       pad_token_id=int(layout["pad_token_id"]),
                       ignore_index=int(layout.get("ignore_index", IGNORE_INDEX)),
                       cp_size=int(layout.get("cp_size", 1)), tp_size=int(layout.get("tp_size", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise PackctlError(f"{where}: layout lacks or mangles {exc}; it needs capacity, align, pad_to, "
                               "pad_token_id") from None


def load_manifest(out: str | Path) -> dict[str, Any]:
    """OUT's manifest, or PackctlError (exit 2) when there is none to read (contract/manifest.py)."""
    return read_manifest(out)[1]


# ----------------------------------------------------------------------------------------------
# rules over the columns of a run of packs


class _Locator:
    """Turns flat indices (over rows, sequences, cu entries or tokens) into row / sequence."""

    def __init__(self, rows: PackRows):
        self.token_offsets = np.asarray(rows.token_offsets, dtype=np.int64)
        self.seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
        self.cu_offsets = np.asarray(rows.cu_offsets, dtype=np.int64)

    def seq(self, k: int) -> tuple[int, int]:
        row = int(np.searchsorted(self.seq_offsets, k, side="right") - 1)
        return row, k - int(self.seq_offsets[row])

    def cu(self, k: int) -> tuple[int, int]:
        row = int(np.searchsorted(self.cu_offsets, k, side="right") - 1)
        return row, k - int(self.cu_offsets[row])

    def token(self, k: int, seq_token_offsets: np.ndarray) -> tuple[int, int, int, int]:
        """flat token -> (row, sequence in row, position in row, position in sequence)."""
        seq = int(np.searchsorted(seq_token_offsets, k, side="right") - 1)
        row, seq_in_row = self.seq(seq)
        return row, seq_in_row, k - int(self.token_offsets[row]), k - int(seq_token_offsets[seq])


def _check_batch_rows(fail, padded, aligned, last, row_of_seq, pack_len, n_seq, layout: Layout,
                      batch_shape: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Batch mode (docs/format.md): a micro-batch is `batch_size` rows of `padded_len` tokens; every
    sequence is padded to padded_len, the last one also holds the empty rows."""
    rows_n = len(pack_len)
    first = np.zeros(rows_n, dtype=np.int64)
    has = n_seq > 0
    first[has] = padded[np.concatenate([[0], np.cumsum(n_seq)[:-1]])[has]]
    if batch_shape is None:
        padded_len, batch_size = first, np.where(first > 0, pack_len // np.maximum(first, 1), 0)
    else:
        padded_len, batch_size = (np.asarray(a, dtype=np.int64) for a in batch_shape)
    fail("batch-shape", pack_len != padded_len * batch_size,
         lambda r: f"the micro-batch holds {pack_len[r]} tokens, not batch_size {batch_size[r]} x padded_len "
                   f"{padded_len[r]}", level="row")
    fail("batch-shape", (batch_size < n_seq) | (padded_len % layout.align != 0) | (padded_len < 1),
         lambda r: f"batch_size {batch_size[r]} / padded_len {padded_len[r]} cannot hold {n_seq[r]} sequences "
                   f"padded to a multiple of {layout.align}", level="row")
    row_len = padded_len[row_of_seq]
    fail("alignment", (~last & (padded != row_len)) | (last & ((padded < row_len) | (padded % np.maximum(row_len, 1) != 0)))
         | (aligned > row_len),
         lambda k: f"seq_lens_padded {padded[k]} in a micro-batch of padded_len {row_len[k]}: every sequence is "
                   "padded to padded_len (the last one also holds the empty rows)", level="seq")


def check_pack_rows(rows: PackRows, layout: Layout, *, shard: str | None = None,
                    sequences_in: int | None = None,
                    batch_shape: tuple[np.ndarray, np.ndarray] | None = None) -> list[Violation]:
    """Every per-pack rule of the contract, over all rows at once; [] when the packs are valid.

    The writer can assert its own rows before writing them:
    `check_pack_rows(rows, Layout.from_dict(layout_of(config)))`.

    Example (the pack drawn in the module docstring, with its first label left in):

        >>> rows = ...  # PackRows of that pack, labels[0] = a0
        >>> [v.rule for v in check_pack_rows(rows, layout)]   # doctest: +SKIP
        ['labels-boundary']
    """
    found: list[Violation] = []
    loc = _Locator(rows)

    def fail(rule: str, bad: np.ndarray, describe, *, level: str) -> None:
        """Record `rule` if any of `bad` (a mask over rows, sequences, cu entries or tokens) is set."""
        count = int(np.count_nonzero(bad))
        if count == 0:
            return
        k = int(np.argmax(bad))
        row = seq = None
        if level == "row":
            row = k
        elif level == "seq":
            row, seq = loc.seq(k)
        elif level == "cu":
            row, entry = loc.cu(k)
            seq = max(entry - 1, 0)
        elif level == "token":
            row, seq, _, _ = loc.token(k, seq_token_offsets)
        found.append(Violation("structure", rule, describe(k), shard=shard, row=row, sequence=seq, count=count))

    pack_len = np.diff(loc.token_offsets)
    n_seq = np.diff(loc.seq_offsets)
    n_cu = np.diff(loc.cu_offsets)
    seq_lens = np.asarray(rows.seq_lens, dtype=np.int64)
    padded = np.asarray(rows.seq_lens_padded, dtype=np.int64)
    row_of_seq = np.repeat(np.arange(len(n_seq)), n_seq)

    fail("pack-not-empty", n_seq < 1, lambda r: "the pack holds no sequence", level="row")
    cap = layout.capacity
    fail("pack-length", pack_len > cap, lambda r: f"pack length {pack_len[r]} exceeds the capacity {cap}", level="row")
    if layout.pad_to == "capacity":
        fail("pack-length", pack_len != cap,
             lambda r: f"pack length {pack_len[r]}, but pad_to=capacity makes every pack {cap} tokens", level="row")
    elif layout.pad_to == "batch":
        pass  # the rows x padded_len rules below
    else:
        m = layout.pack_multiple
        fail("pack-length", pack_len % m != 0,
             lambda r: f"pack length {pack_len[r]} is not a multiple of pack_multiple {m}", level="row")
    if layout.cp_size > 1:
        two_cp = 2 * layout.cp_size
        fail("cp-alignment", pack_len % two_cp != 0,
             lambda r: f"pack length {pack_len[r]} is not a multiple of 2*cp = {two_cp}", level="row")
        fail("cp-alignment", padded % two_cp != 0,
             lambda k: f"seq_lens_padded {padded[k]} is not a multiple of 2*cp = {two_cp} "
                       "(Transformer Engine's THD context-parallel split needs it)", level="seq")

    fail("seq-lens", seq_lens < 1, lambda k: f"seq_lens {seq_lens[k]}: every sequence holds at least one token",
         level="seq")
    fail("seq-lens", padded < seq_lens,
         lambda k: f"seq_lens_padded {padded[k]} is smaller than seq_lens {seq_lens[k]}", level="seq")
    align = layout.align
    aligned = (seq_lens + align - 1) // align * align
    last = np.zeros(len(seq_lens), dtype=bool)
    last[loc.seq_offsets[1:][n_seq > 0] - 1] = True
    if layout.pad_to == "batch":
        _check_batch_rows(fail, padded, aligned, last, row_of_seq, pack_len, n_seq, layout, batch_shape)
    else:
        fail("alignment", (~last & (padded != aligned)) | (last & (padded < aligned)) | (padded % align != 0),
             lambda k: f"seq_lens_padded {padded[k]} for a sequence of {seq_lens[k]} tokens with align {align} "
                       f"(expected {aligned[k]}{', plus the tail padding' if last[k] else ''})", level="seq")
    num_tokens = np.asarray(rows.num_tokens, dtype=np.int64)
    seq_sum = np.bincount(row_of_seq, weights=seq_lens, minlength=len(n_seq)).astype(np.int64)
    fail("num-tokens", num_tokens != seq_sum,
         lambda r: f"num_tokens {num_tokens[r]} != sum(seq_lens) {seq_sum[r]}", level="row")
    if sequences_in is not None:
        sids = np.asarray(rows.sample_ids, dtype=np.int64)
        fail("sample-ids", (sids < 0) | (sids >= sequences_in),
             lambda k: f"sample id {sids[k]} is outside [0, {sequences_in}) (the manifest's sequences_in)", level="seq")

    cu_ok = np.array_equal(n_cu, n_seq + 1)
    fail("cu-length", n_cu != n_seq + 1,
         lambda r: f"cu_seqlens has {n_cu[r]} entries for {n_seq[r]} sequences (must be len(seq_lens) + 1)",
         level="row")
    if cu_ok:
        for column, lens, formula in (("cu_seqlens", seq_lens, "[0, cumsum(seq_lens)]"),
                                      ("cu_seqlens_padded", padded, "[0, cumsum(seq_lens_padded)]")):
            actual = np.asarray(getattr(rows, column), dtype=np.int64)
            expected = row_cumsums(lens, loc.seq_offsets)

            def describe(k, actual=actual, expected=expected, column=column, formula=formula):
                _, entry = loc.cu(k)
                return f"{column}[{entry}] is {actual[k]}, expected {expected[k]}: {column} must be {formula}"

            fail(column, actual != expected, describe, level="cu")
        cu_padded = np.asarray(rows.cu_seqlens_padded, dtype=np.int64)
        cu_last = cu_padded[loc.cu_offsets[1:][n_cu > 0] - 1] if len(cu_padded) else np.zeros(0, np.int64)
        if len(cu_last) == len(pack_len):
            fail("cu_seqlens_padded", cu_last != pack_len,
                 lambda r: f"cu_seqlens_padded[-1] is {cu_last[r]}, but the pack holds {pack_len[r]} tokens",
                 level="row")

    padded_load = np.bincount(row_of_seq, weights=padded, minlength=len(n_seq)).astype(np.int64)
    tiles = np.array_equal(padded_load, pack_len) and bool((padded >= 0).all())
    fail("tiling", padded_load != pack_len,
         lambda r: f"seq_lens_padded sum to {padded_load[r]} but the pack holds {pack_len[r]} tokens", level="row")
    if not tiles:
        return found  # token-level rules need the sequences to tile the packs

    seq_token_offsets = offsets_of(padded)
    position = positions_in_segments(padded)
    seq_of_token = np.repeat(np.arange(len(padded)), padded)
    is_pad = position >= seq_lens[seq_of_token]
    input_ids = np.asarray(rows.input_ids)
    labels = np.asarray(rows.labels)
    position_ids = np.asarray(rows.position_ids)
    ignore = layout.ignore_index

    def at(k: int) -> str:
        _, _, pos_in_row, pos_in_seq = loc.token(k, seq_token_offsets)
        return f"token {pos_in_row} of the pack (position {pos_in_seq} of the sequence)"

    fail("position-ids", position_ids != position,
         lambda k: f"position_ids is {position_ids[k]} at {at(k)}, expected {position[k]}: positions restart at 0 "
                   "at each sequence and count through its padding", level="token")
    fail("padding-tokens", is_pad & (input_ids != layout.pad_token_id),
         lambda k: f"padding token is {input_ids[k]} at {at(k)}, not pad_token_id {layout.pad_token_id}",
         level="token")
    fail("labels-padding", is_pad & (labels != ignore),
         lambda k: f"padding label is {labels[k]} at {at(k)}, not {ignore}", level="token")
    starts = seq_token_offsets[:-1][seq_lens > 0]
    first_label = labels[starts]
    bad_first = np.zeros(len(labels), dtype=bool)
    bad_first[starts[first_label != ignore]] = True
    fail("labels-boundary", bad_first,
         lambda k: f"the first token of the sequence has label {labels[k]}; it must be {ignore} so that no "
                   "position predicts across a sequence boundary", level="token")
    fail("token-range", ~is_pad & (input_ids < 0),
         lambda k: f"input_ids holds {input_ids[k]} at {at(k)}; token ids are >= 0", level="token")
    fail("label-range", ~is_pad & (labels < 0) & (labels != ignore),
         lambda k: f"labels holds {labels[k]} at {at(k)}; labels are >= 0 or {ignore}", level="token")
    return found


# ----------------------------------------------------------------------------------------------
# one shard file


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray] | str:
    """(offsets from 0, values) of a list column, or what is wrong with it."""
    arr = table.column(name).combine_chunks()
    if arr.null_count:
        return f"column {name} has a null row"
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        return f"column {name} holds a null value"
    return offsets - offsets[0], values.to_numpy(zero_copy_only=False)


def rows_from_table(table: pa.Table, *, shard: str | None = None) -> tuple[PackRows | None, list[Violation]]:
    """A shard's table -> PackRows, or the violations that make its columns unusable together."""
    found: list[Violation] = []
    groups = (("input_ids", "labels", "position_ids"), ("seq_lens", "seq_lens_padded", "sample_ids"),
              ("cu_seqlens", "cu_seqlens_padded"))
    read: dict[str, np.ndarray] = {}
    offsets: dict[str, np.ndarray] = {}
    for group in groups:
        for name in group:
            column = _list_column(table, name)
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
    num_tokens = table.column("num_tokens").combine_chunks()
    if num_tokens.null_count:
        return None, [Violation("structure", "schema", "column num_tokens has a null row", shard=shard)]
    rows = PackRows(
        token_offsets=offsets["input_ids"], input_ids=read["input_ids"], labels=read["labels"],
        position_ids=read["position_ids"], seq_offsets=offsets["seq_lens"], seq_lens=read["seq_lens"],
        seq_lens_padded=read["seq_lens_padded"], sample_ids=read["sample_ids"], cu_offsets=offsets["cu_seqlens"],
        cu_seqlens=read["cu_seqlens"], cu_seqlens_padded=read["cu_seqlens_padded"],
        num_tokens=num_tokens.to_numpy(zero_copy_only=False),
    )
    return rows, []


def _schema_violations(schema: pa.Schema, shard: str) -> list[Violation]:
    found = []
    for field in PACK_SCHEMA:
        if field.name not in schema.names:
            found.append(Violation("structure", "schema", f"column {field.name} is missing", shard=shard))
        elif not schema.field(field.name).type.equals(field.type):
            found.append(Violation("structure", "schema", f"column {field.name} is {schema.field(field.name).type}, "
                                   f"the contract says {field.type}", shard=shard))
    for name in BALANCE_COLUMNS:
        if name in schema.names and not schema.field(name).type.equals(pa.int32()):
            found.append(Violation("structure", "schema", f"column {name} is {schema.field(name).type}, "
                                   "the contract says int32", shard=shard))
    return found


def _trl_lengths_violations(table: pa.Table, rows: PackRows, shard: str, *, required: bool) -> list[Violation]:
    """`seq_lengths` (TRL's name for the lengths that tile input_ids) must equal `seq_lens_padded`
    row by row: TRL rebuilds position_ids and sequence boundaries from it. Format version 2 requires
    it; version 1 outputs written before it was added lack it."""
    if TRL_LENGTHS_COLUMN not in table.column_names:
        return [Violation("structure", "schema", f"column {TRL_LENGTHS_COLUMN} is missing (format version 2 "
                          "requires it)", shard=shard)] if required else []
    if not table.schema.field(TRL_LENGTHS_COLUMN).type.equals(TRL_LENGTHS_FIELD.type):
        return [Violation("structure", "schema", f"column {TRL_LENGTHS_COLUMN} is "
                          f"{table.schema.field(TRL_LENGTHS_COLUMN).type}, the contract says {TRL_LENGTHS_FIELD.type}",
                          shard=shard)]
    column = _list_column(table, TRL_LENGTHS_COLUMN)
    if isinstance(column, str):
        return [Violation("structure", "schema", column, shard=shard)]
    offsets, values = column
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
    return [Violation("structure", "trl-lengths", f"{TRL_LENGTHS_COLUMN} differs from seq_lens_padded; TRL would "
                      "take other sequence boundaries than packctl's", shard=shard, row=r,
                      count=int(np.count_nonzero(bad_rows)))]


def _loss_violations(table: pa.Table, rows: PackRows, shard: str, steps: "StepLoss | None") -> list[Violation]:
    """The loss-normalization columns (docs/format.md), each recounted from `labels` and the
    sequence lengths: rules `loss-tokens` (num_loss_tokens, seq_loss_tokens) and `attn-cost`
    (sum_sq_seqlen). Version-2 outputs written before they existed lack them: checked when present.
    With `steps`, the packs' steps and recounted loss tokens are kept for `StepLoss.check`."""
    names = set(table.column_names)
    found = [Violation("structure", "schema", f"column {f.name} is {table.schema.field(f.name).type}, the contract "
                       f"says {f.type}", shard=shard)
             for f in (*LOSS_FIELDS, *STEP_LOSS_FIELDS)
             if f.name in names and not table.schema.field(f.name).type.equals(f.type)]
    if found or tiled_starts(rows) is None:
        return found  # the tiling rule already reports packs whose sequences cannot be told apart
    expected = loss_columns(rows)
    seq_of_row = np.diff(np.asarray(rows.seq_offsets, dtype=np.int64))
    rules = (("num_loss_tokens", "loss-tokens", expected.num_loss_tokens, "labels that are not -100 in the pack"),
             ("sum_sq_seqlen", "attn-cost", expected.sum_sq_seqlen, "sum of seq_lens squared"))
    for name, rule, want, what in rules:
        if name not in names:
            continue
        got = table.column(name).to_numpy()
        bad = got != want
        if bad.any():
            r = int(np.argmax(bad))
            found.append(Violation("structure", rule, f"{name} is {got[r]}, the {what} is {want[r]}", shard=shard,
                                   row=r, count=int(bad.sum())))
    if "seq_loss_tokens" in names:
        column = _list_column(table, "seq_loss_tokens")
        if isinstance(column, str):
            found.append(Violation("structure", "schema", column, shard=shard))
        elif not (np.array_equal(column[0], rows.seq_offsets) and np.array_equal(column[1], expected.seq_loss_tokens)):
            per_seq = np.diff(column[0]) == seq_of_row
            bad = ~per_seq if not per_seq.all() else np.bincount(
                np.repeat(np.arange(len(seq_of_row)), seq_of_row),
                weights=column[1] != expected.seq_loss_tokens, minlength=len(seq_of_row)) > 0
            found.append(Violation("structure", "loss-tokens", "seq_loss_tokens differs from the labels that are not "
                                   "-100 in each sequence", shard=shard, row=int(np.argmax(bad)),
                                   count=int(bad.sum())))
    if WEIGHTS_COLUMN in names:
        found += _weights_violations(table, rows, shard)
    if steps is not None and "step" in names and {c.name for c in STEP_LOSS_FIELDS} <= names:
        row_of_seq = np.repeat(np.arange(len(seq_of_row)), seq_of_row)
        steps.add(shard, table.column("step").to_numpy(), expected.num_loss_tokens,
                  np.bincount(row_of_seq, weights=expected.seq_loss_tokens > 0, minlength=len(seq_of_row)),
                  table.column("step_loss_tokens").to_numpy(), table.column("step_loss_sequences").to_numpy())
    return found


def _weights_violations(table: pa.Table, rows: PackRows, shard: str) -> list[Violation]:
    """Rule `seq-weights`: list<double>, one finite weight per sequence (--weight-column)."""
    typ = table.schema.field(WEIGHTS_COLUMN).type
    if not (pa.types.is_list(typ) and typ.value_type == pa.float64()):
        return [Violation("structure", "schema", f"column {WEIGHTS_COLUMN} is {typ}, the contract says list<double>",
                          shard=shard)]
    column = _list_column(table, WEIGHTS_COLUMN)
    if isinstance(column, str):
        return [Violation("structure", "seq-weights", column, shard=shard)]
    offsets, weights = column
    ragged = np.diff(offsets) != np.diff(np.asarray(rows.seq_offsets, dtype=np.int64))
    if ragged.any():
        return [Violation("structure", "seq-weights", f"{WEIGHTS_COLUMN} does not hold one weight per sequence",
                          shard=shard, row=int(np.argmax(ragged)), count=int(ragged.sum()))]
    bad = ~np.isfinite(weights)
    if bad.any():
        k = int(np.argmax(bad))
        row = int(np.searchsorted(offsets, k, side="right") - 1)
        return [Violation("structure", "seq-weights", f"{WEIGHTS_COLUMN} holds {weights[k]}; weights are finite",
                          shard=shard, row=row, sequence=k - int(offsets[row]), count=int(bad.sum()))]
    return []


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
        for name, per_pack, said in (("step_loss_tokens", tokens, said_tokens),
                                     ("step_loss_sequences", sequences, said_sequences)):
            sums = np.bincount(step, weights=per_pack, minlength=int(step.max()) + 1).astype(np.int64)[step]
            bad = said != sums
            if bad.any():
                k = int(np.argmax(bad))
                found.append(Violation("structure", "step-loss", f"{name} is {said[k]}, but the packs of step "
                                       f"{step[k]} hold {sums[k]}", shard=self.parts[shard[k]][0], row=int(row[k]),
                                       count=int(bad.sum())))
        return found


def check_shard(out: Path, entry: dict[str, Any], manifest: dict[str, Any], layout: Layout | None, *,
                sequences_in: int | None, steps: StepLoss | None = None,
                groups: Any = None) -> tuple[PackRows | None, list[Violation]]:
    """Checksum, schema, metadata, counts and every pack rule of one shard listed in the manifest;
    with `steps`, what the step rule (`StepLoss.check`, after the last shard) needs; with `groups`
    (a `packctl.verify.groups.GroupRule`), the shard's `group_ids` when it has them. `layout`
    None (the manifest's is broken, rule `manifest-fields`): the pack rules are left out.

    The shard is read as every reader reads it (`packctl.contract.reader.check_shard_bytes`: one
    read, hashed while parsed), and its findings become rules (`checksum`, `readable`, `metadata`,
    `manifest-shard`). `entry["path"]` must have passed `manifest_problems` (relative, inside OUT).

    Returns the shard's rows (None when it cannot be read as packs) and the broken rules.
    """
    name = entry["path"]
    path = out / name
    if not inside(os.path.realpath(out), path):  # a link made since the manifest was checked
        return None, [Violation("structure", "manifest-paths", "leads out of OUT through a symbolic link; not read",
                                shard=name)]
    if not path.is_file():
        return None, [Violation("structure", "shard-missing", "listed in the manifest but missing", shard=name)]
    try:
        data = read_shard_file(path)
    except OSError as exc:
        return None, [Violation("structure", "readable", f"cannot be read ({exc.strerror or exc})", shard=name)]
    checked = check_shard_bytes(data, entry, manifest)
    del data
    found = [Violation("structure", f.rule, f.message, shard=name) for f in checked.findings]
    table = checked.table
    if table is None:
        return None, found
    schema_problems = _schema_violations(table.schema, name)
    found += schema_problems
    if schema_problems:
        return None, found
    rows, problems = rows_from_table(table, shard=name)
    found += problems
    if rows is None:
        return None, found
    found += _trl_lengths_violations(table, rows, name, required=manifest.get("format_version", 1) >= 2)
    found += _loss_violations(table, rows, name, steps)
    if groups is not None and GROUP_IDS_COLUMN in table.column_names:
        found += groups.add(table, rows, name)
    if layout is None:
        return rows, found
    batch_shape = None
    if layout.pad_to == "batch":
        if {"padded_len", "batch_size"} <= set(table.column_names):
            batch_shape = (table.column("padded_len").to_numpy(), table.column("batch_size").to_numpy())
        else:
            found.append(Violation("structure", "schema", "a batch-mode shard needs the padded_len and batch_size "
                                   "columns", shard=name))
    found += check_pack_rows(rows, layout, shard=name, sequences_in=sequences_in, batch_shape=batch_shape)
    return rows, found


def manifest_violations(problems: list[ManifestProblem]) -> list[Violation]:
    """`manifest_problems` as rules: each rule once, at its first problem, with the number of
    fields that break it (`manifest-fields`, `manifest-paths`, `manifest-order`, `manifest-counts`)."""
    firsts: dict[str, ManifestProblem] = {}
    counts: dict[str, int] = {}
    for problem in problems:
        firsts.setdefault(problem.rule, problem)
        counts[problem.rule] = counts.get(problem.rule, 0) + 1
    return [Violation("structure", rule, f"the manifest's {first}", count=counts[rule]) for rule, first in
            firsts.items()]


def tiled_starts(rows: PackRows) -> np.ndarray | None:
    """Flat offset of every padded sequence in `rows.input_ids`, from `seq_lens_padded`; None when the
    padded lengths do not tile the packs (a structure violation that `check_pack_rows` reports).

    Two packs [4, 4] and [8] -> [0, 4, 8, 16]: sequence i occupies [starts[i], starts[i + 1]).
    """
    padded = np.asarray(rows.seq_lens_padded, dtype=np.int64)
    seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
    pack_len = np.diff(np.asarray(rows.token_offsets, dtype=np.int64))
    per_row = np.diff(seq_offsets)
    if (padded < 0).any() or (np.asarray(rows.seq_lens) > padded).any() or (np.asarray(rows.seq_lens) < 0).any():
        return None
    load = np.bincount(np.repeat(np.arange(len(per_row)), per_row), weights=padded, minlength=len(per_row))
    if not np.array_equal(load.astype(np.int64), pack_len):
        return None
    return offsets_of(padded)


def check_metrics(out: Path, manifest: dict[str, Any], *, counts_ok: bool = True) -> list[Violation]:
    """Rule `metrics`: the packing report (`_metrics.json`) is a readable JSON object whose `counts`
    are the manifest's (`counts_ok` False: the manifest's counts are broken, compared no further)."""
    path = metrics_path(out)
    try:
        report = json.loads(path.read_bytes())
    except OSError as exc:
        return [Violation("structure", "metrics", f"{path.name} cannot be read ({exc.strerror or exc}); packctl pack "
                          "writes it beside the manifest")]
    except ValueError as exc:
        return [Violation("structure", "metrics", f"{path.name} is not readable JSON ({str(exc).splitlines()[0]})")]
    if not isinstance(report, dict):
        return [Violation("structure", "metrics", f"{path.name} holds {type(report).__name__}, not a JSON object")]
    if not counts_ok:
        return []
    said, counts = report.get("counts"), manifest["counts"]
    if not isinstance(said, dict):
        return [Violation("structure", "metrics", f"{path.name} has no counts object")]
    differ = sorted(k for k in said.keys() | counts.keys() if said.get(k) != counts.get(k))
    if differ:
        shown = ", ".join(f"{k} {said.get(k)} vs {counts.get(k)}" for k in differ[:3])
        return [Violation("structure", "metrics", f"the counts of {path.name} differ from the manifest's ({shown}"
                          f"{' ...' if len(differ) > 3 else ''})", count=len(differ))]
    return []


def unlisted_shards(out: Path, listed: list[str]) -> list[Violation]:
    """Parquet files in OUT that the manifest does not list (readers of the directory would take them)."""
    return [Violation("structure", "shard-unlisted", "a Parquet file in OUT that the manifest does not list",
                      shard=rel) for rel in unlisted_parquet(out, listed)]


@dataclass
class Totals:
    """What the shards hold, summed while they are checked, for `check_counts`."""

    packs: int = 0
    tokens: int = 0
    pieces: int = 0
    sample_ids: list[np.ndarray] | None = None

    def add(self, rows: PackRows) -> None:
        self.packs += rows.num_rows
        self.tokens += int(np.asarray(rows.num_tokens, dtype=np.int64).sum())
        self.pieces += len(rows.seq_lens)
        if self.sample_ids is None:
            self.sample_ids = []
        self.sample_ids.append(np.asarray(rows.sample_ids, dtype=np.int64))


def check_counts(manifest: dict[str, Any], totals: Totals, *, complete: bool) -> list[Violation]:
    """The manifest's counts against each other and, when every shard was read (`complete`), against
    what the shards hold. Counts that are not all there as integers are `manifest-fields`
    (`manifest_problems`), and checked no further here."""
    counts = manifest.get("counts")
    if not isinstance(counts, dict) or not all(isinstance(counts.get(k), int) for k in COUNT_KEYS) or not all(
            isinstance(counts[k], int) for k in OPTIONAL_COUNT_KEYS if k in counts):
        return []
    c = {k: int(counts[k]) for k in COUNT_KEYS + OPTIONAL_COUNT_KEYS if k in counts}
    found: list[Violation] = []

    def expect(rule_text: str, actual: int, expected: int) -> None:
        if actual != expected:
            found.append(Violation("structure", "manifest-counts", f"{rule_text}: {actual} != {expected}"))

    inputs = manifest.get("inputs")
    if isinstance(inputs, list) and all(isinstance(i, dict) and isinstance(i.get("rows"), int) for i in inputs):
        expect("counts.sequences_in vs the rows of manifest inputs", c["sequences_in"],
               sum(i["rows"] for i in inputs))
    expect("counts.sequences_packed vs sequences_in - sequences_dropped", c["sequences_packed"],
           c["sequences_in"] - c["sequences_dropped"])
    expect("counts.tokens_in vs tokens_packed + tokens_dropped + tokens_truncated", c["tokens_in"],
           c["tokens_packed"] + c["tokens_dropped"] + c["tokens_truncated"])
    # counts.packs and counts.tokens_packed against the shard entries: manifest_problems
    if not complete:
        return found
    if "packs" in c:
        expect("packs in the shards vs counts.packs", totals.packs, c["packs"])
    expect("tokens in the shards (sum of num_tokens) vs counts.tokens_packed", totals.tokens, c["tokens_packed"])
    if "pieces" in c:
        expect("sequences in the shards vs counts.pieces", totals.pieces, c["pieces"])
    sids = np.concatenate(totals.sample_ids) if totals.sample_ids else np.zeros(0, np.int64)
    ids, per_id = np.unique(sids, return_counts=True)
    expect("distinct sample ids in the shards vs counts.sequences_packed", len(ids), c["sequences_packed"])
    multi = ids[per_id > 1]
    if len(multi) != c["sequences_split"]:
        listed = ", ".join(str(int(g)) for g in multi[:5]) + (" ..." if len(multi) > 5 else "")
        found.append(Violation(
            "structure", "manifest-counts",
            f"{len(multi)} sample ids appear in more than one sequence ({listed or 'none'}), the manifest counts "
            f"{c['sequences_split']} split samples: a sample is duplicated or the counts are wrong "
            "(--source tells which)"))
    return found

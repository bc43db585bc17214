"""Parquet encoding of packs: the contract's table (schema.py) and its bytes.

A shard is written row group by row group (pipeline/assign.py): each row group is encoded on its own
as a small Parquet file (`encode_table`), and a shard's row groups are joined (output/stitch.py).
"""
from __future__ import annotations

from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.contract.arrow import arrow_array
from packctl.contract.schema import (COLUMN, CU_ENTRY, LOSS_COLUMNS, METADATA_KEY, PACK_COLUMNS, SEQ_LENGTHS, SEQUENCE,
                                     TOKEN, TOKEN_COLUMNS, Column, column_order, limit_columns)
from packctl.contract.thd import LossColumns, PackRows, loss_columns

PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=False, write_statistics=False)

Values = Union[np.ndarray, pa.Array, pa.ChunkedArray]


def rows_to_table(rows: PackRows, metadata: bytes, per_pack: dict[str, np.ndarray] | None = None,
                  per_sequence: dict[str, Values] | None = None, *, plan: bool = False,
                  limits: tuple[str, ...] = (), loss: LossColumns | None = None) -> pa.Table:
    """PackRows -> an Arrow table of the contract (`packctl.contract.schema.COLUMNS`) with the
    `packctl` metadata key: the columns of `rows`, `seq_lengths`, the loss columns counted from its
    labels (`packctl.contract.thd.loss_columns`), then `per_pack` values (one per row: step,
    dp_rank, lr_scale ...) and `per_sequence` values (one per sequence, aligned with `sample_ids`:
    seq_weights, group_ids, and the --keep-columns as they are), in `column_order`.

    With `plan` (`pack --plan-only`) the token columns are left out: what else the table holds
    is what it holds without; `loss` gives the loss columns where `rows` has no labels (a plan's
    rows, `packctl.contract.thd.counted_loss_columns`). With `limits` (--limit columns, in
    order), COL in `per_sequence` and COL_sum in `per_pack` are the declared columns of
    `limit_columns` (int64), placed by `column_order`.

    Each declared column is written with its declared type, whatever the type of the values handed
    over (numpy arrays are converted, input values from Arrow cast): `{"step": np.array([0, 0, 1])}`
    becomes an int32 column.
    """
    loss = loss if loss is not None else loss_columns(rows)
    flat: dict[str, Values] = {name: getattr(rows, name) for name in PACK_COLUMNS}
    flat[SEQ_LENGTHS] = rows.seq_lens_padded
    flat.update({name: getattr(loss, name) for name in LOSS_COLUMNS})
    flat.update(per_pack or {})
    flat.update(per_sequence or {})
    if plan:
        for name in TOKEN_COLUMNS:
            del flat[name]
    offsets = {per: arrow_array(values, pa.int32()) for per, values in (
        (TOKEN, rows.token_offsets), (SEQUENCE, rows.seq_offsets), (CU_ENTRY, rows.cu_offsets))}
    names = column_order(flat, limits)
    declared = {**COLUMN, **{c.name: c for name in limits for c in limit_columns(name)}}
    arrays = [_column_array(declared.get(name), flat[name], offsets) for name in names]
    schema = pa.schema([pa.field(name, array.type, nullable=False) for name, array in zip(names, arrays)])
    return pa.Table.from_arrays(arrays, schema=schema.with_metadata({METADATA_KEY: metadata}))


def _column_array(column: Column | None, values: Values, offsets: dict[str, pa.Array]) -> pa.Array:
    """One column of the table; `column` None: a kept input column, one value per sequence as it is."""
    if column is None:
        return pa.ListArray.from_arrays(offsets[SEQUENCE], _combined(values))
    if isinstance(values, (pa.Array, pa.ChunkedArray)):  # input values (--weight-column): Arrow casts them
        flat = _combined(values.cast(column.value_type))
    else:
        flat = arrow_array(values, column.value_type)
    return pa.ListArray.from_arrays(offsets[column.per], flat) if column.is_list else flat


def _combined(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def encode_table(table: pa.Table) -> pa.Buffer:
    """A table as a Parquet file of one row group (PARQUET_OPTIONS), in memory (a bytes-like Buffer)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=max(table.num_rows, 1), **PARQUET_OPTIONS)
    return sink.getvalue()

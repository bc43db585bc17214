"""Parquet encoding of packs: the contract's table (schema.py) and its bytes.

A shard is written row group by row group (mpi/assign.py): each row group is encoded on its own
as a small Parquet file (`encode_table`), and a shard's row groups are joined (output/stitch.py).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.contract.arrow import arrow_array
from packctl.contract.schema import LOSS_FIELDS, METADATA_KEY, PACK_SCHEMA, TRL_LENGTHS_FIELD
from packctl.contract.thd import PackRows, loss_columns

PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=False, write_statistics=False)


def _list(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(arrow_array(offsets, pa.int32()), arrow_array(values, value_type))


def rows_to_table(rows: PackRows, metadata: bytes, extra: dict[str, np.ndarray] | None = None,
                  per_piece: dict[str, pa.ChunkedArray] | None = None) -> pa.Table:
    """PackRows -> an Arrow table with the contract's schema and the `packctl` metadata key, the
    loss-normalization columns counted from its labels (`packctl.contract.thd.loss_columns`), plus
    `extra` per-row columns (step, dp_rank, micro_batch as int32, lr_scale as float32,
    step_loss_tokens and step_loss_sequences as int64) and
    `per_piece` values (--keep-columns: one per piece, in row order), written as list columns
    aligned with `sample_ids`."""
    i32 = pa.int32()
    padded_lengths = _list(rows.seq_offsets, rows.seq_lens_padded, i32)
    columns = [
        _list(rows.token_offsets, rows.input_ids, i32),
        _list(rows.token_offsets, rows.labels, i32),
        _list(rows.token_offsets, rows.position_ids, i32),
        _list(rows.seq_offsets, rows.seq_lens, i32),
        padded_lengths,
        _list(rows.cu_offsets, rows.cu_seqlens, i32),
        _list(rows.cu_offsets, rows.cu_seqlens_padded, i32),
        _list(rows.seq_offsets, rows.sample_ids, pa.int64()),
        arrow_array(rows.num_tokens, i32),
        padded_lengths,
    ]
    loss = loss_columns(rows)
    columns += [arrow_array(loss.num_loss_tokens, i32), _list(rows.seq_offsets, loss.seq_loss_tokens, i32),
                arrow_array(loss.sum_sq_seqlen, pa.int64())]
    schema = pa.schema([*PACK_SCHEMA, TRL_LENGTHS_FIELD, *LOSS_FIELDS])
    for name, values in (extra or {}).items():
        values = np.asarray(values)
        array = arrow_array(values, pa.from_numpy_dtype(values.dtype))
        columns.append(array)
        schema = schema.append(pa.field(name, array.type, nullable=False))
    offsets = arrow_array(rows.seq_offsets, pa.int32())
    for name, values in (per_piece or {}).items():
        array = pa.ListArray.from_arrays(offsets, values.combine_chunks() if isinstance(values, pa.ChunkedArray)
                                         else values)
        columns.append(array)
        schema = schema.append(pa.field(name, array.type, nullable=False))
    return pa.Table.from_arrays(columns, schema=schema.with_metadata({METADATA_KEY: metadata}))


def encode_table(table: pa.Table) -> pa.Buffer:
    """A table as a Parquet file of one row group (PARQUET_OPTIONS), in memory (a bytes-like Buffer)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=max(table.num_rows, 1), **PARQUET_OPTIONS)
    return sink.getvalue()

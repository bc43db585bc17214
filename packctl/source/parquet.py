"""Read tokenized Parquet shards: index them, validate columns, read blocks, know a file again.

The input files come from `packctl.source.resolve` (INPUT specs -> distinct files, each with its
fingerprint); their rows are named by global sample ids (`packctl.source.index`). The scan of any
kind's blocks and `TokenSource` are `packctl.source.scan`.

Files are read in **blocks** (Parquet row groups). Token values are validated where they are
decoded; a bad row is reported as `FILE row R column C: what is wrong; what to do`.

Every time a file is opened again during a run (each block decoded in scan and materialize, kept
columns, weights, groups) its size and Parquet footer are checked against the **fingerprint**
taken when the run resolved it (`FileFingerprint`): a file rewritten or appended to under a run
stops it with `FILE: changed while packctl was reading it (...)`, instead of an output that mixes
old and new content.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import offsets_of
from packctl.contract.schema import IGNORE_INDEX, INT32_MAX
from packctl.errors import PackctlError
from packctl.source.blocks import DecodedBlock, first_outside_int32
from packctl.source.files import FileFingerprint, _short, open_parquet, take_first_footer
from packctl.source.index import Block, InputFile, Resolution, SequenceIndex
from packctl.specs import CarriedColumns
from packctl.contract.arrow import arrow_array, numpy_view
from packctl.urls import is_url


def check_list_column(path: str, schema: pa.Schema, column: str, role: str) -> None:
    """The tokens (or labels) column: present once, and a list of integers in any of Arrow's list
    layouts (list, large_list, fixed_size_list, list_view, large_list_view), which decode_block
    reads as a list."""
    if column not in schema.names:
        hint = "--tokens-column NAME" if role == "tokens" else "--labels-column NAME (or leave it unset)"
        raise PackctlError(
            f"{path}: no column '{column}' (columns: {', '.join(schema.names)}); pass {hint}")
    typ = field_type(path, schema, column)
    if not (_is_any_list(typ) and pa.types.is_integer(typ.value_type)):
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)}; {role} must be a list of integers")


def field_type(path: str, schema: pa.Schema, column: str) -> pa.DataType:
    """The type of `column`, which must be the name of one column only: with two of the same name
    the one meant is unknown (pyarrow writes such files)."""
    count = len(schema.get_all_field_indices(column))
    if count > 1:
        raise PackctlError(f"{path}: {count} columns are named '{column}'; give each column of the file a name "
                           "of its own")
    return schema.field(column).type


def is_plain_list(typ: pa.DataType) -> bool:
    """A list or large_list: offsets and values, as decode_block reads them without a copy."""
    return pa.types.is_list(typ) or pa.types.is_large_list(typ)


def list_lengths(path: str, column: str) -> pa.Table:
    """The list lengths of `column` as a one-column table `length` (int64, null for a null row),
    read with pyarrow: for the layouts other readers take as something else (fixed_size_list,
    list_view)."""
    try:
        values = open_parquet(path).read(columns=[column]).column(column)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot read column '{column}' ({_short(exc)}); the file may be truncated or "
                           "corrupt") from None
    import pyarrow.compute as pc  # here, not at the top: loading Arrow's compute functions costs a pack 0.03 s

    return pa.table({"length": pc.list_value_length(values).cast(pa.int64())})


def _is_any_list(typ: pa.DataType) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
            or pa.types.is_list_view(typ) or pa.types.is_large_list_view(typ))


def check_kept_column(path: str, schema: pa.Schema, column: str, seen: dict[str, pa.DataType]) -> None:
    """A --keep-columns column: present in every file, with one type across files."""
    if column not in schema.names:
        raise PackctlError(f"{path}: no column '{column}' to keep (columns: {', '.join(schema.names)}); "
                           "drop it from --keep-columns or add it to every input file")
    typ = field_type(path, schema, column)
    if seen.setdefault(column, typ) != typ:
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)} here and {_type_name(seen[column])} in "
                           "the files before; cast it to one type in every input file")


def check_weight_column(path: str, schema: pa.Schema, column: str) -> None:
    """The --weight-column: present, one number per row."""
    if column not in schema.names:
        raise PackctlError(f"{path}: no column '{column}' for --weight-column (columns: {', '.join(schema.names)}); "
                           "add one weight per sequence to every input file, or drop --weight-column")
    typ = field_type(path, schema, column)
    if not (pa.types.is_floating(typ) or pa.types.is_integer(typ)):
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)}; --weight-column needs one number "
                           "(float or integer) per sequence")


def check_weights(path: str, row_group: int, first_row: int, column: str,
                  expected: FileFingerprint | None = None) -> None:
    """Every weight of one row group is a finite number: else 'FILE row R column C: ...'."""
    pf = open_parquet(path, expected)
    try:
        values = pf.read_row_group(row_group, columns=[column]).column(column)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot read column {column} ({_short(exc)}); the file may be truncated or "
                           "corrupt") from None
    weights = values.to_numpy(zero_copy_only=False).astype(np.float64)  # nulls become nan
    bad = np.flatnonzero(~np.isfinite(weights))
    if len(bad):
        row = int(bad[0])
        value = values[row]
        what = value.as_py() if value.is_valid else "null"
        raise PackctlError(f"{path} row {first_row + row} column '{column}': weight {what}; every sequence needs a "
                           "finite weight (fill or drop the row, or drop --weight-column)")


def check_limit_column(path: str, schema: pa.Schema, column: str) -> None:
    """A --limit column: present, of an integer type (any width, signed or not), one value per row."""
    if column not in schema.names:
        raise PackctlError(f"{path}: no column '{column}' for --limit {column}=N (columns: {', '.join(schema.names)}); "
                           "add one whole number per sequence to every input file, or drop the --limit")
    typ = field_type(path, schema, column)
    if not pa.types.is_integer(typ):
        what = "a list" if _is_any_list(typ) else "not whole numbers"
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)}, {what}; --limit {column}=N needs one "
                           "whole number >= 0 per sequence: write it as an integer column (a count such as images "
                           "or image tokens)")


def read_limit_values(path: str, row_group: int, first_row: int, columns: tuple[str, ...], rows: int,
                      expected: FileFingerprint | None = None) -> np.ndarray:
    """The --limit columns of one row group as int64, rows x len(columns), each value a whole
    number >= 0 (the column's type was checked from the footer): a null, a negative value or one
    above 2^63-1 is refused as 'FILE row R column C: ...'."""
    pf = open_parquet(path, expected)
    try:
        table = pf.read_row_group(row_group, columns=list(columns))
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot read column(s) {', '.join(columns)} ({_short(exc)}); the file may be "
                           "truncated or corrupt") from None
    values = np.empty((rows, len(columns)), dtype=np.int64)
    for j, column in enumerate(columns):
        array = _one_array(table.column(column))
        if array.null_count:
            row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
            raise PackctlError(f"{path} row {first_row + row} column '{column}': null; --limit {column}=N needs a "
                               "whole number >= 0 on every sequence (0 where it has none): fill the row or drop it")
        numbers = numpy_view(array)
        if numbers.dtype.kind == "u" and len(numbers) and numbers.max() > np.iinfo(np.int64).max:
            row = int(np.argmax(numbers > np.iinfo(np.int64).max))
            raise PackctlError(f"{path} row {first_row + row} column '{column}': {int(numbers[row])} is above "
                               f"2^63-1; --limit {column}=N counts a sequence's cost as int64: fix the value")
        numbers = numbers.astype(np.int64)
        if len(numbers) and numbers.min() < 0:
            row = int(np.argmax(numbers < 0))
            raise PackctlError(f"{path} row {first_row + row} column '{column}': {int(numbers[row])} is negative; "
                               f"--limit {column}=N needs a whole number >= 0 on every sequence: fix the value")
        values[:, j] = numbers
    return values


def read_kept_columns(index: SequenceIndex, gids: np.ndarray, columns: list[str]) -> pa.Table:
    """The `columns` of rows `gids` (in that order, repeats allowed), read from the row groups that
    hold them: the values --keep-columns carries into the packs."""
    gids = np.asarray(gids, dtype=np.int64)
    block_of = np.searchsorted(index.block_offsets, gids, side="right") - 1
    blocks = np.unique(block_of)
    tables, start = [], np.zeros(len(index.blocks), dtype=np.int64)
    at = 0
    for b in blocks.tolist():
        block = index.blocks[b]
        pf = open_parquet(index.files[block.file].path, index.fingerprint(block.file))
        try:
            table = pf.read_row_group(block.row_group, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise PackctlError(f"{index.files[block.file].path}: cannot read column(s) {', '.join(columns)} "
                               f"({_short(exc)}); the file may be truncated or corrupt") from None
        start[b] = at
        at += table.num_rows
        tables.append(table)
    if not tables:
        schema = open_parquet(index.files[0].path, index.fingerprint(0)).schema_arrow
        return pa.table({c: pa.array([], schema.field(c).type) for c in columns})
    whole = pa.concat_tables(tables)
    return whole.take(pa.array(start[block_of] + gids - index.block_offsets[block_of]))


def _type_name(typ: pa.DataType) -> str:
    """Arrow type as messages name it, without child field names, each list layout by its own name:
    list<element: list<item: int64>> -> list<list<int64>>, fixed_size_list<item: int32>[4] ->
    fixed_size_list<int32>[4], dictionary<values=string, indices=int32, ordered=0> -> dictionary<string>."""
    if pa.types.is_fixed_size_list(typ):
        return f"fixed_size_list<{_type_name(typ.value_type)}>[{typ.list_size}]"
    for layout, is_layout in (("list", pa.types.is_list), ("large_list", pa.types.is_large_list),
                              ("list_view", pa.types.is_list_view), ("large_list_view", pa.types.is_large_list_view)):
        if is_layout(typ):
            return f"{layout}<{_type_name(typ.value_type)}>"
    if pa.types.is_dictionary(typ):
        return f"dictionary<{_type_name(typ.value_type)}>"
    if pa.types.is_struct(typ):
        return f"struct<{', '.join(f'{f.name}: {_type_name(f.type)}' for f in typ)}>"
    return str(typ)


def resolve_labels_column(schemas: dict[str, pa.Schema], requested: str | None) -> str | None:
    """The labels column to use: the requested one (every file must have it), else `labels` when
    every file has it, else none (labels = tokens). Files that disagree are an error. `schemas`:
    path -> Arrow schema, in input order."""
    paths = list(schemas)
    if requested is None:
        having = [p for p, s in schemas.items() if "labels" in s.names]
        if having and len(having) != len(paths):
            lacking = next(p for p in paths if p not in having)
            raise PackctlError(
                f"{lacking}: has no 'labels' column but {having[0]} has one; give every shard the same "
                "columns, or pass --labels-column to name the labels explicitly")
        if not having:
            return None
    labels = requested or "labels"
    for p, schema in schemas.items():  # from the footers, before any row is read
        check_list_column(p, schema, labels, "labels")
    return labels


def _flat(where: "_Where", arr: pa.Array, column: str) -> tuple[np.ndarray, pa.Array]:
    """Validated row offsets (int64, starting at 0) and the referenced child values of a list array."""
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise PackctlError(f"{where.row(row)} column '{column}': null instead of a list; "
                           "drop or fill null rows before packing")
    offsets = numpy_view(arr.offsets).astype(np.int64)
    values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    if values.null_count:
        k = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, k, side="right") - 1)
        raise PackctlError(f"{where.row(row)} column '{column}': null value at position {k - offsets[row]}; "
                           "token lists must not hold nulls")
    return offsets, values


def _row_of(offsets: np.ndarray, flat_index: int) -> tuple[int, int]:
    row = int(np.searchsorted(offsets, flat_index, side="right") - 1)
    return row, flat_index - int(offsets[row])


def decode_block(path: str, row_group: int | None, first_row: int, tokens_column: str,
                 labels_column: str | None, *, skip_empty: bool = False, check_values: bool = True,
                 expected: FileFingerprint | None = None) -> DecodedBlock:
    """Read and validate one row group (or the whole file with row_group=None): tokens in
    [0, 2^31), no nulls, no empty rows (unless `skip_empty`: they keep length 0 and the pipeline
    leaves them out), labels aligned. Errors name rows of the file. `check_values=False` leaves
    the range check of int32 columns to the caller (`compact_block` does it in its own pass).
    With `expected`, the file must still match the fingerprint the run took (`open_parquet`)."""
    pf = open_parquet(path, expected)
    schema = pf.schema_arrow
    check_list_column(path, schema, tokens_column, "tokens")
    columns = [tokens_column]
    if labels_column is not None:
        check_list_column(path, schema, labels_column, "labels")
        columns.append(labels_column)
    try:
        if row_group is None:
            table = pf.read(columns=columns, use_threads=True)
        else:
            table = pf.read_row_group(row_group, columns=columns, use_threads=True)
    except (pa.ArrowException, OSError) as exc:
        raise PackctlError(f"{path}: cannot read column(s) {', '.join(columns)} ({_short(exc)}); "
                           "the file may be truncated or corrupt") from None
    where = _Where(path, first_row)
    tok_arr = _one_array(table.column(tokens_column))
    offsets, tok_values = _flat(where, tok_arr, tokens_column)
    lengths = np.diff(offsets)
    if not skip_empty and len(lengths) and (lengths == 0).any():
        row = int(np.argmax(lengths == 0))
        raise PackctlError(f"{where.row(row)} column '{tokens_column}': empty sequence; remove empty rows or "
                           "pass --skip-empty to leave them out (counted in the manifest)")
    tokens = _as_int32(where, tok_values, offsets, tokens_column, allow_ignore=False, check=check_values)
    labels = None
    if labels_column is not None:
        lab_arr = _one_array(table.column(labels_column))
        lab_offsets, lab_values = _flat(where, lab_arr, labels_column)
        if not np.array_equal(lab_offsets, offsets):
            row = int(np.argmax(np.diff(lab_offsets) != lengths))
            raise PackctlError(
                f"{where.row(row)} column '{labels_column}': {int(np.diff(lab_offsets)[row])} labels for "
                f"{int(lengths[row])} tokens; labels must have one entry per token")
        labels = _as_int32(where, lab_values, offsets, labels_column, allow_ignore=True, check=check_values)
    return DecodedBlock(offsets=offsets, tokens=tokens, labels=labels)


def _one_array(column: pa.ChunkedArray) -> pa.Array:
    """The column as one list or large_list array (offsets and values): a fixed_size_list,
    list_view or large_list_view column is rebuilt as a large_list (a copy; they are rare), null
    rows kept null so that they are reported as nulls."""
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    typ = array.type
    if pa.types.is_fixed_size_list(typ) or pa.types.is_list_view(typ) or pa.types.is_large_list_view(typ):
        # Not Arrow's cast: pyarrow 26 casts list_view to a list array whose offsets are invalid.
        import pyarrow.compute as pc  # rare layouts only (see list_lengths)

        lengths = pc.list_value_length(array)
        offsets = offsets_of(numpy_view(lengths.fill_null(0)).astype(np.int64))
        return pa.LargeListArray.from_arrays(arrow_array(offsets, pa.int64()), pc.list_flatten(array),
                                             mask=lengths.is_null())
    return array


@dataclass(frozen=True)
class _Where:
    """Names rows of a block by their row in the file."""

    path: str
    first_row: int

    def row(self, row_in_block: int) -> str:
        return f"{self.path} row {self.first_row + row_in_block}"


def _as_int32(where: _Where, values: pa.Array, offsets: np.ndarray, column: str, *, allow_ignore: bool,
              check: bool = True) -> np.ndarray:
    """The values as int32, checked to lie in [0, 2^31) (or be -100 where `allow_ignore`); other
    integer types are always checked, since converting them must be exact."""
    arr = numpy_view(values)
    if len(arr) == 0:
        return arr.astype(np.int32)
    if check or arr.dtype != np.int32:
        k = first_outside_int32(arr, allow_ignore)
        if k >= 0:
            raise _value_error(where, offsets, column, k, int(arr[k]), allow_ignore)
    return arr.astype(np.int32, copy=False)


def _value_error(where: _Where, offsets: np.ndarray, column: str, k: int, value: int,
                 allow_ignore: bool) -> PackctlError:
    row, pos = _row_of(offsets, k)
    allowed = f"[0, {INT32_MAX}]" + (f" or {IGNORE_INDEX}" if allow_ignore else "")
    return PackctlError(f"{where.row(row)} column '{column}': value {value} at position {pos} is outside {allowed}")


def compact_block(block: Block, decoded: DecodedBlock, path: str, tokens_column: str, labels_column: str | None,
                  pad_token_id: int | None) -> tuple[DecodedBlock, int]:
    """`DecodedBlock.compact` of a block decoded with `check_values=False`, with the range check
    of `decode_block` done in the same pass (and the same error)."""
    compact, pad_like, bad_token, bad_label = decoded.compact(-1 if pad_token_id is None else pad_token_id)
    where = _Where(path, block.first_row)
    if bad_token >= 0:
        raise _value_error(where, decoded.offsets, tokens_column, bad_token, int(decoded.tokens[bad_token]), False)
    if bad_label >= 0:
        raise _value_error(where, decoded.offsets, labels_column, bad_label, int(decoded.labels[bad_label]), True)
    return compact, pad_like


def blocks_of(meta: pq.FileMetaData, f: int) -> tuple[list[Block], int]:
    blocks, first = [], 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        blocks.append(Block(file=f, row_group=g, first_row=first, rows=rg.num_rows, nbytes=rg.total_byte_size))
        first += rg.num_rows
    return blocks, first


@dataclass(frozen=True)
class _Footer:
    """What indexing reads of a file: its footer and its Arrow schema (as a ParquetFile has them)."""

    metadata: pq.FileMetaData
    schema_arrow: pa.Schema


def _open_all(resolution: Resolution) -> list[pq.ParquetFile | _Footer]:
    """Every input file opened and checked against its fingerprint. An object of a store whose
    footer the run's resolve just read is taken from that read; others are opened by several
    threads at once (each open is a HEAD and a ranged GET: latency, not bytes)."""
    files = resolution.files
    if not files or not is_url(files[0].path):
        return [open_parquet(r.path, r.fingerprint) for r in files]

    def footer(r):
        metadata = take_first_footer(r.path, r.fingerprint)
        if metadata is None:
            return open_parquet(r.path, r.fingerprint)
        return _Footer(metadata, metadata.schema.to_arrow_schema())

    with ThreadPoolExecutor(max_workers=min(16, len(files)), thread_name_prefix="packctl-footer") as pool:
        return list(pool.map(footer, files))


def index_parquet(resolution: Resolution, tokens_column: str, labels_column: str | None,
                  carried: CarriedColumns = CarriedColumns()) -> SequenceIndex:
    """Read the footers and schemas of Parquet inputs: files, blocks and gids, no lengths yet.
    Each file is opened once, checked against the fingerprint the resolver took, and that
    fingerprint is kept for every later open; the kept, weight and --limit columns of `carried`
    are checked in every file's schema (the group and prefix columns where they are read)."""
    opened = dict(zip((r.path for r in resolution.files), _open_all(resolution)))
    labels = resolve_labels_column({p: pf.schema_arrow for p, pf in opened.items()}, labels_column)
    files: list[InputFile] = []
    blocks: list[Block] = []
    kept_types: dict[str, pa.DataType] = {}
    for f, resolved in enumerate(resolution.files):
        path, pf = resolved.path, opened[resolved.path]
        file_blocks, rows = blocks_of(pf.metadata, f)
        schema = pf.schema_arrow
        check_list_column(path, schema, tokens_column, "tokens")
        for column in carried.keep:
            check_kept_column(path, schema, column, kept_types)
        if carried.weight is not None:
            check_weight_column(path, schema, carried.weight)
        for column in carried.limits:
            check_limit_column(path, schema, column)
        files.append(InputFile(path=path, rows=rows, bytes=resolved.fingerprint.size))
        blocks += file_blocks
    index = SequenceIndex.of_files(files, blocks, [r.fingerprint for r in resolution.files],
                                   tokens_column=tokens_column, labels_column=labels, carried=carried)
    if index.num_sequences == 0:
        raise PackctlError(f"{', '.join(resolution.specs)}: the input holds no rows")
    return index


def describe_block(block: Block) -> str:
    """How messages name a block: 'row group 3, rows 300..399'."""
    return f"row group {block.row_group}, rows {block.first_row}..{block.first_row + block.rows - 1}"


def split_blocks(blocks: list[Block], parts: int) -> np.ndarray:
    """Cut the block list into `parts` contiguous runs of about equal decoded size: bounds[r] is
    the first block of part r. Sizes [4, 4, 4, 4], 2 parts -> [0, 2, 4]."""
    sizes = np.array([max(b.nbytes, 1) for b in blocks], dtype=np.int64)
    ends = np.cumsum(sizes)
    targets = (np.arange(1, parts) * (int(ends[-1]) if len(ends) else 0)) // parts
    inner = np.searchsorted(ends, targets, side="left") + 1 if len(ends) else np.zeros(parts - 1, np.int64)
    return np.concatenate([[0], np.minimum(inner, len(blocks)), [len(blocks)]]).astype(np.int64)

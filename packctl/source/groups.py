"""Read `--group-column`: the groups of the corpus as the global sample ids where each one starts.

A group is a run of consecutive rows, in global input order (files sorted by path, across file
boundaries), holding one value of the column. The same value found again after another value is an
error, as is a null: rows of one group must be adjacent in the input.

    a.parquet group [7, 7, 9]   b.parquet group [9, 4]   ->  groups {0, 1} {2, 3} {4}
                                                              group_starts [0, 2, 4, 5]
    a.parquet group [7, 9, 7]                            ->  error: 7 again at a row 2 (first at a row 0)

`group_starts` (int64, sorted, ending with the number of rows) is the same on every rank; a
sequence's group id is the gid of its group's first row (`packctl.plan.groups.group_ids`).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from packctl.errors import PackctlError
from packctl.source.files import open_parquet
from packctl.source.parquet import _type_name, field_type
from packctl.source.index import RowsByGid, describe_gid


def _check_type(path: str, schema: pa.Schema, column: str, seen: list[pa.DataType]) -> None:
    if column not in schema.names:
        raise PackctlError(f"{path}: no column '{column}' for --group-column (columns: {', '.join(schema.names)}); "
                           "add one group value per row to every input file, or drop --group-column")
    typ = field_type(path, schema, column)
    if not (pa.types.is_integer(typ) or pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)}; --group-column needs an integer or "
                           "string value per row")
    if seen and seen[0] != typ:
        raise PackctlError(f"{path}: column '{column}' is {_type_name(typ)} here and {_type_name(seen[0])} in the "
                           "files before; cast it to one type in every input file")
    seen.append(typ)


def read_group_starts(index: RowsByGid, column: str) -> np.ndarray:
    """The gid where each group starts, plus the number of rows: [0, 2, 4, 5] above. Reads the
    one column of every file (a value per row) and checks nulls and adjacency; each file is
    checked against the fingerprint the run took of it (`index.fingerprints`)."""
    import pyarrow.compute as pc  # here, not at the top: a pack without groups need not load it (0.03 s)

    paths = [f.path for f in index.files]
    seen: list[pa.DataType] = []
    chunks = []
    for f, path in enumerate(paths):
        pf = open_parquet(path, index.fingerprint(f))
        _check_type(path, pf.schema_arrow, column, seen)
        try:
            chunks += pf.read(columns=[column]).column(column).chunks
        except (pa.ArrowException, OSError) as exc:
            raise PackctlError(f"{path}: cannot read column '{column}' ({exc}); the file may be truncated or "
                               "corrupt") from None
    values = pa.chunked_array(chunks, type=seen[0]).combine_chunks()
    where = (lambda gid: describe_gid(index.kind, paths, index.file_offsets, gid, column))
    if values.null_count:
        gid = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        raise PackctlError(f"{where(gid)}: null group value; give every row a group (a row alone can have a "
                           "value of its own)")
    n = len(values)
    changed = pc.not_equal(values.slice(1), values.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(changed) + 1]).astype(np.int64)
    run_values = values.take(pa.array(starts))
    order = pc.sort_indices(run_values).to_numpy()  # stable: equal values in gid order
    ranked = run_values.take(pa.array(order))
    again = np.flatnonzero(pc.equal(ranked.slice(1), ranked.slice(0, len(ranked) - 1))
                           .to_numpy(zero_copy_only=False)) if len(ranked) > 1 else np.zeros(0, np.int64)
    if len(again):
        # the earliest reappearance in input order, and where that value's group began
        later = starts[order[again + 1]]
        k = int(np.argmin(later))
        gid, first = int(later[k]), int(starts[order[again[k]]])
        value = run_values[int(order[again[k] + 1])].as_py()
        began = describe_gid(index.kind, paths, index.file_offsets, first)
        raise PackctlError(f"{where(gid)}: group value {value!r} appears again after other values (its group began "
                           f"at {began}); rows of one group must be adjacent: sort the input by the group column")
    return np.concatenate([starts, [n]]).astype(np.int64)

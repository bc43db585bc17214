"""numpy <-> Arrow for primitive columns, through their buffers.

`pa.array(ndarray)`, `np.asarray(arrow_array)` and `.to_numpy()` first ask whether pandas is
installed and import it to find out (about a quarter of a second, more than packing sample_data
takes). The pack path converts through the buffers instead: the same zero-copy views, the same
arrays, no pandas.

    arrow_array(np.array([3, 1], np.int64), pa.int32())   ->  pa.array([3, 1], pa.int32())
    numpy_view(pa.array([3, 1], pa.int32()))             ->  np.array([3, 1], np.int32) (a view)
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
          pa.uint8(): np.uint8, pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64,
          pa.float32(): np.float32, pa.float64(): np.float64}


def _dtype(type_: pa.DataType) -> np.dtype:
    try:
        return np.dtype(_NUMPY[type_])
    except KeyError:
        raise TypeError(f"not a fixed-width numeric Arrow type: {type_}") from None


def arrow_array(values: np.ndarray, type_: pa.DataType) -> pa.Array:
    """A null-free Arrow array of `type_` holding `values` (cast to its numpy dtype if needed)."""
    data = np.ascontiguousarray(values, dtype=_dtype(type_))
    return pa.Array.from_buffers(type_, len(data), [None, pa.py_buffer(data)])


def numpy_view(array: pa.Array) -> np.ndarray:
    """Read-only numpy view of a null-free fixed-width numeric Arrow array (offset respected)."""
    if array.null_count:
        raise ValueError("numpy_view needs an array without nulls")
    dtype = _dtype(array.type)
    if len(array) == 0:
        return np.empty(0, dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)

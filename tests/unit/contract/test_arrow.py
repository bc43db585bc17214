from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packctl.contract.arrow import arrow_array, numpy_view

TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
         pa.float32(), pa.float64()]


@pytest.mark.parametrize("type_", TYPES, ids=str)
def test_arrow_array_equals_pa_array(type_):
    values = np.array([0, 3, 1, 7, 2], dtype=np.int64)
    built = arrow_array(values, type_)
    assert built.type == type_ and built.equals(pa.array(values, type_)) and built.null_count == 0
    assert np.array_equal(numpy_view(built), values) and numpy_view(built).dtype == type_.to_pandas_dtype()


def test_numpy_view_respects_slices_and_list_offsets():
    lists = pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32()))
    part = lists.slice(1, 2)  # [[3], [4, 5, 6]]
    assert numpy_view(part.offsets).tolist() == part.offsets.to_pylist() == [2, 3, 6]
    assert numpy_view(pa.array(np.arange(10), pa.int64()).slice(4, 3)).tolist() == [4, 5, 6]
    assert numpy_view(pa.array([], pa.int32())).tolist() == []
    assert numpy_view(arrow_array(np.array([], np.int64), pa.int32())).dtype == np.int32


def test_numpy_view_refuses_nulls_and_other_types():
    with pytest.raises(ValueError, match="without nulls"):
        numpy_view(pa.array([1, None], pa.int32()))
    with pytest.raises(TypeError, match="not a fixed-width numeric"):
        numpy_view(pa.array([True, False]))
    with pytest.raises(TypeError, match="not a fixed-width numeric"):
        arrow_array(np.array([1]), pa.string())

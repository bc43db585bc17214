"""Small vectorized helpers over CSR-style segments (numpy only)."""
from __future__ import annotations

import numpy as np

from packctl.jit import njit


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated aranges: starts [10, 50], lens [2, 3] -> [10, 11, 50, 51, 52]."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    seg_start = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts - seg_start, lens)


def positions_in_segments(lens: np.ndarray) -> np.ndarray:
    """Index of each element inside its segment: lens [2, 3] -> [0, 1, 0, 1, 2]."""
    lens = np.asarray(lens, dtype=np.int64)
    return ranges(np.zeros(len(lens), np.int64), lens)


def offsets_of(lens: np.ndarray) -> np.ndarray:
    """CSR offsets of segment lengths: [2, 3] -> [0, 2, 5]."""
    out = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out[1:])
    return out


@njit(cache=True, nogil=True)
def _copy_segments(src, src_starts, dst, dst_starts, lens):
    for i in range(len(lens)):
        s, d, n = src_starts[i], dst_starts[i], lens[i]
        dst[d:d + n] = src[s:s + n]  # slice copies vectorize (and cast, e.g. uint16 -> int32)


def copy_segments(src: np.ndarray, src_starts: np.ndarray, dst: np.ndarray, dst_starts: np.ndarray,
                  lens: np.ndarray) -> None:
    """dst[dst_starts[i] : +lens[i]] = src[src_starts[i] : +lens[i]] for every i, without index arrays.

    Same result as `dst[ranges(dst_starts, lens)] = src[ranges(src_starts, lens)]` with no int64
    temporaries the size of the data, and without holding the GIL (writer threads run in parallel).
    """
    _copy_segments(src, np.asarray(src_starts, np.int64), dst, np.asarray(dst_starts, np.int64),
                   np.asarray(lens, np.int64))


@njit(cache=True, nogil=True)
def _segment_positions(lens, out):
    k = 0
    for i in range(len(lens)):
        segment = out[k:k + lens[i]]  # a view: the loop below vectorizes
        for j in range(len(segment)):
            segment[j] = j
        k += lens[i]


def segment_positions(lens: np.ndarray, dtype=np.int32, out: np.ndarray | None = None) -> np.ndarray:
    """`positions_in_segments` straight into `dtype` (or into `out`): lens [2, 3] -> [0, 1, 0, 1, 2]."""
    lens = np.asarray(lens, dtype=np.int64)
    if out is None:
        out = np.empty(int(lens.sum()), dtype=dtype)
    _segment_positions(lens, out)
    return out


class Scratch:
    """Output arrays reused from one call to the next (one Scratch per thread).

    `take(name, n, dtype)` returns n elements of a buffer kept for `name`, grown when too small.
    Building shard after shard into the same buffers reuses memory already touched: on many
    machines filling fresh pages costs more than the copy itself. What was taken under a name is
    valid until that name is taken again.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def take(self, name: str, n: int, dtype) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != np.dtype(dtype) or len(buf) < n:
            buf = self._buffers[name] = np.empty(max(n, n + n // 8, 1), dtype=dtype)
        return buf[:n]


def row_cumsums(values: np.ndarray, seq_offsets: np.ndarray, dtype=np.int64) -> np.ndarray:
    """`[0, cumsum(values of the row)]` of every row (rows are CSR over `values`), flattened:
    rows [3, 2], [4] -> 0 3 5 0 4. The cu_seqlens columns are this of the sequence lengths."""
    seq_offsets = np.asarray(seq_offsets, dtype=np.int64)
    rows = len(seq_offsets) - 1
    row_of = np.repeat(np.arange(rows), np.diff(seq_offsets))
    inclusive = np.cumsum(values, dtype=np.int64)
    before_row = np.concatenate([[0], inclusive])[seq_offsets[:-1]]
    out = np.zeros(len(values) + rows, dtype=dtype)
    out[np.arange(len(values)) + row_of + 1] = inclusive - before_row[row_of]
    return out


@njit(cache=True, nogil=True)
def _count_not_equal(values, starts, lens, ignored, out):
    for i in range(len(lens)):
        n = 0
        for k in range(starts[i], starts[i] + lens[i]):
            if values[k] != ignored:
                n += 1
        out[i] = n


def count_not_equal(values: np.ndarray, starts: np.ndarray, lens: np.ndarray, ignored: int) -> np.ndarray:
    """int64 count of the elements other than `ignored` in each segment [starts[i], +lens[i]) of
    `values`, without temporaries the size of the data (the loss tokens of sequences are this of
    their labels, with -100): values 5 -100 7 8, starts [0, 3], lens [3, 1], ignored -100 -> [2, 1]."""
    out = np.zeros(len(lens), np.int64)
    _count_not_equal(values, np.asarray(starts, np.int64), np.asarray(lens, np.int64), ignored, out)
    return out

"""Small input tables written where a test wants them."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_table(path: Path, columns: dict) -> Path:
    """A Parquet file of `columns` (name -> Arrow array or Python lists) at `path`, folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def sample_corpus(path: Path, **spec) -> Path:
    """A synthetic corpus (packctl sample) at `path`: SampleSpec fields in `spec`."""
    from packctl.sample import SampleSpec, write_sample

    write_sample(path, SampleSpec(**spec))
    return path

"""Fuzzing `pack`: random tokenized tables and options give either an output that passes the
independent contract checker (with the source), or a clean PackctlError: one line, exit code 2,
and nothing written beside the inputs. Never another exception, never a partial OUT.

Examples: 100 in the default hypothesis profile, 500 with HYPOTHESIS_PROFILE=thorough, N with
PACKCTL_FUZZ_EXAMPLES=N.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from support.contract import check_contract
from support.profiles import examples
from packctl import PackConfig, PackctlError, pack
from packctl.config import ALGORITHMS, choices_of

ORDERS, TOO_LONG = choices_of("order"), choices_of("too_long")

INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
MAX_CAPACITY = 16
EXAMPLES = int(os.environ.get("PACKCTL_FUZZ_EXAMPLES", examples(500, default=100)))


def _bounds(typ: pa.DataType) -> tuple[int, int]:
    info = np.iinfo(typ.to_pandas_dtype())
    return int(info.min), int(info.max)


@st.composite
def token_lists(draw, typ: pa.DataType, max_len: int, *, labels: bool = False):
    lo, hi = _bounds(typ)
    small = st.integers(max(lo, 0), min(hi, 40))
    edge = st.sampled_from([v for v in (lo, hi, -1, -100, 2**31 - 1, 2**31) if lo <= v <= hi])
    rare = draw(st.integers(0, 39))  # now and then: an edge value, a null value, a null row, an empty row
    value = st.one_of(small, small, small, edge) if rare == 0 else small
    if rare == 1:
        value = st.one_of(small, small, small, st.none())
    if labels:
        value = st.one_of(value, st.just(-100) if lo <= -100 else small)
    if rare == 2:
        return None
    return draw(st.lists(value, min_size=0 if rare == 3 else 1, max_size=max_len))


@st.composite
def files(draw):
    """1 to 3 Parquet tables: (columns, row_group_size)."""
    n_files = draw(st.integers(1, 3))
    with_labels = draw(st.sampled_from([0, 1, 1, 1, 2]))  # 0: none, 1: every file, 2: decided per file
    out = []
    for _ in range(n_files):
        typ = draw(st.sampled_from(INT_TYPES))
        rows = draw(st.lists(token_lists(typ, 2 * MAX_CAPACITY), min_size=draw(st.sampled_from([0, 1, 1, 1])),
                             max_size=8))
        columns = {"input_ids": pa.array(rows, pa.list_(typ))}
        if with_labels == 1 or (with_labels == 2 and draw(st.booleans())):
            label_type = draw(st.sampled_from([pa.int32(), pa.int64(), pa.int16()]))
            if draw(st.integers(0, 19)) == 0:  # ragged or wrong labels
                labels = draw(st.lists(token_lists(label_type, 2 * MAX_CAPACITY, labels=True), min_size=len(rows),
                                       max_size=len(rows)))
            else:  # the tokens, some masked; values as they are (out-of-range ones stay out of range)
                label_type = pa.int64()
                labels = [None if r is None else [(-100 if draw(st.integers(0, 3)) == 0 else v) for v in r]
                          for r in rows]
                labels = [None if r is None else [v if v is None else min(max(v, -2**40), 2**40) for v in r]
                          for r in labels]
            columns["labels"] = pa.array(labels, pa.list_(label_type))
        out.append((columns, draw(st.integers(1, 4))))
    return out


options = st.fixed_dictionaries({
    "capacity": st.sampled_from([1, 2, 4, 6, 8, 8, 12, MAX_CAPACITY, MAX_CAPACITY]),
    "algorithm": st.sampled_from(ALGORITHMS),
    "order": st.sampled_from(ORDERS),
    "curriculum_order": st.sampled_from(["asc", "desc"]),
    "seed": st.integers(0, 5),
    "window": st.integers(1, 12),
    "cp_size": st.sampled_from([1, 1, 1, 2]),
    "tp_size": st.sampled_from([1, 1, 1, 2]),
    "seq_multiple": st.sampled_from([1, 1, 1, 1, 2, 3]),
    "pad_to": st.sampled_from(["capacity", "multiple"]),
    "pad_token_id": st.integers(0, 3),
    "max_seqs_per_bin": st.sampled_from([None, None, None, None, 0, 1, 2, 3]),
    "too_long": st.sampled_from(TOO_LONG + ("split", "truncate")),
    "shard_rows": st.integers(1, 4),
    "skip_empty": st.booleans(),
})


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
@given(tables=files(), opts=options)
def test_output_passes_the_contract_or_a_clean_error(contract, tmp_path_factory, tables, opts):
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as tmp:  # one per example
        root = Path(tmp)
        sources = []
        for k, (columns, row_group_size) in enumerate(tables):
            path = root / "in" / f"part-{k}.parquet"
            path.parent.mkdir(exist_ok=True)
            pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
            sources.append(path)
        out = root / "out"
        try:
            result = pack(PackConfig(inputs=[str(root / "in")], output=str(out), **opts))
        except PackctlError as exc:
            message = str(exc)
            event("error: " + re.sub(r"\d+", "N", message.replace(tmp, "")).split(";")[0][-45:])
            assert message and "\n" not in message and exc.exit_code == 2, message
            assert sorted(p.name for p in root.iterdir()) == ["in"], message  # no OUT, no partial, no lock
            return
        event("packed")
        assert sorted(p.name for p in root.iterdir()) == ["in", "out"]
        assert check_contract(contract, out, sources) == []
        counts = result.counts
        assert counts["sequences_packed"] + counts["sequences_dropped"] == counts["sequences_in"]
        assert counts["sequences_skipped_empty"] <= counts["sequences_dropped"]

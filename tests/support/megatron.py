"""Megatron indexed datasets (PREFIX.bin + PREFIX.idx) for tests, and their Parquet twins.

`build_with_megatron` writes a pair with megatron-core's own IndexedDatasetBuilder (the reference;
importing megatron costs seconds, once per process). `write_pair` writes the same bytes with numpy
alone (tests/unit/source/test_megatron.py checks that, byte for byte), for the many tiny inputs of
the adversarial tests. `write_twin` writes the same documents as Parquet, one row per document.

A corpus is a list of documents, each a list of sequences, each a list of token ids:

    [[[5, 6, 7], [8, 9]], [[1, 2, 3, 4]]]   ->  document 0 = 5 6 7 8 9, document 1 = 1 2 3 4
"""
from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def build_with_megatron(prefix: Path, documents: list, dtype=np.int32, *, multimodal: bool = False,
                        modes: list | None = None) -> Path:
    """The pair megatron-core writes: `add_item` per sequence, `end_document` per document
    (`modes`: one list per document, with `multimodal`). Returns the .idx path."""
    import pytest

    pytest.importorskip("megatron.core")
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype, multimodal=multimodal)
    for d, document in enumerate(documents):
        for s, sequence in enumerate(document):
            mode = modes[d][s] if modes is not None else 0
            builder.add_item(torch.tensor(np.asarray(sequence, dtype=np.int64)), mode=mode)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return Path(f"{prefix}.idx")


def write_pair(prefix: Path, documents: list, dtype=np.int32, *, modes: list | None = None) -> Path:
    """The same bytes as `build_with_megatron`, with numpy (the layout of packctl/source/megatron.py)."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype)
    sequences = [np.asarray(s, dtype=dtype) for document in documents for s in document]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * dtype.itemsize)[:-1]]).astype(np.int64) \
        if len(sequences) else np.zeros(0, np.int64)
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    Path(f"{prefix}.bin").write_bytes(b"".join(s.tobytes() for s in sequences))
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, CODES[dtype.type], len(sequences), len(doc_index))
           + lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())
    if modes is not None:
        idx += np.array([m for document in modes for m in document], dtype=np.int8).tobytes()
    Path(f"{prefix}.idx").write_bytes(idx)
    return Path(f"{prefix}.idx")


def write_twin(path: Path, documents: list, row_group_size: int | None = None) -> Path:
    """The documents as a Parquet file, one `input_ids` row per document (its sequences joined)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [[int(t) for s in document for t in s] for document in documents]
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path,
                   row_group_size=row_group_size)
    return path


def random_documents(seed: int, count: int, *, high: int = 50000, max_sequences: int = 3, max_length: int = 40,
                     empty: float = 0.0) -> list:
    """`count` documents of 1..max_sequences sequences of 1..max_length ids below `high`; a share
    `empty` of them are empty (no sequence, or one of no tokens)."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        if rng.random() < empty:
            documents.append([] if rng.random() < 0.5 else [[]])
            continue
        documents.append([rng.integers(0, high, int(rng.integers(1, max_length + 1))).tolist()
                          for _ in range(int(rng.integers(1, max_sequences + 1)))])
    return documents


def data_columns(out: Path) -> dict[str, list]:
    """Every column of every shard of OUT, by shard path: what two runs of the same tokens share
    (the shards' `packctl` metadata names their inputs, so whole files differ)."""
    import json

    manifest = json.loads((out / "_manifest.json").read_text())
    return {s["path"]: pq.read_table(out / s["path"]).to_pydict() for s in manifest["shards"]}

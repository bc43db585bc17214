"""Tiny packed outputs written by hand, for the readers' tests: pack k holds one sequence of 4
tokens [k, k, k, k] (labels -100 k k k), capacity 4."""
from __future__ import annotations

import json

import pyarrow as pa

from packctl.contract.schema import IGNORE_INDEX, METADATA_KEY, PACK_SCHEMA

LAYOUT = {"capacity": 4, "align": 1, "pad_to": "capacity", "pack_multiple": 1, "pad_token_id": 0,
          "ignore_index": IGNORE_INDEX, "cp_size": 1, "tp_size": 1, "sequence_parallel": True}


def tiny_packs(first: int, count: int, layout: dict = LAYOUT, version: int = 2) -> pa.Table:
    """Packs first .. first + count - 1 as a shard's table, with its `packctl` metadata."""
    packs = range(first, first + count)
    columns = {"input_ids": [[k] * 4 for k in packs], "labels": [[IGNORE_INDEX, k, k, k] for k in packs],
               "position_ids": [[0, 1, 2, 3] for _ in packs], "seq_lens": [[4] for _ in packs],
               "seq_lens_padded": [[4] for _ in packs], "cu_seqlens": [[0, 4] for _ in packs],
               "cu_seqlens_padded": [[0, 4] for _ in packs], "sample_ids": [[k] for k in packs],
               "num_tokens": [4 for _ in packs]}
    table = pa.table(columns, schema=PACK_SCHEMA)
    return table.replace_schema_metadata({METADATA_KEY: json.dumps({"format_version": version, "layout": layout})})

"""A small, independent referee of conservation: every source row is in OUT once, or in pieces,
or accounted for in the manifest's counts. It reads only the manifest and the Parquet files
(pyarrow + numpy), never packctl, so that it can judge packctl. The contract checker beside the
repository (../shared/contract/check_output.py) checks this and every layout rule; this referee
is what tests/support/adversary.py uses in a clone with nothing beside it.

    every_sample_once(OUT, [corpus]) -> []                          # every row whole, once
    every_sample_once(OUT, [corpus]) -> ["sample 7: 2 rows ..."]    # what is wrong, one line each

Row r of the sources (files in the manifest's input order, else sorted; rows counted through the
files) is sample id r. In OUT a sample is:

    whole       one sequence, its tokens those of row r
    truncated   one sequence, a prefix of row r          (counted in sequences_truncated)
    split       several sequences whose tokens, in the order they appear in OUT, rebuild row r
                (counted in sequences_split)
    dropped     absent                                     (counted in sequences_dropped; a row
                over a --limit is dropped and counted in over_limit too)

A sequence's labels are the row's labels (its tokens when the row has none), except -100 at the
sequence's first token. Example: row [5, 6, 7, 8] split into [5, 6] and [7, 8] has labels
[-100, 6] and [-100, 8].
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

IGNORE = -100


def every_sample_once(out: Path, sources: list[Path]) -> list[str]:
    """What breaks conservation in OUT against `sources` (files or folders of Parquet files), one
    line each; empty when every row is whole, truncated, split or dropped as the manifest counts."""
    out = Path(out)
    manifest = json.loads((out / "_manifest.json").read_text())
    config = manifest.get("config", {})
    tokens_column = config.get("tokens_column", "input_ids")
    labels_column = config.get("labels_column", "labels")
    source_tokens, source_labels = _source_rows(_source_files(manifest, sources), tokens_column, labels_column)
    pieces: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for shard in manifest["shards"]:
        for sample_id, tokens, labels in _sequences(out / shard["path"]):
            pieces.setdefault(sample_id, []).append((tokens, labels))
    errors = [f"sample {s}: in OUT, not in the {len(source_tokens)} source rows"
              for s in sorted(pieces) if not 0 <= s < len(source_tokens)]
    if errors:
        return errors
    truncated = split = 0
    for sample_id, parts in sorted(pieces.items()):
        row = source_tokens[sample_id]
        rebuilt = np.concatenate([tokens for tokens, _ in parts])
        if len(rebuilt) > len(row) or not np.array_equal(rebuilt, row[:len(rebuilt)]):
            errors.append(f"sample {sample_id}: its {len(parts)} sequence(s) in OUT do not rebuild its "
                          f"{len(row)} source tokens (nor a prefix of them)")
            continue
        start = 0
        for tokens, labels in parts:
            want = source_labels[sample_id][start:start + len(tokens)].copy()
            want[0] = IGNORE
            if not np.array_equal(labels, want):
                errors.append(f"sample {sample_id}: labels of its sequence at source token {start} are not "
                              "the source labels with -100 first")
            start += len(tokens)
        split += len(parts) > 1
        truncated += len(rebuilt) < len(row)
    counts = manifest.get("counts", {})
    dropped = len(source_tokens) - len(pieces)
    for what, seen in (("dropped", dropped), ("split", split), ("truncated", truncated)):
        if seen != counts.get(f"sequences_{what}", 0):
            errors.append(f"{seen} samples {what} in OUT; the manifest counts "
                          f"sequences_{what}={counts.get(f'sequences_{what}', 0)}")
    if counts.get("over_limit", 0) > dropped:
        errors.append(f"over_limit={counts['over_limit']} in the manifest, but only {dropped} samples dropped")
    return errors


def _source_files(manifest: dict, sources: list[Path]) -> list[Path]:
    """The Parquet files of `sources` in sample-id order: the manifest's inputs when each names one
    of them (its path, or the path's last parts: data/a.parquet is /x/data/a.parquet), else sorted."""
    files = sorted(p for s in map(Path, sources) for p in (sorted(s.rglob("*.parquet")) if s.is_dir() else [s]))
    listed = [Path(i["path"]) for i in manifest.get("inputs") or [] if isinstance(i, dict) and "path" in i]
    ordered = []
    for path in listed:
        same = [f for f in files if f.resolve() == path.resolve() or f.parts[-len(path.parts):] == path.parts]
        if len(same) != 1:
            return files
        ordered += same
    return ordered or files


def _source_rows(files: list[Path], tokens_column: str, labels_column: str | None):
    """Tokens and labels of every source row, as int64 arrays, rows of all files in order."""
    tokens, labels = [], []
    for path in files:
        table = pq.read_table(path)
        rows = _rows(table.column(tokens_column))
        tokens += rows
        labels += (_rows(table.column(labels_column)) if labels_column and labels_column in table.column_names
                   else rows)
    return tokens, labels


def _sequences(shard: Path):
    """(sample id, tokens, labels) of each sequence of a shard, packs in order, padding left out."""
    table = pq.read_table(shard, columns=["input_ids", "labels", "cu_seqlens_padded", "seq_lens", "sample_ids"])
    columns = {name: _rows(table.column(name)) for name in table.column_names}
    for ids, labels, starts, lengths, sample_ids in zip(*(columns[name] for name in table.column_names)):
        for start, length, sample_id in zip(starts[:-1], lengths, sample_ids):
            yield int(sample_id), ids[start:start + length], labels[start:start + length]


def _rows(column) -> list[np.ndarray]:
    """A list column as one int64 array per row."""
    array = column.combine_chunks()
    values = array.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = array.offsets.to_numpy()  # of the whole child array: a sliced column starts past 0
    return [values[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]] for i in range(len(array))]

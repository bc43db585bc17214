"""A pack's token columns from the source: every piece gathered from its decoded block straight
into its place in the pack. The one build of the token columns wherever the blocks are at hand:
`pack` writing from the blocks it holds (pipeline/materialize.py), and the readers of a plan
(`pack --plan-only`), `packctl.torch.PackedDataset` and `packctl materialize`'s checks.

    piece (gid 7, start 0, len 3), (gid 2, start 4, len 2); align 4, pack length 8, pad 0
    block of gids 0..9:  row 7 = t0 t1 t2 ...   row 2 = u0 u1 u2 u3 u4 u5
    input_ids   t0 t1 t2  0 u4 u5  0  0         (lay_out_packs does the rest: labels, positions)

A plan records, per piece, its sample (`sample_ids`), its start inside the sample (`seq_starts`)
and its length (`seq_lens`); `plan_source` opens the source a plan was made from, refusing a file
that is missing or not the file the plan read (its size or Parquet footer differ).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from packctl.contract.arrow import arrow_array
from packctl.contract.schema import (SAMPLE_IDS, SEQ_LENS, SEQ_LENS_PADDED, SEQ_STARTS, TOKEN_COLUMNS,
                                     column_order)
from packctl.contract.thd import PackRows, lay_out_packs, lay_out_sequences
from packctl.errors import PackctlError
from packctl.source.blocks import DecodedBlock
from packctl.source.files import FileFingerprint
from packctl.source.scan import TokenSource
from packctl.source.index import Block, InputFile, SequenceIndex
from packctl.source.kinds import InputKind, InputOptions, kind_of_paths, options_of
from packctl.urls import is_url

Place = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def place_from_blocks(index: SequenceIndex, gids: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                      block: Callable[[int], DecodedBlock]) -> Place:
    """The `place` of `lay_out_packs` for pieces (gid, start, len) read from their decoded blocks,
    `block(b)` giving block b; each block is asked for once, its pieces gathered in one call."""
    block_of = np.searchsorted(index.block_offsets, gids, side="right") - 1
    order = np.argsort(block_of, kind="stable")
    blocks, first = np.unique(block_of[order], return_index=True)
    cuts = np.append(first, len(order))

    def place(input_ids: np.ndarray, labels: np.ndarray, piece_flat_start: np.ndarray) -> None:
        for k, b in enumerate(blocks.tolist()):
            sel = order[cuts[k]:cuts[k + 1]]
            decoded = block(b)
            src_starts = decoded.offsets[gids[sel] - index.block_offsets[b]] + starts[sel]
            decoded.gather_into(src_starts, lens[sel], input_ids, labels, piece_flat_start[sel])

    return place


def plan_rows(table: pa.Table, block: "BlockCache", pad_token_id: int) -> PackRows:
    """The packs of a plan's table (its rows: seq_lens, seq_lens_padded, sample_ids, seq_starts)
    with their token columns gathered from the source (`place_from_blocks`)."""
    lens = table.column(SEQ_LENS).combine_chunks()
    bin_offsets = lens.offsets.to_numpy().astype(np.int64)
    bin_offsets -= bin_offsets[0]  # a slice of a table starts its list offsets anywhere
    flat = {name: table.column(name).combine_chunks().flatten().to_numpy().astype(np.int64)
            for name in (SEQ_LENS, SEQ_LENS_PADDED, SAMPLE_IDS, SEQ_STARTS)}
    padded = flat[SEQ_LENS_PADDED]
    sums = np.concatenate([[0], np.cumsum(padded)])
    place = place_from_blocks(block.index, flat[SAMPLE_IDS], flat[SEQ_STARTS], flat[SEQ_LENS], block)
    rows = lay_out_sequences(bin_offsets, flat[SEQ_LENS], padded, flat[SAMPLE_IDS],
                             sums[bin_offsets[1:]] - sums[bin_offsets[:-1]])
    return lay_out_packs(rows, place, pad_token_id=pad_token_id)


def with_tokens(table: pa.Table, block: "BlockCache", pad_token_id: int) -> pa.Table:
    """A plan's table as the materialized shard holds it: the token columns in their place, no
    seq_starts (what `packctl verify` checks a plan as)."""
    rows = plan_rows(table, block, pad_token_id)
    offsets = arrow_array(rows.token_offsets, pa.int32())
    columns = {name: table.column(name) for name in table.column_names if name != SEQ_STARTS}
    for name in TOKEN_COLUMNS:
        columns[name] = pa.ListArray.from_arrays(offsets, arrow_array(getattr(rows, name), pa.int32()))
    names = column_order(columns)
    fields = [pa.field(n, columns[n].type, nullable=False) for n in names]
    return pa.Table.from_arrays([columns[n] for n in names], schema=pa.schema(fields, metadata=table.schema.metadata))


class BlockCache:
    """Decoded blocks of a source, the most recently used kept while they fit in `budget` bytes:
    the packs of a shard usually draw on a few blocks, and the next shard on the same ones."""

    def __init__(self, index: SequenceIndex, source: TokenSource, budget: int = 1 << 30):
        self.index, self.source, self.budget = index, source, budget
        self._blocks: OrderedDict[int, DecodedBlock] = OrderedDict()
        self.held = 0
        self.decoded = 0  # blocks decoded so far (a block evicted and wanted again counts twice)

    def __call__(self, b: int) -> DecodedBlock:
        found = self._blocks.get(b)
        if found is not None:
            self._blocks.move_to_end(b)
            return found
        decoded = self.source.check_digest(b, self.index.blocks[b], self.source.decode(self.index.blocks[b]))
        self.decoded += 1
        self._blocks[b] = decoded
        self.held += decoded.nbytes
        while self.held > self.budget and len(self._blocks) > 1:
            _, dropped = self._blocks.popitem(last=False)
            self.held -= dropped.nbytes
        return decoded

    def __getstate__(self) -> dict[str, Any]:
        # a DataLoader worker gets a copy: the index, not the decoded blocks
        state = dict(self.__dict__)
        state["_blocks"], state["held"] = OrderedDict(), 0
        return state


def _read_source_file(kind: InputKind, path: str, f: int, options: InputOptions
                      ) -> tuple[FileFingerprint, list[Block], int]:
    """A source file as it is now, read by the plan's kind: its fingerprint, blocks and rows."""
    return kind.read_file(path, f, options=options)


def plan_source(manifest: dict[str, Any], manifest_file: os.PathLike | str, *,
                budget: int = 1 << 30) -> tuple[SequenceIndex, TokenSource]:
    """The source a plan was made from, as its manifest records it: every input file present and
    the same file (size and Parquet footer, or a Megatron pair's `.idx` fingerprint, as recorded), its blocks indexed from the footers. One
    PackctlError line naming the file otherwise. `budget` is unused by the source itself (nothing
    is cached in it); readers cache with `BlockCache`."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    inputs = manifest.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise PackctlError(f"{manifest_file}: a plan without its inputs; run packctl pack --plan-only again")
    files: list[InputFile] = []
    blocks: list[Block] = []
    fingerprints: list[FileFingerprint] = []
    digests: dict[int, int] = {}
    options = options_of(config)  # the kind of the plan's inputs, as the plan's options decide it
    paths = [entry.get("absolute_path") for entry in inputs]
    kind = kind_of_paths([p for p in paths if isinstance(p, str)], options)
    for f, entry in enumerate(inputs):
        path, footer, size = entry.get("absolute_path"), entry.get("footer"), entry.get("bytes")
        if not isinstance(path, str) or not isinstance(footer, str) or not isinstance(size, int):
            raise PackctlError(f"{manifest_file}: inputs[{f}] records no fingerprint of its file (absolute_path, "
                               "bytes, footer); run packctl pack --plan-only again")
        if not is_url(path) and not os.path.exists(path):  # a missing object is refused by its read
            raise PackctlError(f"{path}: source of the plan {manifest_file} is missing; a plan reads its tokens from "
                               "the files it was made from: put the file back, or run packctl pack again")
        fingerprint, file_blocks, rows = _read_source_file(kind, path, f, options)
        if fingerprint.size != size or fingerprint.footer != footer:
            what = (f"its size is {fingerprint.size} bytes, the plan read {size}" if fingerprint.size != size
                    else kind.changed_what)
            raise PackctlError(f"{path}: not the source the plan {manifest_file} was made from ({what}); restore "
                               "that file, or make a new plan of this one with packctl pack --plan-only")
        if rows != entry.get("rows"):
            raise PackctlError(f"{path}: {rows} rows, the plan {manifest_file} read {entry.get('rows')}; restore "
                               "that file, or make a new plan with packctl pack --plan-only")
        recorded = entry.get("block_digests")
        if isinstance(recorded, list) and len(recorded) == len(file_blocks):  # checked as each block is decoded
            digests.update({len(blocks) + k: d for k, d in enumerate(recorded)})
        files.append(InputFile(path=path, rows=rows, bytes=size))
        blocks += file_blocks
        fingerprints.append(fingerprint)
    tokens_column, labels_column = config.get("tokens_column"), config.get("labels_column")
    if not isinstance(tokens_column, str):
        raise PackctlError(f"{manifest_file}: config.tokens_column is missing; run packctl pack --plan-only again")
    index = SequenceIndex.of_files(files, blocks, fingerprints, tokens_column=tokens_column,
                                   labels_column=labels_column if isinstance(labels_column, str) else None,
                                   kind=kind, options=options)
    source = TokenSource.of_index(index, index.labels_column, budget, skip_empty=bool(config.get("skip_empty", False)))
    source.digests = digests
    return index, source

"""The scan of any kind's blocks: the index of a resolved INPUT (`index_inputs`), every block
decoded and checked once by the run's kind (`scan_blocks`), and the decoded blocks kept for
materialize (`TokenSource`).

This module sits above `source/kinds/`: it asks the kind an index carries, and no kind imports it.

    resolve(INPUT, options)  ->  Resolution (files, kind)  ->  index_inputs  ->  SequenceIndex
    scan_blocks(index, range(lo, hi), budget)  ->  lengths of gids in blocks [lo, hi), TokenSource
"""
from __future__ import annotations

import dataclasses
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from packctl.source.blocks import DecodedBlock, block_digest
from packctl.source.files import FileFingerprint, changed_error
from packctl.source.index import Block, Resolution, SequenceIndex
from packctl.source.kinds import InputKind, InputOptions
from packctl.source.parquet import check_weights, compact_block, describe_block, read_limit_values
from packctl.source.prefix import PrefixScan, block_prefixes, read_prefix_lengths
from packctl.specs import CarriedColumns
from packctl.urls import is_url

STORE_READ_AHEAD = 8  # blocks of an object store's input decoded ahead of the scan (local files: 2)


class TokenSource:
    """Decoded blocks, kept (in compact form, `DecodedBlock.compact`) while they fit in `budget` bytes.

    Scan decodes every block once to learn lengths and keeps as many as the budget allows;
    materialize `take`s each block exactly once, in order, so a corpus that fits is read once and
    a larger one is read twice (the blocks that did not fit are decoded again).
    """

    def __init__(self, paths: list[str], tokens_column: str, labels_column: str | None, budget: int,
                 skip_empty: bool = False, fingerprints: list[FileFingerprint] | None = None, *,
                 kind: InputKind, options: InputOptions):
        self.paths = paths
        self.kind = kind  # what reads every file (the run's, from its index), with these options:
        self.options = dataclasses.replace(options, tokens_column=tokens_column, labels_column=labels_column)
        self.fingerprints = fingerprints or None  # every decode checks its file against them
        self.tokens_column = tokens_column
        self.labels_column = labels_column
        self.budget = budget
        self.skip_empty = skip_empty
        self.tokens_equal_to_pad_id = 0  # counted by scan_blocks when given a pad id
        self._cache: dict[int, DecodedBlock] = {}
        self.held = 0
        self.blocks_reread = 0
        # block -> `block_digest` of what scan decoded: a block decoded again must match it
        self.digests: dict[int, int] = {}

    def offer(self, b: int, decoded: DecodedBlock) -> bool:
        """Keep a decoded block if it fits in the budget; scan offers blocks in order, so the
        cache holds a prefix of the corpus, which materialize consumes first."""
        if self.held + decoded.nbytes > self.budget:
            return False
        self._cache[b] = decoded
        self.held += decoded.nbytes
        return True

    def cached(self, b: int) -> bool:
        return b in self._cache

    def peek(self, b: int) -> DecodedBlock:
        """A cached block, left in the cache."""
        return self._cache[b]

    def take(self, b: int, block: Block) -> DecodedBlock:
        """Block b's tokens, from the cache (and released from it) or decoded again."""
        decoded = self._cache.pop(b, None)
        if decoded is not None:
            self.held -= decoded.nbytes
            return decoded
        self.blocks_reread += 1
        return self.check_digest(b, block, self.decode(block))

    def refuse_changed(self, blocks: list[Block], recorded: dict[int, int], reader: str) -> None:
        """Refuse, in one line, a block scan read other than `reader` recorded (`digests`)."""
        for b, digest in self.digests.items():
            if b in recorded and recorded[b] != digest:
                block = blocks[b]
                raise changed_error(self.paths[block.file], f"{describe_block(block)} holds other tokens than {reader}; "
                                    "its size, modification time and footer are the same")

    def check_digest(self, b: int, block: Block, decoded: DecodedBlock) -> DecodedBlock:
        """`decoded`, block b decoded again, if it is what scan read of it (`digests`), else one line."""
        if b in self.digests and block_digest(decoded) != self.digests[b]:
            raise changed_error(self.paths[block.file], f"{describe_block(block)} holds other tokens than scan read; "
                                "its size, modification time and footer are the same")
        return decoded

    def decode(self, block: Block, check_values: bool = True) -> DecodedBlock:
        """Block `block` decoded by the run's kind of input (`packctl.source.kinds`), its file
        checked against the run's fingerprint."""
        path = self.paths[block.file]
        expected = self.fingerprints[block.file] if self.fingerprints else None
        return self.kind.decode(path, block, self.options, skip_empty=self.skip_empty, check_values=check_values,
                                expected=expected)

    @classmethod
    def of_index(cls, index: SequenceIndex, labels_column: str | None, budget: int, *,
                 skip_empty: bool = False) -> "TokenSource":
        """The source of an index's files, read by its kind and options."""
        return cls([f.path for f in index.files], index.tokens_column, labels_column, budget, skip_empty=skip_empty,
                   fingerprints=index.fingerprints, kind=index.kind, options=index.options)


def index_inputs(resolution: Resolution, options: InputOptions, carried: CarriedColumns = CarriedColumns()
                 ) -> SequenceIndex:
    """The SequenceIndex of the resolved INPUT (`packctl.source.resolve.resolve`), by the kind the
    resolution chose (`packctl.source.kinds`): files, blocks and gids, no lengths yet; the index
    carries that kind, the options and the `carried` columns, which every later reader of it uses."""
    kind = resolution.kind
    index = kind.index(resolution, options, carried)
    return dataclasses.replace(index, kind=kind, options=index.options or options, carried=carried)


def scan_blocks(index: SequenceIndex, blocks: range, budget: int, progress=None, *, skip_empty: bool = False,
                pad_token_id: int | None = None, count_loss_tokens: bool = False,
                share_prefix: bool = False) -> tuple[SequenceIndex, TokenSource]:
    """Decode and validate `blocks` (a rank's run of them): their lengths, and a token source that
    keeps as many of them as the budget allows, in compact form (`DecodedBlock.compact`).
    Decoding runs on a small thread pool (Parquet and the kernels release the GIL), results in
    order. With `skip_empty`, empty rows get length 0 instead of an error; with `pad_token_id`,
    input tokens equal to it are counted in `source.tokens_equal_to_pad_id` (allowed, but worth
    knowing); with `count_loss_tokens`, `index.loss_tokens` (the step sums of --dp-size need them);
    with `index.limit_columns`, `index.extra` (their values, checked: `read_limit_values`); with
    `share_prefix`, `index.prefix_scan` (what --share-prefix needs of every row: `PrefixScan`,
    bounded by `index.carried.prefix` where the run names a prefix column)."""
    source = TokenSource.of_index(index, index.labels_column, budget, skip_empty=skip_empty)
    block_lo, block_hi = blocks.start, blocks.stop
    gid_lo, gid_hi = int(index.block_offsets[block_lo]), int(index.block_offsets[block_hi])
    lengths = np.zeros(gid_hi - gid_lo, dtype=np.int64)
    loss_tokens = np.zeros(gid_hi - gid_lo, dtype=np.int64) if count_loss_tokens else None
    limited = index.limit_columns
    extra = np.zeros((gid_hi - gid_lo, len(limited)), dtype=np.int64) if limited else None
    prefix_column, weight_column = index.carried.prefix, index.carried.weight
    prefix = PrefixScan.empty(gid_hi - gid_lo, prefix_column is not None) if share_prefix else None

    def decode(block: Block) -> tuple[DecodedBlock, int, np.ndarray | None]:
        if weight_column is not None:
            check_weights(source.paths[block.file], block.row_group, block.first_row, weight_column,
                          index.fingerprint(block.file))
        costs = None
        if limited:
            costs = read_limit_values(source.paths[block.file], block.row_group, block.first_row, limited,
                                      block.rows, index.fingerprint(block.file))
        decoded = source.decode(block, check_values=False)
        digest = block_digest(decoded)
        compact, pad_like = compact_block(block, decoded, source.paths[block.file], index.tokens_column,
                                          index.labels_column, pad_token_id)
        if prefix is not None:  # each row against the one before it (the block's first: below, in order)
            bound = None if prefix_column is None else read_prefix_lengths(
                source.paths[block.file], block.row_group, block.first_row, prefix_column, block.rows,
                index.fingerprint(block.file))
            costs = (costs, block_prefixes(compact), bound)
        return compact, pad_like, costs, digest

    # blocks of a store's objects wait on requests, not on the CPU: more of them are read ahead
    ahead = STORE_READ_AHEAD if index.files and is_url(index.files[0].path) else 2
    for b, (decoded, pad_like, costs, digest) in _decode_in_order(decode, index.blocks, block_lo, block_hi, ahead):
        source.digests[b] = digest
        rows = slice(index.block_offsets[b] - gid_lo, index.block_offsets[b + 1] - gid_lo)
        if prefix is not None:
            costs, block_rows, bound = costs
            prefix.add(rows, block_rows, bound)
        lengths[rows] = np.diff(decoded.offsets)
        if extra is not None:
            extra[rows] = costs
        if loss_tokens is not None:  # the first token's label is masked in every pack
            loss_tokens[rows] = decoded.count_targets(decoded.offsets[:-1] + 1, np.maximum(lengths[rows] - 1, 0))
        source.tokens_equal_to_pad_id += pad_like
        source.offer(b, decoded)
        if progress is not None:
            progress(1)
    return dataclasses.replace(index, lengths=lengths, gid_lo=gid_lo, loss_tokens=loss_tokens, extra=extra,
                               prefix_scan=prefix), source


def _decode_in_order(decode, blocks: list[Block], lo: int, hi: int, workers: int = 2):
    """Yield (b, decode(blocks[b])) for b in [lo, hi), in order, decoding up to `workers` blocks ahead."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for b in range(lo, hi):
            pending.append((b, pool.submit(decode, blocks[b])))
            if len(pending) > workers:
                done_b, future = pending.popleft()
                yield done_b, future.result()
        while pending:
            done_b, future = pending.popleft()
            yield done_b, future.result()

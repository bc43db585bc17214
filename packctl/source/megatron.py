"""Megatron's IndexedDataset (`PREFIX.bin` + `PREFIX.idx`) as input: each document one sequence.

Megatron-LM's `preprocess_data.py`, datatrove and NeMo-Curator write tokens as a pair of files:
`PREFIX.bin` holds every token, back to back, in one integer type; `PREFIX.idx` says where the
sequences and documents are. The `.idx` layout (little-endian; version 1, the only one written):

    offset           what                          type
    0                magic b"MMIDIDX\\x00\\x00"     9 bytes
    9                version (1)                   uint64
    17               dtype code of the tokens      uint8: 1 uint8, 2 int8, 3 int16, 4 int32,
                                                          5 int64, 6 float64, 7 float32, 8 uint16
    18               S: sequence count             uint64
    26               D: document index entries     uint64 (documents + 1)
    34               sequence lengths (tokens)     int32[S]
    34 + 4S          sequence pointers (bytes)     int64[S]
    34 + 12S         document index                int64[D]: document d = sequences [doc[d], doc[d+1])
    34 + 12S + 8D    sequence modes (multimodal)   int8[S], only in multimodal datasets

packctl reads **one sequence per document**: the document's sequences, contiguous in `.bin`,
concatenated; loss on every token (no labels). The global sample id of document d of input f is
`file_offsets[f] + d`, inputs sorted by path as Parquet files are, so a Parquet file holding one
row per document in the same order packs to the same bytes:

    .idx  lengths [3, 2, 4]  doc [0, 2, 3]   .bin  5 6 7 | 8 9 | 1 2 3 4
    ->  document 0 = 5 6 7 8 9   document 1 = 1 2 3 4        (sample ids 0 and 1)

Nothing is loaded whole: the `.idx` arrays are read in the ranges a block needs, tokens block by
block, each with positioned reads (`os.preadv` into numpy buffers). Not a memory map: a file
truncated under a map kills the process with SIGBUS, where a short read is an error naming it.

Every open of a pair is checked against the **fingerprint** the run took when it resolved the
input (`PairFingerprint`): both files' sizes and modification times, and a digest of the `.idx`
header and the ends of its arrays. `FILE: changed while packctl was reading it (...)` stops a run
whose input is rewritten under it.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import os
import stat
import struct
from dataclasses import dataclass

import numpy as np

from packctl.arrays import offsets_of
from packctl.contract.schema import INT32_MAX
from packctl.errors import PackctlError
from packctl.source.blocks import DecodedBlock
from packctl.source.files import FileFingerprint, changed_error, file_kind
from packctl.source.index import (Block, InputFile, Resolution, SequenceIndex, bin_of, describe_document,
                                  is_indexed)
from packctl.specs import CarriedColumns


MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
# The dtype codes of megatron-core's `DType`; float ones are refused (tokens are ids).
DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16),
                               4: np.dtype(np.int32), 5: np.dtype(np.int64), 6: np.dtype(np.float64),
                               7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
# A block is a run of documents of about 2^24 tokens (64 MiB decoded as int32, 32 MiB kept as
# uint16), and at most 2^20 documents: as large as a big Parquet row group, so the per-block cost
# (a few reads, a thread hand-off) is nothing beside copying the tokens, and small enough that the
# memory budget, the two blocks decoded ahead and the split between MPI ranks stay fine-grained
# (10B tokens make about 600 blocks).
BLOCK_TOKENS = 1 << 24
BLOCK_DOCUMENTS = 1 << 20
_CHUNK_DOCUMENTS = 1 << 22  # documents whose lengths `document_lengths` reads at once


@dataclass(frozen=True)
class PairFingerprint(FileFingerprint):
    """What a `.bin/.idx` pair was when the run first read it. `size` is both files' bytes,
    `mtime_ns` the later of their modification times and `footer` a digest of the `.idx` header, the
    ends of its arrays (first and last document index, last sequence length and pointer) and both
    sizes and times: the fields every input's fingerprint has, so `--resume` and the manifest treat
    a pair as one input. It cannot see a file rewritten in place with its size, its modification
    time and those ends kept (a changed token, a moved document boundary); `packctl verify OUT
    --source` compares every token."""

    idx_size: int = 0
    bin_size: int = 0
    idx_mtime_ns: int = 0
    bin_mtime_ns: int = 0


@dataclass(frozen=True)
class IndexHeader:
    """The fixed part of an `.idx`: dtype, counts, and where each array starts."""

    dtype: np.dtype
    sequences: int  # S
    document_entries: int  # D: documents + 1
    multimodal: bool

    @property
    def documents(self) -> int:
        return self.document_entries - 1

    @property
    def pointers_at(self) -> int:
        return HEADER_BYTES + 4 * self.sequences

    @property
    def documents_at(self) -> int:
        return HEADER_BYTES + 12 * self.sequences

    @property
    def modes_at(self) -> int:
        return HEADER_BYTES + 12 * self.sequences + 8 * self.document_entries


def _parse_header(idx_path: str, raw: bytes, idx_size: int) -> IndexHeader:
    """The header of an `.idx` of `idx_size` bytes, checked against its size; errors name the file."""
    fix = "write it again (Megatron-LM's preprocess_data.py, megatron-core's IndexedDatasetBuilder)"
    if len(raw) < HEADER_BYTES or raw[:9] != MAGIC:
        what = f"{idx_size} bytes, too small" if idx_size < HEADER_BYTES else "no MMIDIDX magic at its start"
        raise PackctlError(f"{idx_path}: not a Megatron index ({what}); packctl reads the .idx of megatron-core's "
                           f"IndexedDataset: {fix}")
    version, code, sequences, entries = struct.unpack("<QBQQ", raw[9:HEADER_BYTES])
    if version != VERSION:
        raise PackctlError(f"{idx_path}: Megatron index version {version}; packctl reads version {VERSION}, the one "
                           f"megatron-core writes: {fix}")
    if code not in DTYPES:
        raise PackctlError(f"{idx_path}: unknown token dtype code {code} (megatron-core writes 1 to 8); the file may "
                           f"be corrupt: {fix}")
    dtype = DTYPES[code]
    if dtype.kind == "f":
        raise PackctlError(f"{idx_path}: tokens are {dtype.name}; token ids must be integers: tokenize to an "
                           "integer dtype (uint16, int32...)")
    if entries == 0:
        raise PackctlError(f"{idx_path}: an empty document index (it starts with 0 in every index megatron-core "
                           f"writes); the file may be corrupt: {fix}")
    plain = HEADER_BYTES + 12 * sequences + 8 * entries
    if idx_size not in (plain, plain + sequences):
        raise PackctlError(f"{idx_path}: {idx_size} bytes, but its header ({sequences} sequences, {entries - 1} "
                           f"documents) needs {plain} (or {plain + sequences} with sequence modes); the file is "
                           f"truncated or corrupt: {fix}")
    return IndexHeader(dtype=dtype, sequences=int(sequences), document_entries=int(entries),
                       multimodal=idx_size == plain + sequences and sequences > 0)


class IndexedPair:
    """An open `.bin/.idx` pair: positioned reads of the `.idx` arrays and of tokens.

        with open_pair("data/c.idx", fingerprint) as pair:
            pair.document_index(0, 3)   -> int64 [0, 2, 3]
    """

    def __init__(self, idx_path: str, idx_fd: int, bin_fd: int, header: IndexHeader, fingerprint: PairFingerprint):
        self.idx_path = idx_path
        self.bin_path = bin_of(idx_path)
        self._idx = idx_fd
        self._bin = bin_fd
        self.header = header
        self.fingerprint = fingerprint

    def __enter__(self) -> "IndexedPair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in (self._idx, self._bin):
            if fd >= 0:
                os.close(fd)
        self._idx = self._bin = -1

    def _read(self, fd: int, path: str, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise PackctlError(f"{path}: cannot be read ({exc.strerror}); make it readable, or leave it out of "
                                   "INPUT") from None
            if n == 0:
                raise changed_error(path, f"it ends at byte {offset + done}, before the {count} values "
                                          f"read from byte {offset}")
            done += n
        return out

    def sequence_lengths(self, first: int, count: int) -> np.ndarray:
        return self._read(self._idx, self.idx_path, np.dtype("<i4"), count, HEADER_BYTES + 4 * first)

    def sequence_pointers(self, first: int, count: int) -> np.ndarray:
        return self._read(self._idx, self.idx_path, np.dtype("<i8"), count, self.header.pointers_at + 8 * first)

    def document_index(self, first: int, count: int) -> np.ndarray:
        return self._read(self._idx, self.idx_path, np.dtype("<i8"), count, self.header.documents_at + 8 * first)

    def sequence_modes(self, first: int, count: int) -> np.ndarray:
        return self._read(self._idx, self.idx_path, np.dtype("i1"), count, self.header.modes_at + first)

    def tokens(self, first_byte: int, count: int) -> np.ndarray:
        return self._read(self._bin, self.bin_path, self.header.dtype.newbyteorder("<"), count, first_byte)

    def token_start(self, document: int) -> int:
        """The first token of `document` (documents for the end), by its first sequence's pointer:
        the position the contiguous layout gives it (checked block by block as tokens are read)."""
        sequence = int(self.document_index(document, 1)[0])
        if sequence >= self.header.sequences:
            return self.fingerprint.bin_size // self.header.dtype.itemsize
        return int(self.sequence_pointers(sequence, 1)[0]) // self.header.dtype.itemsize


def _open_fd(path: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise PackctlError(f"{path}: no such file") from None
    except OSError as exc:
        raise PackctlError(f"{path}: cannot be read ({exc.strerror}); make it readable, or leave it out of "
                           "INPUT") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PackctlError(f"{path}: not a regular file ({file_kind(st)}); packctl reads Parquet files and Megatron "
                           ".bin/.idx pairs: leave it out of INPUT")
    return fd, st


def open_pair(idx_path: str, expected: PairFingerprint | None = None) -> IndexedPair:
    """Open the pair of `idx_path` and check it: the header against the `.idx` size, the document
    index's ends (0 and S), the first pointer (0) and the `.bin` size against the last pointer.
    With `expected` (the fingerprint taken when the run resolved the input), the pair must still be
    that pair, else `changed while packctl was reading it`."""
    bin_path = bin_of(idx_path)
    fds: list[int] = []
    try:
        try:
            idx_fd, idx_st = _open_fd(idx_path)
            fds.append(idx_fd)
            bin_fd, bin_st = _open_fd(bin_path)
            fds.append(bin_fd)
        except PackctlError:
            if expected is not None and not (os.path.exists(idx_path) and os.path.exists(bin_path)):
                gone = idx_path if not os.path.exists(idx_path) else bin_path
                raise changed_error(gone, "it was removed after the start of the run") from None
            raise
        if expected is not None:
            for path, st, size, mtime in ((idx_path, idx_st, expected.idx_size, expected.idx_mtime_ns),
                                          (bin_path, bin_st, expected.bin_size, expected.bin_mtime_ns)):
                if st.st_size != size:
                    raise changed_error(path, f"its size went from {size} to {st.st_size} bytes since the start "
                                              "of the run")
                if st.st_mtime_ns != mtime:
                    raise changed_error(path, "its modification time differs from the one read at the start of "
                                              "the run")
        raw = os.pread(idx_fd, HEADER_BYTES, 0)
        header = _parse_header(idx_path, raw, idx_st.st_size)
        pair = IndexedPair(idx_path, idx_fd, bin_fd, header,
                           PairFingerprint(size=0, mtime_ns=0, footer="", bin_size=bin_st.st_size))
        ends = _check_ends(pair, bin_st.st_size)
        digest = hashlib.blake2b(raw + ends, digest_size=16)
        digest.update(struct.pack("<4q", idx_st.st_size, bin_st.st_size, idx_st.st_mtime_ns, bin_st.st_mtime_ns))
        pair.fingerprint = PairFingerprint(
            size=idx_st.st_size + bin_st.st_size, mtime_ns=max(idx_st.st_mtime_ns, bin_st.st_mtime_ns),
            footer=digest.hexdigest(), idx_size=idx_st.st_size, bin_size=bin_st.st_size,
            idx_mtime_ns=idx_st.st_mtime_ns, bin_mtime_ns=bin_st.st_mtime_ns)
        if expected is not None and pair.fingerprint != expected:
            raise changed_error(idx_path, "its header or document index differs from the one read at the start of "
                                          "the run")
        fds.clear()
        return pair
    finally:
        for fd in fds:
            os.close(fd)


def _check_ends(pair: IndexedPair, bin_size: int) -> bytes:
    """The ends of the `.idx` arrays, checked: the document index runs from 0 to S, the first
    pointer is 0 and the last sequence ends where the `.bin` does. Returns their bytes (digested)."""
    h, idx = pair.header, pair.idx_path
    first_last = pair.document_index(0, 1)[0], pair.document_index(h.document_entries - 1, 1)[0]
    if first_last[0] != 0 or first_last[1] != h.sequences:
        raise PackctlError(f"{idx}: its document index runs from sequence {first_last[0]} to {first_last[1]}, not "
                           f"from 0 to its {h.sequences} sequences (every sequence in a document); the file may be "
                           "corrupt, or written without end_document() after its last sequence: write it again")
    ends = struct.pack("<2q", *first_last)
    if h.sequences == 0:
        end = 0
    else:
        last_length = int(pair.sequence_lengths(h.sequences - 1, 1)[0])
        first_pointer, last_pointer = (int(pair.sequence_pointers(0, 1)[0]),
                                       int(pair.sequence_pointers(h.sequences - 1, 1)[0]))
        if first_pointer != 0:
            raise PackctlError(f"{idx}: its first sequence starts at byte {first_pointer} of {pair.bin_path}, not 0; "
                               "the file may be corrupt: write it again")
        end = last_pointer + last_length * h.dtype.itemsize
        ends += struct.pack("<3q", last_length, first_pointer, last_pointer)
    if end != bin_size:
        raise PackctlError(f"{pair.bin_path}: {bin_size} bytes, but {idx} says its tokens end at byte {end}; the .bin "
                           "is truncated or is not the one this .idx was written with: write the pair again")
    return ends


@dataclass(frozen=True)
class Documents:
    """The layout of documents [first, first + count) of a pair, read from the `.idx` and checked:
    token offsets of each document (from 0) and where their tokens start in the `.bin`."""

    offsets: np.ndarray  # int64, count + 1
    first_byte: int
    first_sequence: int
    sequences: int


def _documents(pair: IndexedPair, first: int, count: int) -> Documents:
    """Documents [first, first + count): their sequences' lengths and pointers, checked (a non-decreasing
    document index, lengths >= 0, each sequence starting where the one before ends)."""
    h, idx = pair.header, pair.idx_path
    bounds = pair.document_index(first, count + 1)
    bad = (np.diff(bounds) < 0) | (bounds[1:] > h.sequences) | (bounds[:-1] < 0)
    if bad.any():
        d = int(np.argmax(bad))
        raise PackctlError(f"{describe_document(idx, first + d)}: the document index goes from sequence "
                           f"{bounds[d]} to {bounds[d + 1]}; it must not decrease nor pass the {h.sequences} "
                           "sequences: the file is corrupt, write it again")
    s0, s1 = int(bounds[0]), int(bounds[-1])
    lengths = pair.sequence_lengths(s0, s1 - s0).astype(np.int64)
    pointers = pair.sequence_pointers(s0, s1 - s0)
    if s0 == 0:
        start = 0
    else:
        before = int(pair.sequence_pointers(s0 - 1, 1)[0]), int(pair.sequence_lengths(s0 - 1, 1)[0])
        start = before[0] + before[1] * h.dtype.itemsize
    within = offsets_of(lengths)
    if (lengths < 0).any() or not np.array_equal(pointers, start + within[:-1] * h.dtype.itemsize):
        s = int(np.argmax((lengths < 0) | (pointers != start + within[:-1] * h.dtype.itemsize)))
        d = int(np.searchsorted(bounds, s0 + s, side="right") - 1)
        raise PackctlError(f"{describe_document(idx, first + d)}: sequence {s0 + s} has length {lengths[s]} at byte "
                           f"{pointers[s]} of {pair.bin_path}, where the sequences before it end at byte "
                           f"{start + within[s] * h.dtype.itemsize}; packctl reads sequences stored back to back, as "
                           "megatron-core writes them: the file is corrupt, write it again")
    return Documents(offsets=within[bounds - s0], first_byte=start, first_sequence=s0, sequences=s1 - s0)


def decode_documents(idx_path: str, first: int, count: int, *, skip_empty: bool = False,
                     expected: PairFingerprint | None = None) -> DecodedBlock:
    """Documents [first, first + count) of a pair as a `DecodedBlock` (int32 tokens, no labels),
    checked: `checked_documents`, and token ids in [0, 2^31). Errors name 'FILE document D'."""
    with open_pair(idx_path, expected) as pair:
        docs = checked_documents(pair, first, count, skip_empty=skip_empty)
        raw = pair.tokens(docs.first_byte, int(docs.offsets[-1]))
    check_token_range(pair.bin_path, first, docs.offsets, raw)
    return DecodedBlock(offsets=docs.offsets, tokens=raw.astype(np.int32, copy=False), labels=None)


def checked_documents(pair: IndexedPair, first: int, count: int, *, skip_empty: bool = False) -> Documents:
    """Documents [first, first + count) as every read of them checks them, from the `.idx` alone:
    their layout (`_documents`), no empty document unless `skip_empty` (it keeps length 0 and the
    pipeline leaves it out), text sequences only (mode 0 in a multimodal dataset)."""
    idx_path = pair.idx_path
    docs = _documents(pair, first, count)
    lengths = np.diff(docs.offsets)
    if not skip_empty and (lengths == 0).any():
        d = first + int(np.argmax(lengths == 0))
        raise PackctlError(f"{describe_document(idx_path, d)}: empty document (no tokens); remove it or pass "
                           "--skip-empty to leave it out (counted in the manifest)")
    if pair.header.multimodal and docs.sequences:
        modes = pair.sequence_modes(docs.first_sequence, docs.sequences)
        if modes.any():
            s = int(np.argmax(modes != 0))
            d = first + int(np.searchsorted(pair.document_index(first, count + 1), docs.first_sequence + s,
                                            side="right") - 1)
            raise PackctlError(f"{describe_document(idx_path, d)}: sequence {docs.first_sequence + s} has mode "
                               f"{modes[s]} (not text) in this multimodal dataset; packctl packs token sequences: "
                               "write the text documents to a dataset of their own")
    return docs


def scan_lengths(index: SequenceIndex, block_lo: int, block_hi: int, progress=None, *,
                 skip_empty: bool = False) -> SequenceIndex:
    """Scan blocks [block_lo, block_hi) of Megatron inputs for a plan (`pack --plan-only`): the
    documents' lengths and every check of `checked_documents`, from the `.idx` alone, each pair
    checked against its fingerprint; the `.bin` is never read. Its token ids are checked where
    they are read (`packctl materialize`, the loader on the plan, `verify`), with the error
    `decode_documents` gives. `index.loss_tokens`: each document's length - 1 (loss on every
    token but the first of a pack's sequence)."""
    gid_lo, gid_hi = int(index.block_offsets[block_lo]), int(index.block_offsets[block_hi])
    lengths = np.zeros(gid_hi - gid_lo, dtype=np.int64)
    for b in range(block_lo, block_hi):
        block = index.blocks[b]  # each block opens its pair, checked against the fingerprint, as decoding does
        with open_pair(index.files[block.file].path, index.fingerprint(block.file)) as pair:
            docs = checked_documents(pair, block.first_row, block.rows, skip_empty=skip_empty)
        at = int(index.block_offsets[b]) - gid_lo
        lengths[at:at + block.rows] = np.diff(docs.offsets)
        if progress is not None:
            progress(1)
    return dataclasses.replace(index, lengths=lengths, gid_lo=gid_lo, loss_tokens=np.maximum(lengths - 1, 0))


def check_token_range(bin_path: str, first: int, offsets: np.ndarray, raw: np.ndarray) -> None:
    """Every token id in [0, 2^31): else 'FILE.bin document D: token id V at position P ...'."""
    if raw.dtype.itemsize < 4 and raw.dtype.kind == "u" or len(raw) == 0:
        return  # uint8, uint16: always in range
    low = raw.min() < 0 if raw.dtype.kind == "i" else False
    high = raw.dtype.itemsize > 4 and raw.max() > INT32_MAX
    if not (low or high):
        return
    k = int(np.argmax((raw < 0) | (raw > INT32_MAX)))
    d = int(np.searchsorted(offsets, k, side="right") - 1)
    raise PackctlError(f"{describe_document(bin_path, first + d)}: token id {int(raw[k])} at position "
                       f"{k - int(offsets[d])} is outside [0, {INT32_MAX}]; token ids must be vocabulary indices: "
                       "tokenize it again, or remap the ids")


def document_lengths(idx_path: str, expected: PairFingerprint | None = None) -> np.ndarray:
    """The token count of every document, from the `.idx` alone (no token is read), in chunks of
    documents: int64, one per document. lengths [3, 2, 4], doc [0, 2, 3] -> [5, 4]."""
    with open_pair(idx_path, expected) as pair:
        out = np.empty(pair.header.documents, dtype=np.int64)
        for first in range(0, pair.header.documents, _CHUNK_DOCUMENTS):
            count = min(_CHUNK_DOCUMENTS, pair.header.documents - first)
            out[first:first + count] = np.diff(_documents(pair, first, count).offsets)
        return out


def read_document(idx_path: str, document: int, expected: PairFingerprint | None = None) -> np.ndarray:
    """One document's tokens (int64), for messages that show them."""
    with open_pair(idx_path, expected) as pair:
        docs = _documents(pair, document, 1)
        return pair.tokens(docs.first_byte, int(docs.offsets[-1])).astype(np.int64)


def blocks_of(pair: IndexedPair, f: int) -> list[Block]:
    """The blocks of input f: runs of documents cut every BLOCK_TOKENS tokens and every
    BLOCK_DOCUMENTS documents, found by binary search on the `.idx` (a few reads per block, not
    the whole index). 40M tokens in 3 documents of 1M and one of 37M: cuts where a document
    starts at or after token 2^24 and 2^25."""
    documents = pair.header.documents
    total = pair.fingerprint.bin_size // pair.header.dtype.itemsize

    class TokenStarts:  # a lazy, sorted sequence for bisect: token_start of each document
        def __len__(self) -> int:
            return documents + 1

        def __getitem__(self, d: int) -> int:
            return pair.token_start(d)

    starts = TokenStarts()
    cuts = {0, documents}
    cuts.update(range(BLOCK_DOCUMENTS, documents, BLOCK_DOCUMENTS))
    for target in range(BLOCK_TOKENS, total, BLOCK_TOKENS):
        cuts.add(bisect.bisect_left(starts, target, 1, documents))
    bounds = sorted(c for c in cuts if 0 <= c <= documents)
    blocks = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        tokens = max(starts[hi] - starts[lo], 0)
        blocks.append(Block(file=f, row_group=k, first_row=lo, rows=hi - lo, nbytes=4 * tokens + 8 * (hi - lo + 1)))
    return blocks


def index_inputs(resolution: Resolution, tokens_column: str, labels_column: str | None = None) -> SequenceIndex:
    """The SequenceIndex of Megatron inputs: one InputFile per pair (its `.idx` path, documents,
    both files' bytes) and its blocks; no lengths yet (scan reads them)."""
    files, blocks = [], []
    for f, resolved in enumerate(resolution.files):
        with open_pair(resolved.path, resolved.fingerprint) as pair:
            files.append(InputFile(path=resolved.path, rows=pair.header.documents, bytes=pair.fingerprint.size))
            blocks += blocks_of(pair, f)
    index = SequenceIndex.of_files(files, blocks, [r.fingerprint for r in resolution.files],
                                   tokens_column=tokens_column, labels_column=labels_column)
    if index.num_sequences == 0:
        raise PackctlError(f"{', '.join(resolution.specs)}: the input holds no documents")
    return index


def check_options(resolution: Resolution, *, tokens_column: str = "input_ids", labels_column: str | None = None,
                  carried: CarriedColumns = CarriedColumns()) -> None:
    """Refuse, for a Megatron input, the options that need Parquet columns: --tokens-column other
    than input_ids, --labels-column, and every carried column (--keep-columns, --weight-column,
    --group-column, --limit, --prefix-column)."""
    if not any(is_indexed(f.path) for f in resolution.files):
        return
    given = ((["--tokens-column"] if tokens_column != "input_ids" else []) + list(carried.given())
             + (["--labels-column"] if labels_column else []))
    if given:
        flag = given[0]
        raise PackctlError(f"{flag}: names a Parquet column, and {resolution.files[0].path} is a Megatron indexed "
                           "dataset (tokens only, loss on every token); drop the option, or pack Parquet input",
                           everywhere=True)

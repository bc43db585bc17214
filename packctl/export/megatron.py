"""Megatron-LM / megatron-core indexed datasets (`megatron.core.datasets.indexed_dataset`): the
packs as `.bin`/`.idx` pairs that megatron-core's own `IndexedDataset` reads, carrying what
Megatron's packed-sequence path (`PackedSeqParams`, qkv_format "thd") needs: tokens, sequence
boundaries with and without alignment padding, and the loss mask.

Megatron-Bridge's released readers take packed SFT as Parquet or NumPy (`--format nemo`,
`nemo-npy`); none of them reads a packed `.bin/.idx`. So this layout is packctl's, built only from
what megatron-core's IndexedDataset stores (per file: one dtype; sequences of tokens; documents,
each a run of sequences):

    DIR/tokens.bin, tokens.idx          document d = pack d of the output, in output order; its
                                        sequences are the pack's sequences, each with its alignment
                                        padding, the last one also with the pack's tail padding
                                        (packctl's seq_lens_padded). So a document's tokens are
                                        the pack's input_ids, and [0, cumsum(its sequence lengths)]
                                        is its cu_seqlens_padded. dtype: uint16 when every id is
                                        below 65,500, else int32 (Megatron's own rule,
                                        DType.optimal_dtype of the vocabulary size).
    DIR/loss_mask.bin, loss_mask.idx    uint8, the same documents and sequences: loss_mask[j] = 1
                                        when token j + 1 is a target (packctl's labels[j + 1] !=
                                        -100), the convention of Megatron's `labels` (the tokens
                                        shifted left by one) and `loss_mask`; 0 on a pack's last token
    DIR/cu_seqlens.bin, cu_seqlens.idx  int32, document d = one sequence: pack d's cu_seqlens,
                                        [0, cumsum(true lengths)]
    DIR/megatron.json                   what each file is, the dtype, pad id, capacity, alignment,
                                        counts and the source manifest's sha256

Labels are not stored: Megatron derives them from the tokens, so an output whose labels differ
from its tokens where they are supervised is refused.

An IndexedDataset file is written in one pass with bounded memory: tokens go to the `.bin` as each
shard is read, sequence lengths and document ends to side files that become the `.idx` at the end
(the sequence pointers, byte offsets into the `.bin`, are computed from the lengths then).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from packctl.contract.manifest import sha256_file
from packctl.contract.reader import PackedOutput
from packctl.contract.schema import IGNORE_INDEX
from packctl.errors import PackctlError
from packctl.source.megatron import DTYPES, MAGIC

INFO_FILE = "megatron.json"
TOKENS, LOSS_MASK, CU_SEQLENS = "tokens", "loss_mask", "cu_seqlens"
INDEX_HEADER = MAGIC  # megatron-core's _INDEX_HEADER, then version 1 as <Q
DTYPE_CODES = {dtype.name: code for code, dtype in DTYPES.items()}  # the codes the input side reads
UINT16_BELOW = 65_500  # megatron-core's DType.optimal_dtype: uint16 for a cardinality below it, else int32
_CHUNK = 1 << 22  # entries per block when an index or a widened .bin is rewritten


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype megatron-core writes a vocabulary's tokens in (DType.optimal_dtype).

    >>> token_dtype(32000).name, token_dtype(65499).name, token_dtype(65500).name
    ('uint16', 'uint16', 'int32')
    """
    return np.dtype(np.uint16 if vocab_size < UINT16_BELOW else np.int32)


def check_layout(output: PackedOutput, options) -> None:
    """What can be refused from the options and the manifest alone, before anything is written."""
    pad, vocab = int(output.layout["pad_token_id"]), options.vocab_size
    if vocab is not None and pad >= vocab:
        raise PackctlError(f"{output.root}: packed with --pad-token-id {pad}, not below --vocab-size {vocab:,}; "
                           "padding tokens reach the embedding: pack with a --pad-token-id below it (the "
                           "tokenizer's pad id), or pass the tokenizer's vocab_size")


class IndexedWriter:
    """One megatron-core IndexedDataset (`NAME.bin` + `NAME.idx` in `directory`), written in a
    stream: `add` appends documents, `finalize` writes the index.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> w = IndexedWriter(d, "x", np.uint16)
    >>> w.add(np.array([5, 6, 7, 8]), seq_lens=np.array([3, 1]), seqs_per_doc=np.array([2]))
    >>> w.finalize(); sorted(p.name for p in d.iterdir())
    ['x.bin', 'x.idx']
    """

    def __init__(self, directory: Path, name: str, dtype) -> None:
        self.bin_path = directory / f"{name}.bin"
        self.idx_path = directory / f"{name}.idx"
        self._lengths_path = directory / f".{name}.lengths"  # int32 per sequence
        self._ends_path = directory / f".{name}.ends"  # int64 per document: its end in sequences
        self.dtype = np.dtype(dtype)
        self.sequences = 0
        self.documents = 0
        self._bin = open(self.bin_path, "wb")
        self._lengths = open(self._lengths_path, "wb")
        self._ends = open(self._ends_path, "wb")

    def add(self, values: np.ndarray, seq_lens: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Append documents: `values` flat, cut into sequences of `seq_lens`, which make documents
        of `seqs_per_doc` sequences each."""
        self._bin.write(np.ascontiguousarray(values, dtype=self.dtype).data)
        self._lengths.write(np.ascontiguousarray(seq_lens, dtype=np.int32).data)
        ends = self.sequences + np.cumsum(seqs_per_doc, dtype=np.int64)
        self._ends.write(ends.data)
        self.sequences += len(seq_lens)
        self.documents += len(seqs_per_doc)

    def widen(self, dtype) -> None:
        """Rewrite what was written in a wider dtype (an id too large for the current one arrived)."""
        self._bin.close()
        wider = self.bin_path.with_name(self.bin_path.name + ".wider")
        with open(self.bin_path, "rb") as src, open(wider, "wb") as dst:
            while block := src.read(_CHUNK * self.dtype.itemsize):
                dst.write(np.frombuffer(block, dtype=self.dtype).astype(dtype).data)
        os.replace(wider, self.bin_path)
        self.dtype = np.dtype(dtype)
        self._bin = open(self.bin_path, "ab")

    def close(self) -> None:
        """Close the files being written (finalize does; an export that stops early must too)."""
        for fh in (self._bin, self._lengths, self._ends):
            fh.close()

    def finalize(self) -> None:
        """Write `NAME.idx` as megatron-core's _IndexWriter does: header, version, dtype code,
        sequence and document counts, then sequence lengths (int32), sequence pointers (int64 byte
        offsets into the .bin), document indices (int64: 0, then each document's end)."""
        self.close()
        with open(self.idx_path, "wb") as idx:
            idx.write(INDEX_HEADER)
            idx.write(struct.pack("<Q", 1))
            idx.write(struct.pack("<B", DTYPE_CODES[self.dtype.name]))
            idx.write(struct.pack("<Q", self.sequences))
            idx.write(struct.pack("<Q", self.documents + 1))
            with open(self._lengths_path, "rb") as src:
                while block := src.read(_CHUNK * 4):
                    idx.write(block)
            pointer = 0
            with open(self._lengths_path, "rb") as src:
                while block := src.read(_CHUNK * 4):
                    lengths = np.frombuffer(block, dtype=np.int32).astype(np.int64) * self.dtype.itemsize
                    ends = pointer + np.cumsum(lengths)
                    idx.write((ends - lengths).data)
                    pointer = int(ends[-1])
            idx.write(np.zeros(1, dtype=np.int64).data)
            with open(self._ends_path, "rb") as src:
                while block := src.read(_CHUNK * 8):
                    idx.write(block)
        self._lengths_path.unlink()
        self._ends_path.unlink()


def _where(out: Path, shard, pack: int, first_pack: int) -> str:
    return f"{out / shard.name} row {pack} (pack {first_pack + pack} of the output)"


def _shard_arrays(shard, out: Path, first_pack: int, vocab: int | None):
    """One shard's packs as the three datasets store them: (slot lengths, loss mask, cu_seqlens)."""
    ids, labels = shard.input_ids, shard.labels
    bad = (ids < 0) if vocab is None else ((ids < 0) | (ids >= vocab))
    if bad.any():  # a negative id only in a shard read unchecked: pack refuses them
        at = int(np.argmax(bad))
        pack = int(np.searchsorted(shard.token_offsets, at, side="right")) - 1
        why = ("is negative" if vocab is None else
               f"is not in [0, {vocab:,}) (--vocab-size); pass the vocab_size of the tokenizer these ids come from")
        raise PackctlError(f"{_where(out, shard, pack, first_pack)}: token id {int(ids[at])} {why}")
    supervised = labels != IGNORE_INDEX
    differ = supervised & (labels != ids)
    if differ.any():
        pack = int(np.searchsorted(shard.token_offsets, int(np.argmax(differ)), side="right")) - 1
        raise PackctlError(f"{_where(out, shard, pack, first_pack)}: a label differs from its token, and Megatron "
                           "derives labels from the tokens (labels = the next token); such outputs cannot be "
                           "exported to megatron")
    # each sequence's slot: from its offset to the next sequence's (or the pack's end)
    flat_starts = shard.flat_starts()
    slots = np.diff(np.append(flat_starts, len(ids)))
    if len(flat_starts) and not np.array_equal(flat_starts[shard.seq_offsets[:-1]], shard.token_offsets[:-1]):
        raise AssertionError(f"{shard.name}: a pack whose first sequence does not start at 0")
    loss_mask = np.zeros(len(ids), dtype=np.uint8)
    loss_mask[:-1] = supervised[1:]
    loss_mask[shard.token_offsets[1:] - 1] = 0  # a pack's last token predicts nothing of it
    # cu_seqlens: per pack [0, cumsum(seq_lens)]
    per_pack = np.diff(shard.seq_offsets)
    within = np.cumsum(shard.seq_lens) - np.repeat(np.concatenate([[0], np.cumsum(shard.seq_lens)])
                                                   [shard.seq_offsets[:-1]], per_pack)
    cu = np.zeros(len(shard.seq_lens) + shard.num_packs, dtype=np.int32)
    zeros = shard.seq_offsets[:-1] + np.arange(shard.num_packs)
    keep = np.ones(len(cu), dtype=bool)
    keep[zeros] = False
    cu[keep] = within
    return slots, loss_mask, cu


def write(output: PackedOutput, target: Path, options) -> dict:
    """Write the export into `target` (a new, empty directory); returns what was written. The
    refusals that need no shard (`check_layout`) come first, in export/run.py."""
    vocab = options.vocab_size
    dtype = token_dtype(vocab) if vocab is not None else np.dtype(np.uint16)
    writers: list[IndexedWriter] = []
    try:
        for name, kind in ((TOKENS, dtype), (LOSS_MASK, np.uint8), (CU_SEQLENS, np.int32)):
            writers.append(IndexedWriter(target, name, kind))
        return _write_packs(output, target, options, *writers)
    finally:  # a refused pack, a full disk: no file left open (finalize has closed them otherwise)
        for writer in writers:
            writer.close()


def _write_packs(output: PackedOutput, target: Path, options, tokens: IndexedWriter, loss_mask: IndexedWriter,
                 cu_seqlens: IndexedWriter) -> dict:
    from packctl.export import read_packs

    out, layout = output.root, output.layout
    vocab = options.vocab_size
    packs = sequences = true_tokens = all_tokens = loss_tokens = 0
    largest = -1
    for shard in read_packs(output):
        slots, mask, cu = _shard_arrays(shard, out, packs, vocab)
        if len(shard.input_ids):
            largest = max(largest, int(shard.input_ids.max()))
        if vocab is None and tokens.dtype == np.uint16 and largest + 1 >= UINT16_BELOW:
            tokens.widen(np.int32)  # the vocabulary from the data: an id of 65,499 or more arrived
        per_pack = np.diff(shard.seq_offsets)
        tokens.add(shard.input_ids, slots, per_pack)
        loss_mask.add(mask, slots, per_pack)
        cu_seqlens.add(cu, per_pack + 1, np.ones(shard.num_packs, dtype=np.int64))
        packs += shard.num_packs
        sequences += len(shard.seq_lens)
        true_tokens += int(shard.seq_lens.sum())
        all_tokens += len(shard.input_ids)
        loss_tokens += int(mask.sum())
    for writer in (tokens, loss_mask, cu_seqlens):
        writer.finalize()
    files = [f"{name}.{ext}" for name in (TOKENS, LOSS_MASK, CU_SEQLENS) for ext in ("bin", "idx")]
    info = {
        "format": "packctl megatron indexed datasets",
        "version": 1,
        "datasets": {
            TOKENS: {"prefix": TOKENS, "dtype": tokens.dtype.name, "documents": "packs",
                     "sequences": "the packs' sequences with their alignment padding (the last with the tail)"},
            LOSS_MASK: {"prefix": LOSS_MASK, "dtype": "uint8", "documents": "packs",
                        "sequences": "as tokens; loss_mask[j] = 1 when token j + 1 is a target"},
            CU_SEQLENS: {"prefix": CU_SEQLENS, "dtype": "int32", "documents": "packs",
                         "sequences": "one per pack: [0, cumsum(true sequence lengths)]"},
        },
        "token_dtype": tokens.dtype.name,
        "vocab_size": vocab,
        "largest_token_id": largest,
        "pad_token_id": int(layout["pad_token_id"]),
        "capacity": int(layout["capacity"]),
        "pad_to": layout.get("pad_to"),
        "align": int(layout.get("align", 1)),
        "packs": packs,
        "sequences": sequences,
        "tokens": all_tokens,
        "sequence_tokens": true_tokens,
        "padding_tokens": all_tokens - true_tokens,
        "loss_tokens": loss_tokens,
        "source": {"output": output.location, "manifest": output.manifest_file.name,
                   "manifest_sha256": sha256_file(output.manifest_file)},
    }
    info.update(_loader(output))
    (target / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return {"format": "megatron", "output": str(target), "files": files, "info": INFO_FILE, "packs": packs,
            "sequences": sequences, "token_dtype": tokens.dtype.name}


def _loader(output: PackedOutput) -> dict:
    """With `--dp-size`: packs are in (step, micro_batch, dp_rank) order (docs/format.md: row j of a
    full step is data-parallel rank j % dp_size, micro-batch j // dp_size)."""
    config = output.manifest.get("config") or {}
    dp, micro = config.get("dp_size"), config.get("micro_batches")
    if not isinstance(dp, int) or not isinstance(micro, int):
        return {}
    return {"data_loader": {"shuffle": False, "dp_world_size": dp, "micro_batches": micro,
                            "packs_per_step": dp * micro}}

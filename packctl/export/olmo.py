"""OLMo-core numpy token files (olmo_core.data: NumpyFSLDataset, NumpyPackedFSLDataset and the
composable NumpyDocumentSource).

Their convention, from OLMo-core's data/utils.py, numpy_dataset.py and composable sources:

- a token file is a raw memory map of token ids (no header, despite the `.npy` suffix) in the
  smallest unsigned dtype that holds the tokenizer's largest id (`vocab_size - 1`): uint8 up to 256
  ids, uint16 up to 65,536, else uint32; a reader without an explicit dtype infers it so;
- a fixed-length dataset cuts each file into instances of `sequence_length` tokens;
- documents are found three ways, which must agree: in an instance (`get_document_lengths`, for
  intra-document masking), in a file by scanning its tokens (`iter_document_indices`, the default
  for local files) or from `<file>.csv.gz` ("start,end" lines, always for s3:// and gs:// paths,
  or with `use_array_if_local=False`), whose documents must be consecutive and cover the file.
  Without a BOS id a document ends after every EOS; with one (`tokenizer.bos_token_id`) only at an
  EOS followed by the BOS id, and at the end of the file or instance;
- a label mask file is a raw np.bool_ memory map aligned with its token file: True where the token
  is a target (labels are the tokens shifted inside the model; a False target is ignored).

So a packctl pack of `--capacity` tokens is an instance (written in output order), each sequence a
document (ending with the EOS id, starting with the BOS id when one is given, and holding no
boundary inside), the label mask `labels != -100`, and the tail padding after a pack's last
sequence becomes a document of its own, never a target: the pad id closed by EOS

    no BOS id:   [pad ... pad EOS]          (1 token or more: a lone EOS)
    BOS id:      [BOS pad ... pad EOS]      (2 tokens or more; with BOS == EOS a lone EOS too)

which costs no token (the tail was padding already; 1 or 2 of its tokens change id). With BOS ==
EOS a tail of 2, [EOS EOS], is two documents of 1 token (olmo.json counts documents as the readers
find them). A tail of exactly 1 token is a document only without the BOS id (a BOS document needs
[BOS EOS]): see `reader_bos` for what the export then tells readers, or refuses.

    DIR/part-00000.npy               tokens of shard 0's packs, pack after pack
    DIR/part-00000.csv.gz            "start,end" of every document in that file, padding included
    DIR/label_mask/part-00000.npy    np.bool_, aligned with the tokens
    DIR/olmo.json                    what a reader must be configured with (see `write`)
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from packctl.arrays import ranges
from packctl.contract.reader import PackedOutput
from packctl.contract.schema import IGNORE_INDEX
from packctl.errors import PackctlError

DTYPES = (np.uint8, np.uint16, np.uint32)


def token_dtype(vocab_size: int) -> type:
    """The dtype OLMo-core reads a vocabulary's token files in: the smallest unsigned type holding
    the largest id, vocab_size - 1 (NumpyDatasetConfig.get_dtype).

    >>> token_dtype(32002).__name__, token_dtype(65536).__name__, token_dtype(65537).__name__
    ('uint16', 'uint16', 'uint32')
    """
    return next(d for d in DTYPES if vocab_size - 1 <= np.iinfo(d).max)


def check_layout(output: PackedOutput, options) -> None:
    """What can be refused from the options and the manifest alone, before anything is written."""
    out, layout = output.root, output.layout
    eos, bos, vocab = options.eos_token_id, options.bos_token_id, options.vocab_size
    if eos is None:
        raise PackctlError("--format olmo needs --eos-token-id: OLMo-core finds document boundaries by the EOS id")
    if vocab is None:
        raise PackctlError("--format olmo needs --vocab-size: OLMo-core reads token files in the dtype of the "
                           "tokenizer's vocabulary (uint16 up to 65,536 ids, else uint32); pass the tokenizer's "
                           "vocab_size")
    pad = int(layout["pad_token_id"])
    for flag, value in (("--eos-token-id", eos), ("--bos-token-id", bos), ("the output's --pad-token-id", pad)):
        if value is not None and value >= vocab:
            raise PackctlError(f"{flag} {value}: not below --vocab-size {vocab:,}; pass the tokenizer's ids and "
                               "vocab_size" + (" (or pack with a --pad-token-id below it)" if "pad" in flag else ""))
    if pad == eos or (bos is not None and pad == bos):
        raise PackctlError(f"{out}: packed with --pad-token-id {pad}, the {'EOS' if pad == eos else 'BOS'} id; the "
                           "padding documents of the export need a pad id of their own: pack with another "
                           "--pad-token-id (the tokenizer's pad id)")
    if layout.get("pad_to") != "capacity":
        raise PackctlError(f"{out}: packs of varying length (--pad-to {layout.get('pad_to')}); OLMo-core cuts token "
                           "files into instances of one sequence_length: pack with --pad-to capacity")
    if int(layout.get("align", 1)) != 1:
        raise PackctlError(f"{out}: sequences padded to a multiple of {layout['align']} (--cp-size/--tp-size/"
                           "--seq-multiple); OLMo-core would join that padding to the next document: pack without "
                           "alignment for OLMo-core (its context parallelism splits instances itself)")


class _Shard:
    """One shard's packs as OLMo-core will see them: where each pack, sequence and tail is."""

    def __init__(self, shard, capacity: int, first_pack: int, out: Path):
        self.shard, self.capacity, self.first_pack, self.out = shard, capacity, first_pack, out
        self.starts = shard.flat_starts()
        self.ends = self.starts + shard.seq_lens
        self.pack_of = np.repeat(np.arange(shard.num_packs), np.diff(shard.seq_offsets))
        # tail of pack r: [tail_start[r], token_offsets[r + 1]); contiguous sequences (align 1)
        self.tail_start = shard.token_offsets[:-1].copy()
        last = shard.seq_offsets[1:] - 1
        has = np.diff(shard.seq_offsets) > 0
        self.tail_start[has] = self.ends[last[has]]
        self.tail = shard.token_offsets[1:] - self.tail_start

    def where(self, seq: int | None = None, pack: int | None = None) -> str:
        """'OUT/shard-00000.parquet row 3 (pack 3 of the output), sequence 2 of the pack'."""
        if pack is None:
            pack = int(self.pack_of[seq])
        text = f"{self.out / self.shard.name} row {pack} (pack {self.first_pack + pack} of the output)"
        if seq is not None:
            text += f", sequence {seq - int(self.shard.seq_offsets[pack])} of the pack"
        return text


def _check(s: _Shard, eos: int, bos: int | None, vocab: int) -> None:
    """Refuse what OLMo-core would read otherwise than packctl's sequences, naming the first pack
    (a reader configured with `bos`; `reader_bos` decides between the two settings after)."""
    shard = s.shard
    ids = shard.input_ids
    inside = np.zeros(len(ids), dtype=bool)
    inside[ranges(s.starts, shard.seq_lens)] = True
    over = inside & ((ids < 0) | (ids >= vocab))
    if over.any():
        seq = int(np.searchsorted(s.ends, int(np.argmax(over)), side="right"))
        raise PackctlError(f"{s.where(seq)}: token id {int(ids[np.argmax(over)])} is not below --vocab-size "
                           f"{vocab:,}; pass the vocab_size of the tokenizer these ids come from")
    last_is_eos = ids[s.ends - 1] == eos
    if not last_is_eos.all():
        seq = int(np.argmin(last_is_eos))
        raise PackctlError(f"{s.where(seq)}: does not end with the EOS id {eos}; OLMo-core finds documents by "
                           "their EOS, so every sequence must end with it: tokenize with EOS and pack with "
                           "--too-long drop (a sequence cut by --too-long loses its EOS)")
    if bos is not None:
        first_is_bos = ids[s.starts] == bos
        if not first_is_bos.all():
            seq = int(np.argmin(first_is_bos))
            raise PackctlError(f"{s.where(seq)}: does not start with the BOS id {bos}; with --bos-token-id OLMo-core "
                               "finds documents at an EOS followed by the BOS, so every sequence must start with it: "
                               "tokenize with BOS, or export without --bos-token-id for data without BOS")
    # a boundary OLMo-core would find inside a sequence (before its last token)
    body = np.zeros(len(ids), dtype=bool)
    body[ranges(s.starts, shard.seq_lens - 1)] = True
    if bos is None:
        split = body & (ids == eos)
        rule = f"the EOS id {eos} inside the sequence; OLMo-core would start a new document after it"
    else:
        split = np.zeros(len(ids), dtype=bool)
        split[:-1] = body[:-1] & (ids[:-1] == eos) & (ids[1:] == bos)
        rule = (f"the EOS id {eos} followed by the BOS id {bos} inside the sequence; OLMo-core would start a new "
                "document there")
    if split.any():
        position = int(np.argmax(split))
        seq = int(np.searchsorted(s.ends, position, side="right"))
        raise PackctlError(f"{s.where(seq)}: token {position - int(s.starts[seq])} is {rule} (attention would then "
                           "differ from packctl's sequences)")
    supervised = shard.labels != IGNORE_INDEX
    if (supervised & (shard.labels != ids)).any():
        raise PackctlError(f"{s.out / shard.name}: a label differs from its token, and OLMo-core derives labels from "
                           "the tokens; such outputs cannot be exported to olmo")


def _eos_inside(s: _Shard, eos: int) -> int | None:
    """The first sequence holding the EOS id before its last token, or None."""
    body = np.zeros(len(s.shard.input_ids), dtype=bool)
    body[ranges(s.starts, s.shard.seq_lens - 1)] = True
    hit = body & (s.shard.input_ids == eos)
    return int(np.searchsorted(s.ends, int(np.argmax(hit)), side="right")) if hit.any() else None


def reader_bos(shards: list[_Shard], eos: int, bos: int | None) -> int | None:
    """The bos_token_id a reader must be configured with, or a refusal.

    With a BOS id, documents end at an EOS followed by the BOS, so a padding document needs 2
    tokens, [BOS EOS], unless BOS == EOS. A pack with exactly 1 token of padding therefore cannot be
    read with the BOS id; it can be read without (documents end after every EOS) when no sequence
    holds the EOS id before its end, and then the reader is told bos_token_id null.
    """
    if bos is None or bos == eos:
        return bos
    short = next(((s, int(np.argmax(s.tail == 1))) for s in shards if (s.tail == 1).any()), None)
    if short is None:
        return bos
    inside = next(((s, k) for s in shards if (k := _eos_inside(s, eos)) is not None), None)
    if inside is None:
        return None
    s, pack = short
    t, seq = inside
    raise PackctlError(f"{s.where(pack=pack)}: 1 token of padding after the last sequence, which is a document of its "
                       f"own only without the BOS id, and {t.where(seq)} holds the EOS id {eos} before its end, which "
                       "needs the BOS id: no reader setting finds packctl's sequences; pack again with another "
                       "--capacity or --algorithm so that no pack ends with exactly 1 token of padding")


def document_ends(tokens: np.ndarray, eos: int, bos: int | None) -> np.ndarray:
    """Where OLMo-core's scan of a token file ends its documents (exclusive ends, ascending; the
    file's end always one): after every EOS, or with a BOS id after an EOS followed by the BOS and
    after a final EOS.

    >>> document_ends(np.array([7, 2, 5, 2, 0, 2]), eos=2, bos=None).tolist()
    [2, 4, 6]
    >>> document_ends(np.array([1, 7, 2, 1, 0, 2]), eos=2, bos=1).tolist()
    [3, 6]
    """
    if bos is None:
        ends = np.flatnonzero(tokens == eos) + 1
    else:
        ends = np.flatnonzero((tokens[:-1] == eos) & (tokens[1:] == bos)) + 1
    if len(tokens) and (len(ends) == 0 or ends[-1] != len(tokens)):
        ends = np.append(ends, len(tokens))
    return ends.astype(np.int64)


def _file_tokens(s: _Shard, eos: int, bos: int | None, pad: int) -> np.ndarray:
    """The shard's flat tokens with each pack's tail padding made a document: [BOS] pad ... EOS."""
    tokens = s.shard.input_ids.copy()
    lens = s.tail
    a = s.tail_start[lens > 0]
    b = a + lens[lens > 0]
    tokens[ranges(a, b - a)] = pad
    if bos is not None:
        tokens[a] = bos  # a lone token is set to EOS next: [EOS], a document of its own (see reader_bos)
    tokens[b - 1] = eos
    return tokens


def write(output: PackedOutput, target: Path, options) -> dict:
    """Write the export into `target` (a new, empty directory); returns what was written.

    olmo.json holds what a reader must be configured with: `tokenizer` (TokenizerConfig's
    vocab_size, eos_token_id, pad_token_id, bos_token_id: null when the sequences have no BOS, or
    when a pack ends with 1 token of padding and EOS alone delimits the sequences, see
    `reader_bos`), beside `bos_token_id`, the BOS id every sequence starts with (checked),
    `token_dtype`, `sequence_length`, the token, label-mask and index files in order, and the
    counts: `instances` (packs), `sequences`, `padding_documents`, `documents` (their sum: what
    each of OLMo-core's document views finds), `padding_tokens`.
    """
    from packctl.export import read_packs

    check_layout(output, options)
    out, layout = output.root, output.layout
    eos, bos, vocab = options.eos_token_id, options.bos_token_id, options.vocab_size
    capacity, pad = int(layout["capacity"]), int(layout["pad_token_id"])
    dtype = token_dtype(vocab)
    shards, packs = [], 0
    for shard in read_packs(output):
        shards.append(_Shard(shard, capacity, packs, out))
        _check(shards[-1], eos, bos, vocab)
        packs += shard.num_packs
    read_with = reader_bos(shards, eos, bos)
    (target / "label_mask").mkdir()
    files, sequences, documents, padding_tokens = [], 0, 0, 0
    for k, s in enumerate(shards):
        shard = s.shard
        tokens = _file_tokens(s, eos, bos, pad)
        ends = document_ends(tokens, eos, read_with)
        # every sequence a document of its own; the tails covered by padding documents only
        seq_docs = np.searchsorted(ends, s.ends)
        if not (np.array_equal(ends[seq_docs], s.ends)
                and np.array_equal(np.concatenate([[0], ends[:-1]])[seq_docs], s.starts)):
            raise AssertionError(f"{shard.name}: the documents of the export differ from the sequences")
        label_mask = shard.labels != IGNORE_INDEX
        label_mask[ranges(s.tail_start, s.tail)] = False
        name = f"part-{k:05d}.npy"
        tokens.astype(dtype).tofile(target / name)
        label_mask.astype(np.bool_).tofile(target / "label_mask" / name)
        starts = np.concatenate([[0], ends[:-1]])
        with gzip.open(target / name.replace(".npy", ".csv.gz"), "wt") as fh:
            fh.write("".join(f"{a},{b}\n" for a, b in zip(starts.tolist(), ends.tolist())))
        files.append(name)
        sequences += len(s.starts)
        documents += len(ends)
        padding_tokens += int(s.tail.sum())
    info = {
        "sequence_length": capacity,
        "token_dtype": np.dtype(dtype).name,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "bos_token_id": bos,
        "pad_token_id": pad,
        "tokenizer": {"vocab_size": vocab, "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": read_with},
        "generate_doc_lengths": True,
        "files": files,
        "label_mask_files": [f"label_mask/{f}" for f in files],
        "document_index_files": [f.replace(".npy", ".csv.gz") for f in files],
        "instances": packs,
        "sequences": sequences,
        "padding_documents": documents - sequences,
        "documents": documents,
        "padding_tokens": padding_tokens,
    }
    info.update(_loader(output, capacity))
    (target / "olmo.json").write_text(json.dumps(info, indent=2) + "\n")
    return {"format": "olmo", "output": str(target), "files": files, "packs": packs, "sequences": sequences,
            "documents": documents, "padding_documents": documents - sequences, "sequence_length": capacity,
            "token_dtype": info["token_dtype"], "tokenizer": info["tokenizer"]}


def _loader(output: PackedOutput, capacity: int) -> dict:
    """The data-loader settings that keep a `--dp-size` plan: packs are written in (step,
    micro_batch, dp_rank) order, and OLMo-core's loader gives rank r positions r, r + dp, ... of
    each global batch, so a global batch of dp x micro-batches packs is one step of the plan."""
    config = output.manifest.get("config") or {}
    dp, micro = config.get("dp_size"), config.get("micro_batches")
    if not isinstance(dp, int) or not isinstance(micro, int):
        return {}
    return {"data_loader": {"shuffle": False, "dp_world_size": dp, "micro_batches": micro,
                            "global_batch_size": dp * micro * capacity}}

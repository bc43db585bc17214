"""Raw text and chat records, tokenized as they are read (`pack --tokenizer DIR`): the files
`packctl tokenize` reads (JSONL, `.jsonl.gz`/`.zst`, a JSON array, Parquet, `.txt`), each record
one row, its tokens and labels those `packctl tokenize` writes for it (`tokenize/encode.py`):

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    -> input_ids [<|im_start|> user \\n Hi <|im_end|> ... Hello <|im_end|> \\n]
       labels    [-100 ...                             ... Hello <|im_end|> -100]

The kind claims those names only when `InputOptions.tokenizer` is set; without it a `.jsonl` is
JSONL of token ids and a `.parquet` tokenized Parquet. Indexing reads each file once
(`tokenize/rawfiles.py index_file`): its records, a sha256 of its bytes, and the byte offset of
every `BLOCK_RECORDS`-th record of an uncompressed line format, so a block (a run of records) is
read alone; a compressed file, a JSON array or a Parquet file is one block. Decoding a block
tokenizes its records again: the block digests of scan check that it gives the same tokens.

The fingerprint is the file's size and modification time with a digest of its sha256, the
tokenizer (`LocalTokenizer.describe`) and the tokenization options: a file or a tokenizer changed
between a plan and its materialize, or between a run and its `--resume`, is refused.

Preference records (chosen and rejected: two rows a record) are refused: `packctl tokenize` writes
them, with the record id that keeps both rows in one pack.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading

import numpy as np

from packctl.errors import PackctlError
from packctl.source.blocks import DecodedBlock
from packctl.source.files import FileFingerprint, changed_error, stat_unchanged
from packctl.source.index import Block, InputFile, Resolution, SequenceIndex
from packctl.source.kinds import InputOptions, OneFile
from packctl.specs import CarriedColumns
from packctl.tokenize import rawfiles
from packctl.contract.schema import INPUT_IDS as TOKENS, LABELS  # the columns `packctl tokenize` writes, as the index names them

BLOCK_RECORDS = 1024  # records a block: what one decode tokenizes (tokenize's row groups are as long)

_lock = threading.Lock()
_files: dict[tuple, rawfiles.RawFile] = {}  # (path, size, mtime_ns, inode, block records) -> the file as indexed
_tokenizers: dict[tuple, object] = {}  # the directory and its files' sizes and times -> LocalTokenizer


def _indexed(path: str, expected: FileFingerprint | None = None) -> rawfiles.RawFile:
    """The file counted and hashed (`rawfiles.index_file`), once a process while its size,
    modification time and inode stay the same."""
    st = stat_unchanged(path, expected)
    key = (path, st.st_size, st.st_mtime_ns, st.st_ino, BLOCK_RECORDS)
    with _lock:
        found = _files.get(key)
    if found is None:
        found = rawfiles.index_file(path, stride=BLOCK_RECORDS)
        with _lock:
            _files[key] = found
    return found


def tokenizer_of(options: InputOptions):
    """The `LocalTokenizer` of `options.tokenizer`, loaded once a process while the directory's
    files keep their sizes and modification times (a tokenizer edited or moved is loaded again)."""
    from packctl.tokenize.tokenizer import LocalTokenizer  # here: transformers' template code is slow to import

    try:
        with os.scandir(options.tokenizer) as entries:
            files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
    except OSError:
        files = []  # LocalTokenizer.load names what is wrong with the directory
    key = (options.tokenizer, tuple(files))
    with _lock:
        found = _tokenizers.get(key)
    if found is None:
        found = LocalTokenizer.load(options.tokenizer)
        with _lock:
            _tokenizers[key] = found
    return found


def tokenize_config(options: InputOptions, paths: list[str]):
    """`packctl tokenize`'s options for these files: the one place the spec is built from
    (`tokenize/options.py build_spec`)."""
    from packctl.tokenize.options import TokenizeConfig

    return TokenizeConfig(inputs=list(paths), output="", tokenizer=options.tokenizer, format=options.format,
                          loss_on=options.loss_on, columns=options.columns, add_bos=options.add_bos,
                          add_eos=options.add_eos)


def spec_of(options: InputOptions, files: list[rawfiles.RawFile]):
    """The `TokenizeSpec` of a run over `files` (their format detected under --format auto);
    preference records refused in one line."""
    from packctl.tokenize.options import build_spec, is_preference

    spec = build_spec(tokenize_config(options, [f.path for f in files]), files)
    if is_preference(spec):
        first = next((f.path for f in files if f.records), files[0].path if files else "INPUT")
        raise PackctlError(f"{first}: preference records (chosen and rejected) become two rows a record, which pack "
                           "--tokenizer does not write; tokenize them first: packctl tokenize INPUT -o TOKENIZED "
                           "--tokenizer DIR, then pack TOKENIZED --group-column record_id")
    return spec


def tokenization(options: InputOptions, paths: list[str]) -> dict:
    """What the manifest records of how the tokens were made, as for a tokenized input
    (`source/tokenized.py`): the tokenizer and the resolved tokenization options."""
    files = [_indexed(p) for p in paths]
    spec = spec_of(options, files)
    return {"source": "pack --tokenizer", "tokenizer": tokenizer_of(options).describe(), "tokenize": spec.describe()}


def _footer(raw: rawfiles.RawFile, options: InputOptions | None) -> str:
    """A digest of the file's sha256, the tokenizer and the tokenization options."""
    made = {}
    if options is not None and options.tokenizer is not None:
        made = {"tokenizer": tokenizer_of(options).describe(), "format": options.format, "loss_on": options.loss_on,
                "columns": dataclasses.asdict(options.columns), "add_bos": options.add_bos, "add_eos": options.add_eos}
    text = json.dumps({"sha256": raw.sha256, **made}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _blocks(raw: rawfiles.RawFile, f: int) -> list[Block]:
    """Runs of `BLOCK_RECORDS` records, each found at the byte offset indexing kept; a file without
    offsets (compressed, a JSON array, Parquet) is one block. 2500 records -> blocks of 1024, 1024, 452."""
    if not raw.records:
        return []
    if not (raw.stride and raw.starts):
        return [Block(file=f, row_group=0, first_row=0, rows=raw.records, nbytes=raw.size)]
    offsets = [start for start, _ in raw.starts] + [raw.size]
    return [Block(file=f, row_group=k, first_row=k * raw.stride, rows=min(raw.stride, raw.records - k * raw.stride),
                  nbytes=offsets[k + 1] - offsets[k], start=offsets[k]) for k in range(len(raw.starts))]


class RawKind(OneFile):
    name = "raw records"
    footer_name = "bytes and tokenizer"  # what the fingerprint's digest is of, in messages
    changed_what = "its bytes, the tokenizer or the tokenization options differ from those the plan read"

    def claims(self, name: str, options: InputOptions | None = None) -> bool:
        return options is not None and options.tokenizer is not None and rawfiles.kind_of(name) is not None

    def read_file(self, path: str, f: int, expected: FileFingerprint | None = None, *,
                  options: InputOptions | None = None) -> tuple[FileFingerprint, list[Block], int]:
        raw = _indexed(path, expected)
        fingerprint = FileFingerprint(size=raw.size, mtime_ns=raw.mtime_ns, footer=_footer(raw, options))
        if expected is not None and fingerprint.footer != expected.footer:
            raise changed_error(path, "its bytes or the tokenizer differ from those read at the start of the run")
        return fingerprint, _blocks(raw, f), raw.records

    def index(self, resolution: Resolution, options: InputOptions, carried: CarriedColumns = CarriedColumns()
              ) -> SequenceIndex:
        raws = [_indexed(r.path, r.fingerprint) for r in resolution.files]
        spec_of(options, raws)  # the format every file names, checked before a record is tokenized
        files = [InputFile(path=r.path, rows=raw.records, bytes=raw.size) for r, raw in zip(resolution.files, raws)]
        blocks = [block for f, raw in enumerate(raws) for block in _blocks(raw, f)]
        index = SequenceIndex.of_files(files, blocks, [r.fingerprint for r in resolution.files],
                                       tokens_column=TOKENS, labels_column=LABELS)
        if index.num_sequences == 0:
            raise PackctlError(f"{', '.join(resolution.specs)}: the input holds no record")
        return index

    def decode(self, path: str, block: Block, options: InputOptions, *, skip_empty: bool = False,
               check_values: bool = True, expected: FileFingerprint | None = None) -> DecodedBlock:
        from packctl.tokenize.encode import RowError, tokenize_records

        raw = _indexed(path, expected)
        first, count = (0, raw.records) if block.row_group is None else (block.first_row, block.rows)
        records = rawfiles.read_records(raw, first, count)
        try:
            batch = tokenize_records([r.fields for r in records], spec_of(options, [raw]), tokenizer_of(options))
        except RowError as exc:
            where = records[exc.record]
            raise PackctlError(f"{raw.describe(where.row, where.line)} field '{exc.field}': {exc.reason}; fix the row, "
                               "or tokenize with packctl tokenize --on-bad-row drop and pack its output") from None
        offsets = batch.offsets.astype(np.int64)
        lengths = np.diff(offsets)
        if not skip_empty and (lengths == 0).any():
            where = records[int(np.argmax(lengths == 0))]
            raise PackctlError(f"{raw.describe(where.row, where.line)}: no token; remove empty records or pass "
                               "--skip-empty to leave them out (counted in the manifest)")
        return DecodedBlock(offsets=offsets, tokens=batch.input_ids.astype(np.int32, copy=False),
                            labels=batch.labels.astype(np.int32, copy=False))

    def scan_lengths(self, index, lo, hi, progress=None, *, skip_empty=False):
        return None  # a record's length is known by tokenizing it

    def describe(self, path: str, row: int, column: str | None = None) -> str:
        return f"{path} row {row}"  # a record has fields, not the token columns

    def check_options(self, resolution, *, tokens_column: str = TOKENS, labels_column: str | None = None,
                      carried: CarriedColumns = CarriedColumns()) -> None:
        given = list(carried.given()) + (["--labels-column"] if labels_column else [])
        if given or tokens_column != TOKENS:
            flag = given[0] if given else "--tokens-column"
            raise PackctlError(f"{flag}: not read from raw records ({resolution.files[0].path}): pack --tokenizer "
                               "makes the tokens and labels itself; drop the option, or tokenize first with packctl "
                               "tokenize (which carries --group-column and --keep-column) and pack its output",
                               everywhere=True)


RAW = RawKind()

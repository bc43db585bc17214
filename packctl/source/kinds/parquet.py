"""Parquet input: a list column of token ids (and optionally one of labels), one row a sequence,
one row group a block. The reader is `packctl.source.parquet`."""
from __future__ import annotations

from packctl.source import parquet as reader
from packctl.source.blocks import DecodedBlock
from packctl.source.files import FileFingerprint, open_parquet, read_fingerprint
from packctl.source.index import Block, Resolution, SequenceIndex
from packctl.source.kinds import InputOptions, OneFile
from packctl.specs import CarriedColumns


class ParquetKind(OneFile):
    name = "Parquet"
    footer_name = "Parquet footer"  # what the fingerprint's digest is of, in messages
    changed_what = "its Parquet footer differs from the one the plan read"

    def claims(self, name: str, options: InputOptions | None = None) -> bool:
        return name.endswith(".parquet")

    def read_file(self, path: str, f: int, expected: FileFingerprint | None = None, *,
                  options: InputOptions | None = None) -> tuple[FileFingerprint, list[Block], int]:
        if expected is not None:
            meta = open_parquet(path, expected).metadata
            blocks, rows = reader.blocks_of(meta, f)
            return expected, blocks, rows
        fingerprint, meta, _ = read_fingerprint(path)
        blocks, rows = reader.blocks_of(meta, f)
        return fingerprint, blocks, rows

    def index(self, resolution: Resolution, options: InputOptions, carried: CarriedColumns = CarriedColumns()
              ) -> SequenceIndex:
        return reader.index_parquet(resolution, options.tokens_column, options.labels_column, carried)

    def decode(self, path: str, block: Block, options: InputOptions, *, skip_empty: bool = False,
               check_values: bool = True, expected: FileFingerprint | None = None) -> DecodedBlock:
        return reader.decode_block(path, block.row_group, block.first_row, options.tokens_column,
                                   options.labels_column, skip_empty=skip_empty, check_values=check_values,
                                   expected=expected)

    def scan_lengths(self, index, lo, hi, progress=None, *, skip_empty=False):
        return None  # lengths of a list column need its pages decoded: scan decodes the blocks

    def describe(self, path: str, row: int, column: str | None = None) -> str:
        where = f"{path} row {row}"
        return f"{where} column '{column}'" if column is not None else where

    def check_options(self, resolution, **options) -> None:
        return None  # every column option is read from the Parquet columns


PARQUET = ParquetKind()

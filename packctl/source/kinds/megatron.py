"""Megatron indexed datasets: a `.bin` of token ids and its `.idx`, named by the `.idx`; one
document a sequence, labels are the tokens. The reader is `packctl.source.megatron`; lengths come
from the `.idx` alone."""
from __future__ import annotations

from packctl.source import megatron as reader
from packctl.source.blocks import DecodedBlock
from packctl.source.files import FileFingerprint
from packctl.source.index import BIN, IDX, Block, Resolution, SequenceIndex, bin_of, describe_document
from packctl.source.kinds import InputOptions
from packctl.specs import CarriedColumns
from packctl.contract.schema import INPUT_IDS


class MegatronKind:
    name = "Megatron"
    footer_name = ".idx header and ends"  # what the fingerprint's digest is of, in messages
    changed_what = "its .idx header, ends or times differ from those the plan read"

    def claims(self, name: str, options: InputOptions | None = None) -> bool:
        return any(name.endswith(s) and len(name) > len(s) for s in (IDX, BIN))

    def is_input(self, path: str) -> bool:
        return path.endswith(IDX)

    def partners(self, path: str) -> tuple[str, ...]:
        return (path, bin_of(path))

    def read_file(self, path: str, f: int, expected: FileFingerprint | None = None, *,
                  options: InputOptions | None = None) -> tuple[FileFingerprint, list[Block], int]:
        with reader.open_pair(path, expected) as pair:
            return pair.fingerprint, reader.blocks_of(pair, f), pair.header.documents

    def index(self, resolution: Resolution, options: InputOptions, carried: CarriedColumns = CarriedColumns()
              ) -> SequenceIndex:
        return reader.index_inputs(resolution, options.tokens_column, options.labels_column)

    def decode(self, path: str, block: Block, options: InputOptions, *, skip_empty: bool = False,
               check_values: bool = True, expected: FileFingerprint | None = None) -> DecodedBlock:
        # token values are always checked as they are read
        return reader.decode_documents(path, block.first_row, block.rows, skip_empty=skip_empty, expected=expected)

    def scan_lengths(self, index, lo, hi, progress=None, *, skip_empty=False):
        return reader.scan_lengths(index, lo, hi, progress, skip_empty=skip_empty)

    def describe(self, path: str, row: int, column: str | None = None) -> str:
        return describe_document(path, row)  # a Megatron dataset has documents, no columns

    def check_options(self, resolution, *, tokens_column: str = INPUT_IDS, labels_column: str | None = None,
                      carried: CarriedColumns = CarriedColumns()) -> None:
        reader.check_options(resolution, tokens_column=tokens_column, labels_column=labels_column, carried=carried)


MEGATRON = MegatronKind()

"""The input seam: every kind of input packctl reads is one `InputKind`, registered in `INPUT_KINDS`.

Nothing outside `source/kinds/` asks which kind a path is; it asks the kind. A run reads one kind
(`kind_of_paths` refuses a mix in one line). What a kind answers, for `data/c.idx` of a Megatron
pair and `data/a.parquet`:

    claims("c.idx") -> True          a directory walk or a glob takes the file
    is_input("c.bin") -> False       the path names a partner, not an input of its own
    partners("data/c.idx")           ("data/c.idx", "data/c.bin"): what the run records and checks
    read_file(path, f, options=o)    (fingerprint, blocks, rows): rows known before scan (gids)
    decode(path, block, options)     DecodedBlock: tokens, labels of one block, checked
    scan_lengths(index, lo, hi)      lengths without decoding tokens (Megatron: from the .idx),
                                     or None where the kind has no cheap way
    describe(path, row, column)      'data/a.parquet row 3 column 'input_ids'', 'data/c.idx document 3'
    check_options(resolution, ...)   refuse carried columns (--weight-column, ...: specs.py
                                     `CarriedColumns`) where the kind has no columns

Options a kind reads (column names, a tokenizer) travel in one frozen `InputOptions`: a kind
that needs one more option adds a field here, not a parameter through the pipeline. A file's kind
is decided once, by `resolve` with the run's options (`data/chat.jsonl` is JSONL of token ids
without a tokenizer, raw records with one); the `Resolution` and the `SequenceIndex` carry that
kind and those options, and every later reader asks them, never the file's name. To add a kind:
one module in this package and one line in `INPUT_KINDS`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from packctl.errors import PackctlError
from packctl.specs import CarriedColumns
from packctl.tokenize.formats import Columns

if TYPE_CHECKING:
    from packctl.source.blocks import DecodedBlock
    from packctl.source.files import FileFingerprint
    from packctl.source.index import Block, Resolution, SequenceIndex


@dataclass(frozen=True)
class InputOptions:
    """What a kind needs to know to read its files, beyond their paths.

    tokens_column  the list column of token ids (Parquet, JSONL)
    labels_column  the list column of labels, None: labels are the tokens
    tokenizer      a tokenizer directory: raw text and chat records are tokenized as they are read
                   (`source/kinds/raw.py`); the fields below are `packctl tokenize`'s options of
                   the same names (`packctl.tokenize.options.TokenizeConfig`)
    """

    tokens_column: str = "input_ids"
    labels_column: str | None = None
    tokenizer: str | None = None
    format: str = "auto"
    loss_on: str | None = None
    columns: Columns = Columns()
    add_bos: str = "auto"
    add_eos: str = "auto"


# the config keys of `InputOptions.columns` (--text-column, ...), as pack and its manifest name them
COLUMN_KEYS = {"text_column": "text", "messages_column": "messages", "prompt_column": "prompt",
               "completion_column": "completion", "tools_column": "tools"}


def options_of(config: Mapping[str, Any], tokenizer: str | None = None) -> InputOptions:
    """The `InputOptions` of a run's options as pack's config (and its manifest's `config`) names
    them; `tokenizer` given replaces the recorded one (verify --tokenizer). The one place they are
    built: {"tokens_column": "ids"} -> InputOptions(tokens_column="ids")."""
    tokenizer = tokenizer if tokenizer is not None else config.get("tokenizer")
    labels = config.get("labels_column")
    options = InputOptions(tokens_column=config.get("tokens_column") or "input_ids",
                           labels_column=labels if isinstance(labels, str) else None)
    if not isinstance(tokenizer, str):
        return options
    default = Columns()
    columns = Columns(**{field: config.get(key) or getattr(default, field) for key, field in COLUMN_KEYS.items()})
    return dataclasses.replace(options, tokenizer=tokenizer, format=config.get("format") or "auto",
                               loss_on=config.get("loss_on"), columns=columns,
                               add_bos=config.get("add_bos") or "auto", add_eos=config.get("add_eos") or "auto")


class InputKind(Protocol):
    """One kind of input (module docstring)."""

    name: str  # as messages name the kind: 'Parquet', 'Megatron', 'JSONL'
    changed_what: str  # what differs when a file is not the one a plan read: 'its Parquet footer ...'
    footer_name: str  # what its fingerprint's digest is of, in messages: 'Parquet footer'

    def claims(self, name: str, options: InputOptions | None = None) -> bool:
        """Whether a directory walk or a glob takes a file of this name."""

    def is_input(self, path: str) -> bool:
        """Whether a claimed path is an input of its own (a pair's `.idx`), not a partner file."""

    def partners(self, path: str) -> tuple[str, ...]:
        """The files an input stands for, itself first."""

    def read_file(self, path: str, f: int, expected: "FileFingerprint | None" = None, *,
                  options: InputOptions | None = None) -> tuple["FileFingerprint", list["Block"], int]:
        """The file as it is now: its fingerprint, its blocks (numbered as input f) and rows;
        with `expected`, refused in one line when it is not that file."""

    def index(self, resolution: "Resolution", options: InputOptions,
              carried: "CarriedColumns" = CarriedColumns()) -> "SequenceIndex":
        """Files, blocks and gids of the resolved INPUT, the options and `carried` columns
        checked; no lengths yet."""

    def decode(self, path: str, block: "Block", options: InputOptions, *, skip_empty: bool = False,
               check_values: bool = True, expected: "FileFingerprint | None" = None) -> "DecodedBlock":
        """One block's tokens and labels, checked; errors name 'FILE row R column C'."""

    def scan_lengths(self, index: "SequenceIndex", lo: int, hi: int, progress: Callable | None = None, *,
                     skip_empty: bool = False) -> "SequenceIndex | None":
        """Lengths of blocks [lo, hi) without decoding a token, or None (the kind has no cheap way)."""

    def describe(self, path: str, row: int, column: str | None = None) -> str:
        """How messages name a row of the file."""

    def check_options(self, resolution: "Resolution", *, tokens_column: str = "input_ids",
                      labels_column: str | None = None, carried: "CarriedColumns" = CarriedColumns()) -> None:
        """Refuse the options of pack and stats this kind cannot honour (a column it has no way
        to read: --tokens-column, --labels-column, `carried.given()`), naming the flag."""


class OneFile:
    """What a kind whose every input is one file of its own (no partner) answers."""

    def is_input(self, path: str) -> bool:
        return True

    def partners(self, path: str) -> tuple[str, ...]:
        return (path,)


def claimed(name: str, options: InputOptions | None = None) -> bool:
    """Whether some kind takes a file of this name: `*.parquet`, `*.bin`/`*.idx`, `*.jsonl[.gz]`;
    with a tokenizer, the raw records `packctl tokenize` reads too (`*.json`, `*.txt`, ...)."""
    return any(kind.claims(name, options) for kind in INPUT_KINDS)


def kind_of(path: str, options: InputOptions | None = None) -> InputKind:
    """The kind that reads an input path under the run's `options` (the first in `INPUT_KINDS`
    claiming it): what `resolve` decides once for the run."""
    name = path.rsplit("/", 1)[-1]
    for kind in INPUT_KINDS:
        if kind.claims(name, options):
            return kind
    return PARQUET  # a file named by itself is read as Parquet (and refused by it if not)


def input_files(path: str) -> tuple[str, ...]:
    """The files a resolved input path stands for: a Megatron pair's `.idx` and `.bin`, else the
    path (partners are named by the file name whatever the options)."""
    return kind_of(path).partners(path)


def kind_of_paths(paths: Sequence[str], options: InputOptions | None = None) -> InputKind:
    """The one kind of a run's inputs; a mix is refused naming a file of another kind."""
    first: dict[int, str] = {}  # registry position of each kind found -> its first path
    for path in paths:
        kind = kind_of(path, options)
        first.setdefault(next(k for k, known in enumerate(INPUT_KINDS) if known is kind), path)
    if len(first) > 1:
        (a, path_a), (b, path_b) = sorted(first.items())[:2]
        raise PackctlError(f"{path_a}: a {INPUT_KINDS[a].name} input beside the {INPUT_KINDS[b].name} input {path_b}; "
                           "one run packs one kind of input: pack them in two runs, or narrow INPUT")
    return INPUT_KINDS[next(iter(first))] if first else PARQUET


# The registry: one line a kind, the first claiming a name reads it (raw records claim names
# only when the options give a tokenizer). Imported last: each kind module imports `InputOptions`.
from packctl.source.kinds.parquet import PARQUET  # noqa: E402
from packctl.source.kinds.megatron import MEGATRON  # noqa: E402
from packctl.source.kinds.jsonl import JSONL  # noqa: E402
from packctl.source.kinds.raw import RAW  # noqa: E402

INPUT_KINDS: tuple[InputKind, ...] = (RAW, PARQUET, MEGATRON, JSONL)


def check_options(resolution: "Resolution", *, tokens_column: str = "input_ids", labels_column: str | None = None,
                  carried: CarriedColumns = CarriedColumns()) -> None:
    """Refuse, in one line, the options the kind of the resolved INPUT cannot honour (a Megatron
    dataset has no columns): `InputKind.check_options`."""
    resolution.kind.check_options(resolution, tokens_column=tokens_column, labels_column=labels_column,
                                  carried=carried)

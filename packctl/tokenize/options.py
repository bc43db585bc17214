"""The options of `packctl tokenize` (`TokenizeConfig`, the CLI's flags) and the `TokenizeSpec` they make, its format decided once for the whole run
from the columns of the input files (never record by record)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

from packctl.errors import PackctlError
from packctl.urls import refuse_url
from packctl.tokenize.encode import AddSpecial, OnBadRow, TokenizeSpec
from packctl.tokenize.formats import Columns, LossOn, RecordFormat, detect_format, resolve_loss_on

if TYPE_CHECKING:
    from packctl.tokenize.rawfiles import RawFile

E = TypeVar("E", bound=Enum)

# the columns tokenize writes (module docstring): the input columns pack reads, and the provenance
TOKENS, LABELS, RECORD_ID, PROMPT_LENGTH, CHOSEN = "input_ids", "labels", "record_id", "prompt_length", "chosen"
WRITTEN = (TOKENS, LABELS, RECORD_ID, PROMPT_LENGTH, CHOSEN)


@dataclass(frozen=True)
class TokenizeConfig:
    """Every option of `packctl tokenize` (the CLI's flags, the same names)."""

    inputs: list[str]
    output: str
    tokenizer: str
    format: str = "auto"
    loss_on: str | None = None
    columns: Columns = Columns()  # --text-column, --messages-column, ...: where each field is read
    add_bos: str = "auto"
    add_eos: str = "auto"
    on_bad_row: str = "error"
    group_column: str | None = None
    keep_columns: tuple[str, ...] = ()
    text_unit: str = "line"
    shard_records: int = 10_000
    workers: int = 0  # 0: one per available core (divided among the ranks of this node)
    overwrite: bool = False
    resume: bool = False

    def content(self) -> dict[str, Any]:
        """What decides the output's bytes (the run's fingerprint and the manifest's config):
        every option but where and how the run executes."""
        out = dataclasses.asdict(self)
        for key in ("output", "overwrite", "resume", "workers", "tokenizer"):
            out.pop(key)
        out["keep_columns"] = list(self.keep_columns)
        return out

    def validate(self) -> None:
        refuse_url(self.output, "output")  # os.path would make s3://b/tok a local folder "s3:/b/tok"
        if not self.inputs:
            raise PackctlError("no INPUT: name JSONL, JSON, Parquet or text files, directories or globs")
        if not isinstance(self.shard_records, int) or self.shard_records < 1:
            raise PackctlError(f"--shard-records: {self.shard_records!r} is not a positive whole number of records")
        if not isinstance(self.workers, int) or self.workers < 0:
            raise PackctlError(f"--workers: {self.workers!r} is not a whole number >= 0 (0: one per core)")
        clash = set(WRITTEN) & set(self.keep_columns)
        if clash or self.group_column in WRITTEN:
            name = sorted(clash)[0] if clash else self.group_column
            raise PackctlError(f"--keep-column/--group-column {name}: a column packctl tokenize writes itself; "
                               "rename it in the input")




def choice(enum: type[E], value: str, flag: str) -> E:
    """`value` as a member of `enum`, or the one-line error listing the choices."""
    try:
        return enum(value)
    except ValueError:
        names = ", ".join(member.value for member in enum)
        raise PackctlError(f"{flag} {value!r}: not one of {names}") from None


def build_spec(config: TokenizeConfig, files: Sequence["RawFile"]) -> TokenizeSpec:
    """The run's spec: options checked, and under `--format auto` the format every file's columns
    name (a JSONL file's are those of its first record). Files whose columns name different
    formats, or lack a column the format or --group-column / --keep-column reads, are refused
    naming the file."""
    columns = config.columns
    fmt = choice(RecordFormat, config.format, "--format")
    loss_on = choice(LossOn, config.loss_on, "--loss-on") if config.loss_on is not None else None
    spec = TokenizeSpec(format=fmt, columns=columns, loss_on=loss_on,
                        add_bos=choice(AddSpecial, config.add_bos, "--add-bos"),
                        add_eos=choice(AddSpecial, config.add_eos, "--add-eos"),
                        on_bad_row=choice(OnBadRow, config.on_bad_row, "--on-bad-row"))
    from packctl.tokenize.rawfiles import TextUnit

    choice(TextUnit, config.text_unit, "--text-unit")
    known = [f for f in files if f.columns]
    if fmt is RecordFormat.AUTO:
        found: dict[RecordFormat, str] = {}
        for f in known:
            try:
                found.setdefault(detect_format(f.columns, columns), f.path)
            except PackctlError as exc:
                raise PackctlError(f"{f.path}: {exc}") from None
        if not found:
            raise PackctlError("cannot tell the record format: the inputs hold no record; pass --format")
        if len(found) > 1:
            (a, pa_), (b, pb) = list(found.items())[:2]
            raise PackctlError(f"{pb}: its records are {b.value} and those of {pa_} are {a.value}; one run "
                               "tokenizes one format: split the inputs, or pass --format")
        fmt = next(iter(found))
    loss_on = resolve_loss_on(fmt, loss_on)  # recorded as the rule applied, not as given
    spec = TokenizeSpec(format=fmt, columns=columns, loss_on=loss_on, add_bos=spec.add_bos, add_eos=spec.add_eos,
                        on_bad_row=spec.on_bad_row)
    wanted = [c for c in ([config.group_column] if config.group_column else []) + list(config.keep_columns)]
    for f in known:
        if f.kind == "parquet":  # a Parquet file has every column in every row: check them all now
            needed = {RecordFormat.TEXT: [columns.text], RecordFormat.MESSAGES: [columns.messages],
                      RecordFormat.PROMPT_COMPLETION: [columns.prompt, columns.completion],
                      RecordFormat.PREFERENCE: [columns.chosen, columns.rejected]}[fmt] + wanted
            missing = [c for c in needed if c not in f.columns]
            if missing:
                raise PackctlError(f"{f.path}: no column '{missing[0]}' (columns: {', '.join(f.columns)}); name it "
                                   "with the --*-column options, or leave the file out")
    return spec


def writes_prompt_length(spec: TokenizeSpec) -> bool:
    """Whether the rows have a prompt (prompt-completion and preference): `prompt_length` is
    written for them, the prefix `pack --share-prefix` and trainers read."""
    return spec.format in (RecordFormat.PROMPT_COMPLETION, RecordFormat.PREFERENCE)


def is_preference(spec: TokenizeSpec) -> bool:
    return spec.format is RecordFormat.PREFERENCE

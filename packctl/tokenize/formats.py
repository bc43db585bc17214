"""The record formats `packctl tokenize` reads, the columns it reads them from, and what the loss
is computed on.

A record is one row of the input as a dict (`json.loads` of a JSONL line, or polars `to_dicts()`):

    text               {"text": "The sky is blue."}
    messages           {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    prompt-completion  {"prompt": "2+2=", "completion": "4"}
    preference         {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from packctl.enums import LossOn, RecordFormat  # the choices, with --help's other choices

from packctl.errors import PackctlError


DEFAULT_LOSS_ON = {
    RecordFormat.TEXT: LossOn.ALL,
    RecordFormat.MESSAGES: LossOn.ASSISTANT,
    RecordFormat.PROMPT_COMPLETION: LossOn.COMPLETION,
    RecordFormat.PREFERENCE: LossOn.COMPLETION,
}

# The rules each format can follow. A plain text has no turns and no completion; a conversation
# has no completion apart from its turns.
ALLOWED_LOSS_ON = {
    RecordFormat.TEXT: (LossOn.ALL,),
    RecordFormat.MESSAGES: (LossOn.ASSISTANT, LossOn.LAST_ASSISTANT, LossOn.ALL),
    RecordFormat.PROMPT_COMPLETION: (LossOn.COMPLETION, LossOn.ALL, LossOn.ASSISTANT, LossOn.LAST_ASSISTANT),
    RecordFormat.PREFERENCE: (LossOn.COMPLETION, LossOn.ALL, LossOn.ASSISTANT, LossOn.LAST_ASSISTANT),
}


@dataclass(frozen=True)
class Columns:
    """The column each field of a record is read from (`--column-messages conversations` reads
    the messages from a `conversations` column)."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    chosen: str = "chosen"
    rejected: str = "rejected"
    tools: str = "tools"

    def describe(self) -> dict:
        return asdict(self)


# The columns that decide each format, in the order `auto` tries them.
def _required(columns: Columns) -> list[tuple[RecordFormat, tuple[str, ...]]]:
    return [
        (RecordFormat.PREFERENCE, (columns.chosen, columns.rejected)),
        (RecordFormat.PROMPT_COMPLETION, (columns.prompt, columns.completion)),
        (RecordFormat.MESSAGES, (columns.messages,)),
        (RecordFormat.TEXT, (columns.text,)),
    ]


def detect_format(names: Iterable[str], columns: Columns = Columns()) -> RecordFormat:
    """The format whose columns are all present, preference first.

    >>> detect_format(["prompt", "completion", "id"])
    <RecordFormat.PROMPT_COMPLETION: 'prompt-completion'>
    """
    present = set(names)
    for fmt, needed in _required(columns):
        if all(name in present for name in needed):
            return fmt
    expected = "; ".join(f"{fmt.value}: {' + '.join(needed)}" for fmt, needed in _required(columns))
    raise PackctlError(
        f"cannot tell the record format from the columns found ({', '.join(sorted(present)) or 'none'}); "
        f"expected {expected}; name the columns with the --column-* options or pass --format"
    )


def resolve_loss_on(fmt: RecordFormat, loss_on: LossOn | None) -> LossOn:
    """The format's default rule when `loss_on` is None; a rule that makes no sense for the format
    refused in one line."""
    if fmt is RecordFormat.AUTO:
        raise ValueError("resolve the format (detect_format) before the loss rule")
    if loss_on is None:
        return DEFAULT_LOSS_ON[fmt]
    if loss_on not in ALLOWED_LOSS_ON[fmt]:
        allowed = ", ".join(rule.value for rule in ALLOWED_LOSS_ON[fmt])
        raise PackctlError(f"--loss-on {loss_on.value} does not apply to the {fmt.value} format; use one of: {allowed}")
    return loss_on

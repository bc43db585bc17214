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
from packctl.enums import StrEnum

from packctl.errors import PackctlError


class RecordFormat(StrEnum):
    """What a record holds, and so how it becomes token rows."""

    TEXT = "text"
    """Language modelling: a `text` string, the loss on every token."""

    MESSAGES = "messages"
    """Conversational: a `messages` list of {role, content, ...} rendered by the chat template,
    with an optional `tools` list passed to the template."""

    PROMPT_COMPLETION = "prompt-completion"
    """TRL's prompt-completion: `prompt` and `completion`, each a plain string or a list of
    messages (both of the same kind)."""

    PREFERENCE = "preference"
    """TRL's preference: `chosen` and `rejected` with an optional `prompt`, plain or conversational;
    two rows per record (chosen, then rejected). Without a `prompt` column the prompt is implicit:
    the leading messages (or characters) chosen and rejected share."""

    AUTO = "auto"
    """Detected from the columns present: preference, then prompt-completion, then messages, then
    text."""


class LossOn(StrEnum):
    """Which tokens of a row carry a label (the others get -100)."""

    ASSISTANT = "assistant"
    """Every assistant turn of a conversation (its content and its end-of-turn token)."""

    ALL = "all"
    """Every token."""

    LAST_ASSISTANT = "last-assistant"
    """Only the last assistant turn of a conversation."""

    COMPLETION = "completion"
    """Only the completion (for preference: the chosen or the rejected part)."""


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


class AddSpecial(StrEnum):
    """Whether packctl puts the tokenizer's BOS (or EOS) around a row."""

    AUTO = "auto"
    """Plain text: as the tokenizer does (its post-processor, or tokenizer_config.json's
    add_bos_token / add_eos_token); a plain completion also ends with EOS, as TRL appends it. A
    chat: only what its template writes."""

    ALWAYS = "always"
    """Every row starts with BOS (ends with EOS), unless it already does."""

    NEVER = "never"
    """packctl adds none (a chat template's own tokens stay)."""

"""Records to token rows with labels: the loss mask `packctl tokenize` writes.

Every row's text is built first (a chat rendered by its template, a prompt and its completion
joined), with the character spans that carry the loss; all texts are then encoded by one batch
call, and each span becomes a token range (`masks.token_spans`). A chat is encoded once, whole, so
the tokens at turn boundaries are those the model sees; no turn is encoded on its own.

Where the loss spans of a chat come from:

- a template with `{% generation %}` blocks: the blocks (as transformers'
  `return_assistant_tokens_mask`);
- any other template: each assistant turn i is located by rendering growing prefixes,
  P = render(messages[:i], add_generation_prompt=True) and T = render(messages[:i+1]); the turn
  is text[len(P):len(T)] without its trailing whitespace, so the end-of-turn token is trained and
  the newline after it is not. With ChatML:

      P = "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
      T = P + "Hello<|im_end|>\\n"               span: "Hello<|im_end|>"

  This needs the template to render earlier turns verbatim (the whole render starts with T, T
  starts with P); a template that rewrites history (drops the reasoning of earlier turns) is
  refused for the row.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from packctl.enums import StrEnum

import jinja2
import numpy as np

from packctl.errors import PackctlError
from packctl.enums import AddSpecial
from packctl.tokenize.formats import Columns, LossOn, RecordFormat, detect_format, resolve_loss_on
from packctl.tokenize.masks import IGNORE_INDEX, SpanError, token_spans
from packctl.tokenize.tokenizer import LocalTokenizer, first_line


class OnBadRow(StrEnum):
    """What a record that cannot be tokenized does."""

    ERROR = "error"
    """Stop with an error naming the record and the field."""

    DROP = "drop"
    """Leave the record out and count it (`TokenizedBatch.dropped`)."""


class RowError(PackctlError):
    """A record that cannot be tokenized: its index in the batch, the field and why.

    The caller adds where the record comes from (file, row) to the message.
    """

    def __init__(self, record: int, field: str, message: str):
        super().__init__(f"record {record} field {field!r}: {message}")
        self.record = record
        self.field = field
        self.reason = message


class RowOptionError(RowError):
    """A record the options do not apply to (`--loss-on assistant` on a plain completion): an
    error under `--on-bad-row drop` too, since every such record would be dropped."""


# Records rendered while the previous chunk is encoded (see tokenize_records).
_CHUNK = 256

PREFIX_RULE_MESSAGE = (
    "the chat template does not reproduce earlier turns verbatim (it rewrites history, e.g. drops reasoning of "
    "earlier turns); use a template with {% generation %} or --loss-on all"
)
COMPLETION_RULE_MESSAGE = (
    "prompt + completion does not start with the prompt as the chat template renders it for generation (the "
    "completion must start with an assistant turn, and the template must not rewrite the prompt's turns)"
)


@dataclass(frozen=True)
class TokenizeSpec:
    """How records become token rows.

    `loss_on`: None takes the format's default (text: all, messages: assistant, prompt-completion
    and preference: completion).
    """

    format: RecordFormat = RecordFormat.AUTO
    columns: Columns = Columns()
    loss_on: LossOn | None = None
    add_bos: AddSpecial = AddSpecial.AUTO
    add_eos: AddSpecial = AddSpecial.AUTO
    on_bad_row: OnBadRow = OnBadRow.ERROR

    def resolve(self, names) -> tuple[RecordFormat, LossOn]:
        """The format (detected from the column `names` under auto) and the loss rule."""
        fmt = detect_format(names, self.columns) if self.format is RecordFormat.AUTO else self.format
        return fmt, resolve_loss_on(fmt, self.loss_on)

    def describe(self, names: Iterable[str] | None = None) -> dict:
        """What the output's metadata records of the options; given the column `names` of the
        input, the format and loss rule are the resolved ones (auto detected, the default rule)."""
        fmt, loss_on = self.resolve(names) if names is not None else (self.format, self.loss_on)
        return {
            "format": fmt.value,
            "loss_on": loss_on.value if loss_on is not None else None,
            "columns": self.columns.describe(),
            "add_bos": self.add_bos.value,
            "add_eos": self.add_eos.value,
            "on_bad_row": self.on_bad_row.value,
        }


@dataclass
class TokenizedBatch:
    """The token rows of a batch of records, flat.

    Row r is input_ids[offsets[r]:offsets[r+1]]; labels is -100 where no loss. `record[r]` is the
    index of its record in the batch, `branch[r]` 0, or for preference 0 = chosen, 1 = rejected;
    `prompt_length[r]` the tokens before the completion (a conversation: before the first loss
    token; a text: 0). Two preference records, the first dropped:

        record = [1, 1], branch = [0, 1], dropped = [(0, "chosen", "...")]
    """

    offsets: np.ndarray
    input_ids: np.ndarray
    labels: np.ndarray
    record: np.ndarray
    branch: np.ndarray
    prompt_length: np.ndarray
    dropped: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


@dataclass
class _Row:
    """One row's text before encoding: the loss spans in characters (None: every token), where
    the completion starts (None: at the first loss token), and whether it is a chat."""

    record: int
    branch: int
    field: str
    text: str
    spans: list[tuple[int, int]] | None
    completion_char: int | None
    chat: bool


def _strip_end(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


class _RowBuilder:
    def __init__(self, spec: TokenizeSpec, fmt: RecordFormat, loss_on: LossOn, tokenizer: LocalTokenizer):
        self.spec = spec
        self.columns = spec.columns
        self.fmt = fmt
        self.loss_on = loss_on
        self.tok = tokenizer

    # --- fields -----------------------------------------------------------------------------
    def _get(self, index: int, record: dict, name: str):
        value = record.get(name)
        if value is None:
            raise RowError(index, name, "is missing or null")
        return value

    def _string(self, index: int, name: str, value) -> str:
        if not isinstance(value, str):
            raise RowError(index, name, f"expected a string, found {type(value).__name__}")
        return value

    def _messages(self, index: int, name: str, value, *, allow_empty: bool = False) -> list[dict]:
        if not isinstance(value, list) or (not value and not allow_empty):
            raise RowError(index, name, f"expected a non-empty list of messages, found {type(value).__name__}")
        for position, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RowError(index, name, f"message {position} is not a dict with a string 'role'")
            content = message.get("content")
            if content is None and not message.get("tool_calls"):
                raise RowError(index, name, f"message {position} has no 'content' (nor 'tool_calls')")
            if content is not None and not isinstance(content, (str, list)):
                kind = type(content).__name__
                raise RowError(index, name, f"message {position} 'content' is a {kind}, expected a string or a list")
        return value

    def _tools(self, index: int, record: dict):
        tools = record.get(self.columns.tools)
        if tools is None:
            return None
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as exc:
                raise RowError(index, self.columns.tools, f"is a string that is not JSON ({exc.msg})") from None
        if not isinstance(tools, list):
            raise RowError(index, self.columns.tools, f"expected a list of tool schemas, found {type(tools).__name__}")
        return tools

    def _render(self, index: int, name: str, messages, tools, add_generation_prompt: bool):
        try:
            return self.tok.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, prepared=True)
        except jinja2.TemplateError as exc:
            raise RowError(index, name, f"the chat template refuses it: {first_line(exc)}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            reason = f"{type(exc).__name__}: {first_line(exc)}"
            raise RowError(index, name, f"the chat template fails on it ({reason})") from None

    # --- chats ------------------------------------------------------------------------------
    def _assistant_spans(self, index: int, name: str, messages: list[dict], tools, full) -> list[tuple[int, int]]:
        """The character span of every assistant turn (the last only, under last-assistant)."""
        if full.generation_spans is not None:
            spans = full.generation_spans
            return spans[-1:] if self.loss_on is LossOn.LAST_ASSISTANT else list(spans)
        turns = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
        if self.loss_on is LossOn.LAST_ASSISTANT:
            turns = turns[-1:]
        spans = []
        text = full.text
        for i in turns:
            prompt = self._render(index, name, messages[:i], tools, True).text
            start = len(prompt)
            turn = text if i == len(messages) - 1 else self._render(index, name, messages[: i + 1], tools, False).text
            if not (text.startswith(turn) and turn.startswith(prompt)):
                raise RowError(index, name, PREFIX_RULE_MESSAGE)
            spans.append((start, _strip_end(text, start, len(turn))))
        return spans

    def _chat_row(self, index, branch, name, messages, tools, completion_from: int | None) -> _Row:
        """A conversation; `completion_from`: the message the completion starts at (None: no completion)."""
        messages = self.tok.prepare_messages(messages)
        full = self._render(index, name, messages, tools, False)
        completion_char = None
        if completion_from is not None:
            prompt = self._render(index, name, messages[:completion_from], tools, True).text
            if not full.text.startswith(prompt):
                raise RowError(index, name, COMPLETION_RULE_MESSAGE)
            completion_char = len(prompt)
        if self.loss_on is LossOn.ALL:
            spans = None
        elif self.loss_on is LossOn.COMPLETION:
            spans = [(completion_char, _strip_end(full.text, completion_char, len(full.text)))]
        else:
            spans = self._assistant_spans(index, name, messages, tools, full)
        if not full.text:
            raise RowError(index, name, "the chat template renders it as empty text")
        return _Row(index, branch, name, full.text, spans, completion_char, True)

    # --- records ----------------------------------------------------------------------------
    def _plain_completion(self, index, branch, name, prompt: str, completion: str) -> _Row:
        if self.loss_on in (LossOn.ASSISTANT, LossOn.LAST_ASSISTANT):
            raise RowOptionError(
                index, name, f"--loss-on {self.loss_on.value} needs conversational records (lists of messages), "
                "this one is a plain string; use --loss-on completion"
            )
        text = prompt + completion
        if not text:
            raise RowError(index, name, "empty text")
        spans = None if self.loss_on is LossOn.ALL else [(len(prompt), len(text))]
        return _Row(index, branch, name, text, spans, len(prompt), False)

    def _completion_row(self, index, branch, prompt_name, name, prompt, completion, tools) -> _Row:
        if isinstance(prompt, str) and isinstance(completion, str):
            return self._plain_completion(index, branch, name, prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            self._messages(index, prompt_name, prompt, allow_empty=True)
            self._messages(index, name, completion)
            if not prompt:
                raise RowError(index, prompt_name, "is an empty list of messages")
            return self._chat_row(index, branch, name, prompt + completion, tools, len(prompt))
        raise RowError(
            index, name, f"{prompt_name} is a {type(prompt).__name__} and {name} a {type(completion).__name__}; "
            "both must be strings or both lists of messages"
        )

    def rows(self, index: int, record: dict) -> list[_Row]:
        c = self.columns
        if not isinstance(record, dict):
            raise RowError(index, "", f"a record is a dict of columns, found {type(record).__name__}")
        if self.fmt is RecordFormat.TEXT:
            text = self._string(index, c.text, self._get(index, record, c.text))
            if not text:
                raise RowError(index, c.text, "empty text")
            return [_Row(index, 0, c.text, text, None, None, False)]
        if self.fmt is RecordFormat.MESSAGES:
            messages = self._messages(index, c.messages, self._get(index, record, c.messages))
            return [self._chat_row(index, 0, c.messages, messages, self._tools(index, record), None)]
        if self.fmt is RecordFormat.PROMPT_COMPLETION:
            prompt = self._get(index, record, c.prompt)
            completion = self._get(index, record, c.completion)
            tools = self._tools(index, record)
            return [self._completion_row(index, 0, c.prompt, c.completion, prompt, completion, tools)]
        chosen = self._get(index, record, c.chosen)
        rejected = self._get(index, record, c.rejected)
        prompt = record.get(c.prompt)
        if prompt is None:
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
            if isinstance(prompt, list) and not prompt:
                raise RowError(index, c.chosen, f"{c.chosen} and {c.rejected} share no leading message to be the prompt")
        tools = self._tools(index, record)
        return [
            self._completion_row(index, 0, c.prompt, c.chosen, prompt, chosen, tools),
            self._completion_row(index, 1, c.prompt, c.rejected, prompt, rejected, tools),
        ]


def implicit_prompt(chosen, rejected):
    """The prompt chosen and rejected share, as TRL's `extract_prompt` finds it: their common
    leading messages, or their common leading characters (a space before the first difference
    goes with the completions).

    >>> implicit_prompt("Sky? Blue.", "Sky? Green.")
    ('Sky?', ' Blue.', ' Green.')
    """
    if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
        return chosen, chosen, rejected  # refused by the row builder: kinds differ
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx > 0 and chosen[idx - 1] == " ":
                idx -= 1
            break
    else:
        idx = min(len(chosen), len(rejected))
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _specials(spec: TokenizeSpec, tok: LocalTokenizer, row: _Row) -> tuple[bool, bool]:
    """Whether the row gets BOS first and EOS last (never a second one)."""
    if row.chat:
        auto_bos = auto_eos = False
    else:
        auto_bos = tok.adds_bos
        # TRL appends EOS to a plain completion; a plain text ends as the tokenizer ends it.
        auto_eos = tok.adds_eos or (row.completion_char is not None and tok.eos_token_id is not None)
    bos = {AddSpecial.AUTO: auto_bos, AddSpecial.ALWAYS: True, AddSpecial.NEVER: False}[spec.add_bos]
    eos = {AddSpecial.AUTO: auto_eos, AddSpecial.ALWAYS: True, AddSpecial.NEVER: False}[spec.add_eos]
    if (bos and tok.bos_token_id is None) or (eos and tok.eos_token_id is None):
        which = "--add-bos" if bos and tok.bos_token_id is None else "--add-eos"
        raise PackctlError(f"{which} always: tokenizer {tok.directory} has no such token; pass {which} never or auto")
    return bos, eos


def _encode_row(spec: TokenizeSpec, loss_on: LossOn, tok: LocalTokenizer, row: _Row, encoding):
    """ids, labels and prompt length of one row, from its encoding and its character spans."""
    ids = np.asarray(encoding.ids, dtype=np.int32)
    n = len(ids)
    try:
        ranges = [(0, n)] if row.spans is None else token_spans(encoding, row.spans)
        completion = None
        if row.completion_char is not None:
            # The first token of the completion; an empty completion starts after the last token.
            rest = (row.completion_char, len(row.text))
            completion = token_spans(encoding, [rest])[0][0] if rest[0] < rest[1] else n
    except SpanError as exc:
        raise RowError(row.record, row.field, str(exc)) from None
    labels = np.full(n, IGNORE_INDEX, dtype=np.int32)
    for first, last in ranges:
        labels[first:last] = ids[first:last]
    bos, eos = _specials(spec, tok, row)
    head = bos and not (n and ids[0] == tok.bos_token_id)
    tail = eos and not (n and ids[-1] == tok.eos_token_id)
    if head or tail:
        # An added EOS is trained where the token before it is (the end of a completion, a text).
        eos_label = tok.eos_token_id if tail and n and labels[-1] != IGNORE_INDEX else IGNORE_INDEX
        bos_label = tok.bos_token_id if head and row.spans is None else IGNORE_INDEX
        before, after = int(head), int(tail)  # 0 or 1 token each
        ids = np.concatenate([[tok.bos_token_id] * before, ids, [tok.eos_token_id] * after]).astype(np.int32)
        labels = np.concatenate([[bos_label] * before, labels, [eos_label] * after]).astype(np.int32)
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    if trained.size == 0:
        raise RowError(
            row.record, row.field,
            f"no token carries a loss under --loss-on {loss_on.value} (it has no part the rule trains)",
        )
    if completion is not None:
        prompt_length = completion + int(head)
    elif row.chat:
        prompt_length = int(trained[0])
    else:
        prompt_length = 0
    return ids, labels, prompt_length


def tokenize_records(records: list[dict], spec: TokenizeSpec, tokenizer: LocalTokenizer) -> TokenizedBatch:
    """Token rows, labels and their provenance for a batch of records.

    A chat (messages, or conversational prompt-completion and preference) is encoded without the
    tokenizer's special tokens: the template writes its own, as transformers does. Errors under
    `on_bad_row=error` raise the `RowError` of the first bad record; under `drop` the record is
    left out (a preference record with both its rows) and listed in `dropped`.

    >>> batch = tokenize_records([{"text": "hi"}], TokenizeSpec(format=RecordFormat.TEXT), tok)
    >>> batch.offsets, batch.record, batch.branch
    (array([0, 2]), array([0]), array([0], dtype=int8))
    """
    names: set[str] = set()
    if spec.format is RecordFormat.AUTO:
        for record in records:
            if isinstance(record, dict):
                names.update(record)
    fmt, loss_on = spec.resolve(names)
    builder = _RowBuilder(spec, fmt, loss_on, tokenizer)
    errors: dict[int, RowError] = {}  # record -> its first error
    encoded: list[tuple] = []

    def finish(rows: list[_Row], encodings) -> None:
        for row, encoding in zip(rows, encodings):
            if row.record not in errors:
                try:
                    encoded.append((row, *_encode_row(spec, loss_on, tokenizer, row, encoding)))
                except RowError as exc:
                    errors[row.record] = exc

    # The records go in chunks: the Rust encoder (which releases the GIL) encodes one chunk on its
    # threads while this thread renders the next, so rendering costs little wall time. The ids do
    # not depend on the chunks: each text is encoded alone.
    with ThreadPoolExecutor(max_workers=1) as encoder:
        pending = None
        for start in range(0, len(records), _CHUNK):
            rows = []
            for index in range(start, min(start + _CHUNK, len(records))):
                try:
                    rows.extend(builder.rows(index, records[index]))
                except RowOptionError:
                    raise
                except RowError as exc:
                    errors[index] = exc
            submitted = encoder.submit(tokenizer.encode_batch, [row.text for row in rows], add_special_tokens=False)
            if pending is not None:
                finish(pending[0], pending[1].result())
            pending = (rows, submitted)
            if errors and spec.on_bad_row is OnBadRow.ERROR:
                break
        if pending is not None:
            finish(pending[0], pending[1].result())
    if errors and spec.on_bad_row is OnBadRow.ERROR:
        raise errors[min(errors)]
    encoded = [item for item in encoded if item[0].record not in errors]
    dropped = [(index, exc.field, exc.reason) for index, exc in sorted(errors.items())]
    lengths = np.fromiter((len(item[1]) for item in encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    empty = np.zeros(0, dtype=np.int32)
    return TokenizedBatch(
        offsets=offsets,
        input_ids=np.concatenate([item[1] for item in encoded]) if encoded else empty,
        labels=np.concatenate([item[2] for item in encoded]) if encoded else empty.copy(),
        record=np.fromiter((item[0].record for item in encoded), dtype=np.int64, count=len(encoded)),
        branch=np.fromiter((item[0].branch for item in encoded), dtype=np.int8, count=len(encoded)),
        prompt_length=np.fromiter((item[3] for item in encoded), dtype=np.int32, count=len(encoded)),
        dropped=dropped,
    )

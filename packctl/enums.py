"""The choices of packctl's options as `StrEnum` classes, one docstring per member: what --help
lists and the option accepts are the members' values, in declaration order (`Order.values()`).

Each member is its string: `Order.SHUFFLE == "shuffle"`, it hashes and prints as its value, and
JSON writes its value, so a member and the string typed on the command line are interchangeable.

    >>> Order("shuffle") is Order.SHUFFLE, str(Order.SHUFFLE), Order.values()
    (True, 'shuffle', ('input', 'shuffle', 'curriculum'))

`StrEnum` is Python's (3.11+), or the same on Python 3.10.
"""
from __future__ import annotations

import enum

if hasattr(enum, "StrEnum"):
    StrEnum = enum.StrEnum
else:  # Python 3.10
    class StrEnum(str, enum.Enum):
        """A str and an Enum whose str() is its value, as Python 3.11's enum.StrEnum."""

        def __str__(self) -> str:
            return str(self.value)


class Choice(StrEnum):
    """An option with a fixed set of values."""

    __hash__ = str.__hash__  # a member and its string are the same dict key
    __format__ = str.__format__

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The values, in declaration order: what --help lists and the option accepts."""
        return tuple(member.value for member in cls)


class Order(Choice):
    """`--order`: the global order of the sequences before they are planned."""

    INPUT = "input"
    """As read: files in order, rows in order."""
    SHUFFLE = "shuffle"
    """A shuffle seeded by --seed."""
    CURRICULUM = "curriculum"
    """By padded length (--curriculum-order), ties by global id."""


class CurriculumOrder(Choice):
    """`--curriculum-order`: the direction of --order curriculum."""

    ASC = "asc"
    """Shortest first."""
    DESC = "desc"
    """Longest first."""


class PackOrder(Choice):
    """`--pack-order`: the order of each window's packs (with --dp-size, of its steps)."""

    AUTO = "auto"
    """shuffle with --order shuffle, else planner."""
    PLANNER = "planner"
    """As the algorithm opens them."""
    SHUFFLE = "shuffle"
    """Stratified by length, seeded by --seed."""
    LONGEST = "longest"
    """Ascending by the longest sequence of each pack."""
    MEAN = "mean"
    """Ascending by the mean sequence length of each pack."""


class TooLong(Choice):
    """`--too-long`: what happens to a sequence longer than the capacity."""

    ERROR = "error"
    """The run stops at the first, naming it."""
    DROP = "drop"
    """Left out, counted in sequences_dropped."""
    TRUNCATE = "truncate"
    """Cut to the capacity, the rest lost, counted in sequences_truncated."""
    SPLIT = "split"
    """Cut into pieces of at most the capacity, every token kept, counted in sequences_split."""


class Mode(Choice):
    """`--mode`: what a row of the output is."""

    PACK = "pack"
    """A THD pack: sequences laid end to end, --capacity tokens."""
    BATCH = "batch"
    """A padded micro-batch: rows of one padded length, rows x length <= --max-tokens."""


class PadTo(Choice):
    """`--pad-to`: the written length of a pack."""

    CAPACITY = "capacity"
    """Every pack exactly --capacity tokens."""
    MULTIPLE = "multiple"
    """Its tokens rounded up to --pack-multiple."""


class GroupScope(Choice):
    """`--group-scope`: where a group of --group-column is kept whole."""

    PACK = "pack"
    """One pack, members adjacent, in input order."""
    STEP = "step"
    """One optimizer step, members in any of its packs (needs --dp-size)."""


class PoolStrategy(Choice):
    """`--pool-strategy`: which waiting item --algorithm pool places."""

    CLOSEST = "closest"
    """The largest item that fits."""
    FIRST = "first"
    """The oldest item that fits."""


class TokenTransfer(Choice):
    """`--token-transfer`: under MPI, how a rank gets the tokens of the packs it writes."""

    AUTO = "auto"
    """read where that decodes little more than the input, else exchange."""
    EXCHANGE = "exchange"
    """Sent by the rank that scanned their block."""
    READ = "read"
    """Read by the rank itself (a filesystem every rank sees)."""


class Cost(Choice):
    """`--balance`: the cost shared out evenly over data-parallel ranks."""

    TOKENS = "tokens"
    """The tokens of a sequence, L."""
    ATTENTION = "attention"
    """a*L + L^2 of a sequence (a: --attn-coeff)."""


class BalanceScope(Choice):
    """`--balance-scope`: what balancing moves between a step's packs."""

    PACKS = "packs"
    """Whole packs only."""
    SEQUENCES = "sequences"
    """Whole packs, then single sequences."""


class StepGrouping(Choice):
    """`--step-grouping`: which packs make up a step."""

    COST = "cost"
    """Packs of similar cost, in a seeded order."""
    ORDER = "order"
    """Consecutive packs."""


class LrScaling(Choice):
    """`--lr-scaling`: the exponent p of lr_scale = (batch / --ref-batch-size)^p."""

    NONE = "none"
    """No lr_scale (p = 0)."""
    LINEAR = "linear"
    """p = 1."""
    SQRT = "sqrt"
    """p = 1/2."""


class BatchUnit(Choice):
    """`--batch-unit`: what a batch size counts."""

    SEQUENCES = "sequences"
    """Sequences."""
    TOKENS = "tokens"
    """Tokens."""


# The choices of how raw records are tokenized (`packctl tokenize`, `pack --tokenizer`)

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

"""The output contract (format version 2): every column packctl writes, declared once in `COLUMNS`.

One Parquet row per pack. A pack of capacity 16 holding sequences of 5 and 6 tokens with align 4
(pad id 0; `.` = -100):

    input_ids          a0 a1 a2 a3 a4  0  0  0 b0 b1 b2 b3 b4 b5  0  0
    labels              .  a1 a2 a3 a4  .  .  .  .  b1 b2 b3 b4 b5  .  .
    position_ids        0  1  2  3  4  5  6  7  0  1  2  3  4  5  6  7
    seq_lens           [5, 6]            seq_lens_padded   [8, 8]
    cu_seqlens         [0, 5, 11]        cu_seqlens_padded [0, 8, 16]
    sample_ids         [gid_a, gid_b]    num_tokens        11
    seq_loss_tokens    [4, 5]            num_loss_tokens   9      sum_sq_seqlen 5*5 + 6*6 = 61

The last entry of `seq_lens_padded` also holds the tail padding of the pack, so the padded
lengths always sum to len(input_ids). `seq_lengths` repeats `seq_lens_padded` under the name TRL's
padding-free collator reads (it rebuilds position_ids from it, so TRL needs no other column).

Everything else derives from `COLUMNS`: the Arrow types the writer casts to (output/encode.py),
the names --keep-columns may not take (`RESERVED_COLUMNS`), the columns `packctl.torch.PackedDataset`
hands out, verify's `schema` rule and the table of docs/format.md (checked by a test). A column
is added by a row here and the code that computes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

FORMAT_VERSION = 2  # 2: OUT is a Parquet dataset (data/, _manifest.json); the columns are version 1's
METADATA_KEY = b"packctl"
IGNORE_INDEX = -100  # label of a token that carries no loss (padding, masked prompts, first tokens)
INT32_MAX = 2**31 - 1  # token ids, offsets and lengths are int32

# What one value of a column describes: a list column holds one per token, sequence or cu_seqlens
# entry of its pack; a pack column holds one value.
TOKEN, SEQUENCE, CU_ENTRY, PACK = "token", "sequence", "cu entry", "pack"

# When a column is written: always, or with the option that asks for it.
ALWAYS = "always"
WITH_STEPS = "--dp-size"
WITH_LR_SCALING = "--lr-scaling"
BATCH_MODE = "--mode batch"
WITH_WEIGHTS = "--weight-column"
WITH_GROUPS = "--group-column"
WITH_SHARED_PREFIX = "--share-prefix"
PLAN_ONLY = "--plan-only"
WITH_LIMITS = "--limit"
WITH_SOURCES = "--source"

INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
SEQ_LENS = "seq_lens"
SEQ_LENS_PADDED = "seq_lens_padded"
CU_SEQLENS = "cu_seqlens"
CU_SEQLENS_PADDED = "cu_seqlens_padded"
SAMPLE_IDS = "sample_ids"
NUM_TOKENS = "num_tokens"
SEQ_LENGTHS = "seq_lengths"
NUM_LOSS_TOKENS = "num_loss_tokens"
SEQ_LOSS_TOKENS = "seq_loss_tokens"
SUM_SQ_SEQLEN = "sum_sq_seqlen"
STEP = "step"
DP_RANK = "dp_rank"
MICRO_BATCH = "micro_batch"
LR_SCALE = "lr_scale"
PADDED_LEN = "padded_len"
BATCH_SIZE = "batch_size"
STEP_LOSS_TOKENS = "step_loss_tokens"
STEP_LOSS_SEQUENCES = "step_loss_sequences"
SEQ_WEIGHTS = "seq_weights"
GROUP_IDS = "group_ids"
PARENT_SEGMENTS = "parent_segments"
SEQ_STARTS = "seq_starts"
SOURCE_IDS = "source_ids"


@dataclass(frozen=True)
class Column:
    """One output column: its name, the type of one value, what one value describes and when it is
    written. `since` is the format version from which every shard holds it (None: a reader treats it
    as optional, since outputs of this version written before it existed lack it)."""

    name: str
    value: str  # numpy name of one value's type: int32, int64, float32, float64
    per: str  # TOKEN, SEQUENCE, CU_ENTRY (a list per pack) or PACK (one value)
    written: str  # ALWAYS or the option that writes it
    since: int | None
    meaning: str

    @property
    def is_list(self) -> bool:
        return self.per != PACK

    @property
    def type_text(self) -> str:
        """The type as docs/format.md writes it: `list<int32>`, `float32`."""
        return f"list<{self.value}>" if self.is_list else self.value

    @property
    def value_type(self):
        """The Arrow type of one value (pyarrow is imported here, on first use: `--help` needs none)."""
        import pyarrow as pa

        return getattr(pa, self.value)()  # pa.int32(), pa.int64(), pa.float32(), pa.float64()

    @property
    def arrow_type(self):
        """The column's Arrow type: `list<value>` for a list column, the value's type otherwise."""
        import pyarrow as pa

        return pa.list_(self.value_type) if self.is_list else self.value_type


COLUMNS = (
    Column(INPUT_IDS, "int32", TOKEN, ALWAYS, 1,
           "each sequence followed by its alignment padding; tail padding at the end; pad = `pad_token_id`"),
    Column(LABELS, "int32", TOKEN, ALWAYS, 1,
           "-100 on every padding token and on the first token of every sequence that starts a row (a branch of "
           "--share-prefix keeps its row's label); elsewhere the source label"),
    Column(POSITION_IDS, "int32", TOKEN, ALWAYS, 1,
           "restarts at 0 at each sequence (a branch of --share-prefix goes on from its parent); continues through "
           "its alignment padding and the tail padding"),
    Column(SEQ_LENS, "int32", SEQUENCE, ALWAYS, 1, "true lengths"),
    Column(SEQ_LENS_PADDED, "int32", SEQUENCE, ALWAYS, 1,
           "lengths after alignment; the last one also holds the tail padding: they sum to len(input_ids)"),
    Column(CU_SEQLENS, "int32", CU_ENTRY, ALWAYS, 1, "[0, cumsum(seq_lens)]"),
    Column(CU_SEQLENS_PADDED, "int32", CU_ENTRY, ALWAYS, 1,
           "[0, cumsum(seq_lens_padded)]; the last entry is len(input_ids)"),
    Column(SAMPLE_IDS, "int64", SEQUENCE, ALWAYS, 1, "global sample ids, in pack order (-1 on a prefix of "
           "--share-prefix)"),
    Column(NUM_TOKENS, "int32", PACK, ALWAYS, 1, "sum(seq_lens)"),
    Column(SEQ_LENGTHS, "int32", SEQUENCE, ALWAYS, 2, "seq_lens_padded again, under the name TRL reads"),
    Column(NUM_LOSS_TOKENS, "int32", PACK, ALWAYS, None, "labels that are not -100: sum(seq_loss_tokens)"),
    Column(SEQ_LOSS_TOKENS, "int32", SEQUENCE, ALWAYS, None, "labels that are not -100, sequence by sequence"),
    Column(SUM_SQ_SEQLEN, "int64", PACK, ALWAYS, None, "sum(seq_lens ** 2): the causal-attention cost"),
    Column(STEP, "int32", PACK, WITH_STEPS, None, "the optimizer step that consumes the pack"),
    Column(DP_RANK, "int32", PACK, WITH_STEPS, None, "the data-parallel rank that consumes the pack"),
    Column(MICRO_BATCH, "int32", PACK, WITH_STEPS, None, "the micro-batch of that rank in the step"),
    Column(LR_SCALE, "float32", PACK, WITH_LR_SCALING, None, "learning-rate multiplier of the pack's step"),
    Column(PADDED_LEN, "int32", PACK, BATCH_MODE, None, "the length every sequence of the micro-batch is padded to"),
    Column(BATCH_SIZE, "int32", PACK, BATCH_MODE, None, "rows of padded_len tokens in the micro-batch"),
    Column(STEP_LOSS_TOKENS, "int64", PACK, WITH_STEPS, None, "loss tokens of the pack's whole optimizer step"),
    Column(STEP_LOSS_SEQUENCES, "int64", PACK, WITH_STEPS, None,
           "sequences of the step holding at least one loss token"),
    Column(SEQ_WEIGHTS, "float64", SEQUENCE, WITH_WEIGHTS, None, "the input column's weight of each sequence"),
    Column(GROUP_IDS, "int64", SEQUENCE, WITH_GROUPS, None,
           "the sample id of the first input row of the sequence's group"),
    Column(PARENT_SEGMENTS, "int32", SEQUENCE, WITH_SHARED_PREFIX, None,
           "the index in the pack of the segment a segment continues (a branch: its group's prefix), or -1"),
    Column(SEQ_STARTS, "int64", SEQUENCE, PLAN_ONLY, None,
           "a plan's only column of its own: the first token of each piece inside its sample (0 unless split); "
           "a plan has no token columns"),
    Column(SOURCE_IDS, "int32", SEQUENCE, WITH_SOURCES, None,
           "the source of each sequence: its index among the manifest's `sources` (--source, in the order given)"),
)
# Beyond these, --keep-columns C writes the input column C as it is, one value per sequence
# (`list<its input type>`), after the per-pack columns of the options (`column_order`); and
# --limit COL=N writes two columns named after COL (`limit_columns`).
COLUMN = {c.name: c for c in COLUMNS}
LIMIT_SUM_SUFFIX = "_sum"


def limit_sum_name(column: str) -> str:
    """The per-pack column of the sums of limited column `column`: images -> images_sum."""
    return column + LIMIT_SUM_SUFFIX


def limit_columns(column: str) -> tuple[Column, Column]:
    """The two output columns of `--limit COL=N`: COL per sequence (the sample's value, aligned with
    sample_ids; 0 on the pieces of a sequence cut by --too-long split, which has none) and COL_sum per
    pack (the pack's sum of COL, at most N).

        >>> [c.type_text for c in limit_columns("images")]
        ['list<int64>', 'int64']
    """
    return (Column(column, "int64", SEQUENCE, WITH_LIMITS, None,
                   "--limit COL=N: the sequence's value of the input column COL"),
            Column(limit_sum_name(column), "int64", PACK, WITH_LIMITS, None,
                   "--limit COL=N: the pack's sum of COL, at most N"))

# Format version 1's columns: those every shard holds, which a run of packs is read from (PackRows).
PACK_COLUMNS = tuple(c.name for c in COLUMNS if c.since == 1)
BALANCE_COLUMNS = (STEP, DP_RANK, MICRO_BATCH)  # where and when a pack is consumed (--dp-size)
BATCH_COLUMNS = tuple(c.name for c in COLUMNS if c.written == BATCH_MODE)  # the micro-batch's shape
# Loss normalization (docs/training.md), counted from the labels as written; the step's sums with
# --dp-size. Older version-2 outputs lack them, so readers treat them as optional.
LOSS_COLUMNS = (NUM_LOSS_TOKENS, SEQ_LOSS_TOKENS, SUM_SQ_SEQLEN)
STEP_LOSS_COLUMNS = (STEP_LOSS_TOKENS, STEP_LOSS_SEQUENCES)
# The columns a plan (`pack --plan-only`) leaves out: every column of one value per token, rebuilt
# from the source by `packctl.source.pieces` (the loader, `packctl materialize`).
TOKEN_COLUMNS = tuple(c.name for c in COLUMNS if c.per == TOKEN)
# Every column packctl itself may write (kept input columns must not reuse these names).
RESERVED_COLUMNS = tuple(COLUMN)


def column_order(names: Iterable[str], limits: Iterable[str] = ()) -> list[str]:
    """The order packctl writes the columns `names` in: the declared ones in `COLUMNS` order (the
    per-pack sums of the `limits`, in --limit order, after the declared per-pack columns), kept
    input columns (any other name), as given, then the limited columns per sequence, before the
    per-sequence columns of the options.

        >>> column_order(["group_ids", "doc_id", "step", "input_ids"])
        ['input_ids', 'step', 'doc_id', 'group_ids']
        >>> column_order(["images", "images_sum", "doc_id", "step", "input_ids"], limits=["images"])
        ['input_ids', 'step', 'images_sum', 'doc_id', 'images']
    """
    names = list(names)
    limits = [c for c in limits if c in names]
    limited = {*limits, *(limit_sum_name(c) for c in limits)}
    declared = [c for c in COLUMNS if c.name in names]
    first = [c.name for c in declared if c.written == ALWAYS or not c.is_list]
    last = [c.name for c in declared if c.name not in first]
    kept = [n for n in names if n not in COLUMN and n not in limited]
    return first + [limit_sum_name(c) for c in limits] + kept + limits + last


def __getattr__(name: str):
    # The Arrow schema loads pyarrow (0.2 s): built on first use, so the options and `--help` need
    # not import it.
    if name == "PACK_SCHEMA":
        import pyarrow as pa

        schema = pa.schema([pa.field(n, COLUMN[n].arrow_type, nullable=False) for n in PACK_COLUMNS])
        globals()[name] = schema
        return schema
    raise AttributeError(f"module 'packctl.contract.schema' has no attribute {name!r}")

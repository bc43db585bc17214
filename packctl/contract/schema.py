"""The output contract (format version 2): column names and Arrow types of a packed shard.

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
"""
from __future__ import annotations


FORMAT_VERSION = 2  # 2: OUT is a Parquet dataset (data/, _manifest.json); the columns are version 1's
METADATA_KEY = b"packctl"
IGNORE_INDEX = -100  # label of a token that carries no loss (padding, masked prompts, first tokens)
INT32_MAX = 2**31 - 1  # token ids, offsets and lengths are int32

LIST_INT32_COLUMNS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded",
                      "cu_seqlens", "cu_seqlens_padded")
# The lengths that tile input_ids again, named as TRL reads them (DataCollatorForLanguageModeling
# rebuilds position_ids from `seq_lengths`; SFTTrainer keeps input_ids, labels and seq_lengths).
# Written in every shard; format version 2 requires it (version-1 outputs may lack it).
TRL_LENGTHS_COLUMN = "seq_lengths"
BALANCE_COLUMNS = ("step", "dp_rank", "micro_batch")
# Loss normalization (docs/training.md), counted from the labels as written: per pack, the targets
# (labels != -100), the same per sequence, and sum(seq_lens**2) (attention cost). Written in every
# shard since they were added; older version-2 outputs lack them, so readers treat them as optional.
LOSS_COLUMNS = ("num_loss_tokens", "seq_loss_tokens", "sum_sq_seqlen")
# With steps (--dp-size): the targets, and the sequences holding at least one, of the pack's whole
# optimizer step over every rank and micro-batch; the same value on every pack of a step.
STEP_LOSS_COLUMNS = ("step_loss_tokens", "step_loss_sequences")
WEIGHTS_COLUMN = "seq_weights"  # --weight-column: one float64 per sequence, aligned with sample_ids
# --group-column: one int64 per sequence, aligned with sample_ids: the global sample id of the first
# input row of the sequence's group (members of a group share it; written only with --group-column)
GROUP_IDS_COLUMN = "group_ids"
# Every column packctl itself may write (kept input columns must not reuse these names).
RESERVED_COLUMNS = (*LIST_INT32_COLUMNS, "sample_ids", "num_tokens", TRL_LENGTHS_COLUMN, *BALANCE_COLUMNS,
                    "lr_scale", "padded_len", "batch_size", *LOSS_COLUMNS, *STEP_LOSS_COLUMNS, WEIGHTS_COLUMN,
                    GROUP_IDS_COLUMN)



def __getattr__(name: str):
    # The Arrow types load pyarrow (0.2 s): built on first use, so the options and `--help` need
    # not import it.
    if name in ("PACK_SCHEMA", "TRL_LENGTHS_FIELD", "LOSS_FIELDS", "STEP_LOSS_FIELDS"):
        import pyarrow as pa

        schema = pa.schema(
            [pa.field(c, pa.list_(pa.int32()), nullable=False) for c in LIST_INT32_COLUMNS]
            + [pa.field("sample_ids", pa.list_(pa.int64()), nullable=False),
               pa.field("num_tokens", pa.int32(), nullable=False)]
        )
        loss = [pa.field("num_loss_tokens", pa.int32(), nullable=False),
                pa.field("seq_loss_tokens", pa.list_(pa.int32()), nullable=False),
                pa.field("sum_sq_seqlen", pa.int64(), nullable=False)]
        step_loss = [pa.field(c, pa.int64(), nullable=False) for c in STEP_LOSS_COLUMNS]
        globals().update(PACK_SCHEMA=schema,
                         TRL_LENGTHS_FIELD=pa.field(TRL_LENGTHS_COLUMN, pa.list_(pa.int32()), nullable=False),
                         LOSS_FIELDS=pa.schema(loss), STEP_LOSS_FIELDS=pa.schema(step_loss))
        return globals()[name]
    raise AttributeError(f"module 'packctl.contract.schema' has no attribute {name!r}")

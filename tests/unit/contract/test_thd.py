"""THD row layout against packs written out by hand."""
from __future__ import annotations

import numpy as np

from packctl.contract.thd import build_pack_rows

I = -100


def test_pack_of_two_sequences_with_alignment_and_tail():
    # capacity 16, align 4: a (5 tokens) -> 8 padded, b (6 tokens) -> 8 padded; no tail
    a = np.array([11, 12, 13, 14, 15], np.int32)
    b = np.array([21, 22, 23, 24, 25, 26], np.int32)
    b_labels = np.array([I, I, 23, 24, 25, 26], np.int32)  # b's prompt masked in the source
    rows = build_pack_rows(np.array([0, 2]), np.array([5, 6]), np.array([8, 8]), np.array([7, 3]),
                           np.concatenate([a, b]), np.concatenate([a, b_labels]), np.array([16]), pad_token_id=0)
    assert rows.input_ids.tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 21, 22, 23, 24, 25, 26, 0, 0]
    assert rows.labels.tolist() == [I, 12, 13, 14, 15, I, I, I, I, I, 23, 24, 25, 26, I, I]
    assert rows.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]
    assert rows.seq_lens.tolist() == [5, 6]
    assert rows.seq_lens_padded.tolist() == [8, 8]
    assert rows.cu_seqlens.tolist() == [0, 5, 11]
    assert rows.cu_seqlens_padded.tolist() == [0, 8, 16]
    assert rows.sample_ids.tolist() == [7, 3]
    assert rows.num_tokens.tolist() == [11]


def test_tail_padding_goes_to_the_last_sequence_and_rows_are_independent():
    # two packs of length 8 (align 2): [3, 2] and [5]
    tokens = np.arange(1, 11, dtype=np.int32)
    rows = build_pack_rows(np.array([0, 2, 3]), np.array([3, 2, 5]), np.array([4, 2, 6]), np.array([0, 1, 2]),
                           tokens, tokens, np.array([8, 8]), pad_token_id=9)
    assert rows.token_offsets.tolist() == [0, 8, 16]
    assert rows.input_ids.tolist() == [1, 2, 3, 9, 4, 5, 9, 9, 6, 7, 8, 9, 10, 9, 9, 9]
    assert rows.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert rows.seq_lens_padded.tolist() == [4, 4, 8]
    assert rows.cu_offsets.tolist() == [0, 3, 5]
    assert rows.cu_seqlens.tolist() == [0, 3, 5, 0, 5]
    assert rows.cu_seqlens_padded.tolist() == [0, 4, 8, 0, 8]
    assert rows.labels.tolist() == [I, 2, 3, I, I, 5, I, I, I, 7, 8, 9, 10, I, I, I]
    assert rows.num_tokens.tolist() == [5, 5]


def test_a_plans_rows_are_the_packs_without_tokens_and_count_the_same_loss():
    """`lay_out_sequences` is `lay_out_packs` without the token columns, and `counted_loss_columns`
    from each piece's labels that are not -100 after its first (padding is -100) is `loss_columns`
    of the packed labels: labels with -100 inside, pieces cut from a sequence, tokens equal to the pad id."""
    from packctl.contract.thd import counted_loss_columns, lay_out_sequences, loss_columns

    rng = np.random.default_rng(0)
    piece_len = rng.integers(1, 9, 40)
    piece_padded = (piece_len + 3) // 4 * 4
    bin_offsets = np.array([0, 3, 4, 10, 17, 25, 40])
    pack_lens = np.add.reduceat(piece_padded, bin_offsets[:-1]) + np.array([0, 4, 0, 8, 0, 4])
    labels = rng.integers(0, 3, int(piece_len.sum())).astype(np.int32)
    labels[rng.random(len(labels)) < 0.3] = -100
    tokens = np.where(labels >= 0, labels, 0).astype(np.int32)  # many tokens equal the pad id 0
    gids = np.arange(40)
    packed = build_pack_rows(bin_offsets, piece_len, piece_padded, gids, tokens, labels, pack_lens, pad_token_id=0)
    plan = lay_out_sequences(bin_offsets, piece_len, piece_padded, gids, pack_lens)
    assert plan.input_ids is None and plan.labels is None and plan.position_ids is None
    for name in ("token_offsets", "seq_offsets", "seq_lens", "seq_lens_padded", "sample_ids", "cu_offsets",
                 "cu_seqlens", "cu_seqlens_padded", "num_tokens"):
        assert np.array_equal(getattr(plan, name), getattr(packed, name)) and \
            getattr(plan, name).dtype == getattr(packed, name).dtype, name
    starts = np.concatenate([[0], np.cumsum(piece_len)[:-1]])
    piece_loss = [int((labels[s + 1:s + n] != -100).sum()) for s, n in zip(starts, piece_len)]
    counted, expected = counted_loss_columns(plan, np.array(piece_loss)), loss_columns(packed)
    for name in ("num_loss_tokens", "seq_loss_tokens", "sum_sq_seqlen"):
        assert np.array_equal(getattr(counted, name), getattr(expected, name)), name
        assert getattr(counted, name).dtype == getattr(expected, name).dtype, name

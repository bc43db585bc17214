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

"""Decoded blocks: the compact form holds exactly the same tokens and labels."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.arrays import offsets_of
from packctl.contract.schema import IGNORE_INDEX
from packctl.source.blocks import DecodedBlock, first_outside_int32
from support.profiles import examples


def _block(lengths: list[int], vocab: int, labels: str, seed: int) -> DecodedBlock:
    rng = np.random.default_rng(seed)
    offsets = offsets_of(np.asarray(lengths, np.int64))
    tokens = rng.integers(0, vocab, int(offsets[-1])).astype(np.int32)
    if labels == "none":
        return DecodedBlock(offsets, tokens, None)
    if labels == "masked":
        return DecodedBlock(offsets, tokens, np.where(rng.random(len(tokens)) < 0.4, IGNORE_INDEX, tokens).astype(np.int32))
    shifted = np.append(tokens[1:], IGNORE_INDEX).astype(np.int32)  # labels that are not the tokens
    return DecodedBlock(offsets, tokens, shifted)


def _full_labels(block: DecodedBlock) -> np.ndarray:
    return block.tokens if block.labels is None else block.labels


@settings(max_examples=examples(150), deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
       vocab=st.sampled_from([2, 65535, 65536, 65537, 2**31 - 1]),
       labels=st.sampled_from(["none", "masked", "other"]), seed=st.integers(0, 2**16),
       data=st.data())
def test_compact_gathers_the_same_tokens_and_labels(lengths, vocab, labels, seed, data):
    block = _block(lengths, vocab, labels, seed)
    compact = block.compact()[0]
    rows = np.asarray(data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=20)))
    starts = np.array([data.draw(st.integers(0, lengths[r] - 1)) for r in rows], dtype=np.int64)
    lens = np.array([data.draw(st.integers(0, lengths[r] - s)) for r, s in zip(rows, starts)], dtype=np.int64)

    want_tokens, want_labels = block.gather(rows, starts, lens)
    got_tokens, got_labels = compact.gather(rows, starts, lens)
    np.testing.assert_array_equal(got_tokens, want_tokens)
    np.testing.assert_array_equal(got_labels, want_labels)
    assert got_tokens.dtype == got_labels.dtype == np.int32
    # the plain reference: slices of the flat arrays
    src = block.offsets[rows] + starts
    np.testing.assert_array_equal(want_tokens, np.concatenate([block.tokens[a:a + n] for a, n in zip(src, lens)]))
    np.testing.assert_array_equal(want_labels, np.concatenate([_full_labels(block)[a:a + n] for a, n in zip(src, lens)]))


@pytest.mark.parametrize("vocab, labels, dtype, form, bytes_per_token", [
    (65536, "masked", np.uint16, "bits", 2.125),
    (65537, "masked", np.int32, "bits", 4.125),
    (65536, "none", np.uint16, "none", 2.0),
    (65536, "other", np.uint16, "int32", 6.0),
])
def test_compact_form_and_size(vocab, labels, dtype, form, bytes_per_token):
    block = _block([800] * 10, vocab, labels, seed=3)
    block.tokens[0] = vocab - 1  # the largest id decides the token type
    if block.labels is not None and labels == "masked":
        block.labels[0] = block.tokens[0]
    compact = block.compact()[0]
    assert compact.tokens.dtype == dtype
    assert {"bits": compact.ignore_bits is not None and compact.labels is None,
            "none": compact.labels is None and compact.ignore_bits is None,
            "int32": compact.labels is not None}[form]
    token_bytes = compact.nbytes - compact.offsets.nbytes
    assert token_bytes == pytest.approx(bytes_per_token * len(block.tokens))


def test_gather_into_places_segments_anywhere():
    block = DecodedBlock(offsets_of(np.array([4, 2])), np.array([17, 4, 9, 9, 301, 2], np.int32),
                         np.array([IGNORE_INDEX, IGNORE_INDEX, 9, 9, 301, 2], np.int32)).compact()[0]
    assert block.ignore_bits.tolist() == [0b000011]
    tokens, labels = np.zeros(8, np.int32), np.zeros(8, np.int32)
    block.gather_into(np.array([4, 1]), np.array([2, 2]), tokens, labels, np.array([0, 5]))
    assert tokens.tolist() == [301, 2, 0, 0, 0, 4, 9, 0]
    assert labels.tolist() == [301, 2, 0, 0, 0, IGNORE_INDEX, 9, 0]


@pytest.mark.parametrize("values, allow_ignore, expected", [
    (np.array([0, 5, 2**31 - 1], np.int64), False, -1),
    (np.array([0, 2**31], np.int64), False, 1),
    (np.array([3, -100, 4], np.int32), False, 1),
    (np.array([3, -100, 4], np.int32), True, -1),
    (np.array([3, -100, -1], np.int32), True, 2),
    (np.array([1, 2**31], np.uint64), False, 1),
    (np.array([1, 2], np.uint16), True, -1),
])
def test_first_outside_int32(values, allow_ignore, expected):
    assert first_outside_int32(values, allow_ignore) == expected


def test_compact_finds_the_first_value_out_of_range():
    tokens = np.array([5, 7, -3, 2, -1], np.int32)
    labels = np.array([5, -100, -7, -2, 1], np.int32)
    _, _, bad_token, bad_label = DecodedBlock(offsets_of(np.array([5])), tokens, labels).compact()
    assert (bad_token, bad_label) == (2, 2)
    _, _, bad_token, bad_label = DecodedBlock(offsets_of(np.array([5])), np.abs(tokens), labels).compact()
    assert (bad_token, bad_label) == (-1, 2)
    fine = DecodedBlock(offsets_of(np.array([2])), np.array([1, 2], np.int32), np.array([-100, 2], np.int32))
    assert fine.compact()[2:] == (-1, -1)


def test_compact_counts_tokens_equal_to_the_pad_id():
    block = DecodedBlock(offsets_of(np.array([4])), np.array([0, 3, 0, 0], np.int32), None)
    assert block.compact(0)[1] == 3
    assert block.compact(7)[1] == 0
    assert block.compact()[1] == 0

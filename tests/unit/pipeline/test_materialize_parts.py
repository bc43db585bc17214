"""pipeline/materialize.py without a pack: the names of shared shards' parts, the choice between
reading and exchanging tokens, the one-Alltoallv payload of tokens and labels, and the buckets
that hold (or spill) a unit's tokens until the unit is complete."""
from __future__ import annotations

import errno

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.errors import PackctlError
from packctl.pipeline import materialize
from packctl.pipeline.materialize import (READ_AMPLIFICATION_LIMIT, READ_AMPLIFICATION_LIMIT_INPUT_ORDER, _Bucket,
                                          _deinterleave, _interleave, choose_read_own, run_part_name)
from support.profiles import examples


def test_a_shared_shards_part_is_hidden_beside_the_shard():
    assert run_part_name("data/train-00003.parquet", 128) == "data/.train-00003.parquet.from-00128"
    assert run_part_name("train-00000.parquet", 7) == "/.train-00000.parquet.from-00007"


@pytest.mark.parametrize("transfer, amplification, order, ranks, reads", [
    ("auto", 1.0, "input", 1, False),        # one rank has no one to exchange with
    ("read", 50.0, "shuffle", 1, False),
    ("exchange", 1.0, "input", 4, False),
    ("read", 50.0, "shuffle", 4, True),
    ("auto", READ_AMPLIFICATION_LIMIT, "shuffle", 4, True),
    ("auto", READ_AMPLIFICATION_LIMIT + 0.01, "shuffle", 4, False),
    ("auto", READ_AMPLIFICATION_LIMIT_INPUT_ORDER, "input", 4, True),
    ("auto", READ_AMPLIFICATION_LIMIT_INPUT_ORDER + 0.01, "input", 4, False),
])
def test_token_transfer_reads_only_where_reading_costs_little(transfer, amplification, order, ranks, reads):
    assert choose_read_own(transfer, amplification, order, ranks) is reads


def test_the_payload_carries_each_destinations_tokens_then_its_labels():
    tokens, labels = np.array([1, 2, 3], np.int32), np.array([-100, 20, 30], np.int32)
    payload = _interleave(tokens, labels, np.array([0, 2, 3]))
    assert payload.tolist() == [1, 2, -100, 20, 3, 30]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 2 ** 31 - 1))
def test_deinterleave_undoes_interleave(counts, seed):
    rng = np.random.default_rng(seed)
    cuts = np.concatenate([[0], np.cumsum(counts)])
    tokens = rng.integers(0, 1000, cuts[-1]).astype(np.int32)
    labels = rng.integers(-100, 1000, cuts[-1]).astype(np.int32)
    got_tokens, got_labels = _deinterleave(_interleave(tokens, labels, cuts), cuts)
    assert np.array_equal(got_tokens, tokens) and np.array_equal(got_labels, labels)


def _part(first: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pieces = np.arange(first, first + n, dtype=np.int64)
    return pieces, (pieces * 10).astype(np.int32), (pieces * 10 + 1).astype(np.int32)


def test_a_bucket_gives_back_what_it_was_given_in_order_spilled_parts_after_held_ones(tmp_path):
    bucket = _Bucket()
    assert bucket.add(*_part(0, 3)) == 3 * (8 + 4 + 4)
    bucket.add(*_part(3, 2))
    assert bucket.spill(tmp_path / "spill" / "u0-0.npy") == 5 * 16 and bucket.nbytes == 0
    bucket.add(*_part(5, 1))
    pieces, tokens, labels = bucket.collect()
    assert pieces.tolist() == [5, 0, 1, 2, 3, 4]  # the held part first, then the spills in order
    assert tokens.tolist() == [p * 10 for p in pieces] and labels.tolist() == [p * 10 + 1 for p in pieces]
    assert list((tmp_path / "spill").iterdir()) == []  # read back, removed


def test_a_spill_on_a_full_disk_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    saved, real_save = [], np.save

    def save(fh, array, allow_pickle):  # the first array written, then the disk is full
        if saved:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "spill" / "u0-0.npy"))
        saved.append(real_save(fh, array, allow_pickle=allow_pickle))

    bucket = _Bucket()
    bucket.add(*_part(0, 2))
    monkeypatch.setattr(materialize.np, "save", save)
    with pytest.raises(PackctlError) as raised:
        bucket.spill(tmp_path / "spill" / "u0-0.npy")
    monkeypatch.undo()
    assert "\n" not in str(raised.value) and "raise --memory-budget (less is spilled)" in str(raised.value)
    assert list((tmp_path / "spill").iterdir()) == []
    assert bucket.nbytes == 32 and bucket.spill_files == []  # nothing lost: still held
    assert bucket.collect()[0].tolist() == [0, 1]


def test_a_spill_cut_short_is_refused_naming_the_file(tmp_path):
    bucket = _Bucket()
    bucket.add(*_part(0, 4))
    path = tmp_path / "spill" / "u0-0.npy"
    bucket.spill(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(PackctlError, match="cannot read back tokens spilled by this run"):
        bucket.collect()

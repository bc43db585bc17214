"""packctl.source.megatron: Megatron's IndexedDataset read as written by megatron-core's own
IndexedDatasetBuilder (every dtype, documents of several sequences, empty documents, multimodal),
the checks of its layout, its blocks, its fingerprint, and its resolution as an INPUT."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from packctl.errors import PackctlError
from packctl.source import megatron
from packctl.source.megatron import decode_documents, document_lengths, open_pair, read_document
from packctl.source.resolve import resolve
from support.megatron import build_with_megatron, random_documents, write_pair, write_twin

DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64]
DOCUMENTS = [[[5, 6, 7], [8, 9]], [[1, 2, 3, 4]], [[10], [11], [12]]]


def joined(documents) -> list[list[int]]:
    return [[t for s in d for t in s] for d in documents]


def decoded_rows(idx: Path, skip_empty: bool = False) -> list[list[int]]:
    with open_pair(str(idx)) as pair:
        count = pair.header.documents
    block = decode_documents(str(idx), 0, count, skip_empty=skip_empty)
    assert block.tokens.dtype == np.int32 and block.labels is None and block.offsets[0] == 0
    return [block.tokens[a:b].tolist() for a, b in zip(block.offsets[:-1], block.offsets[1:])]


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_megatron_writes_reads_back_document_by_document(tmp_path, dtype):
    high = min(int(np.iinfo(dtype).max), 60000)
    documents = random_documents(7, 40, high=high)
    idx = build_with_megatron(tmp_path / "c", documents, dtype)
    assert decoded_rows(idx) == joined(documents)
    assert document_lengths(str(idx)).tolist() == [len(r) for r in joined(documents)]
    assert read_document(str(idx), 3).tolist() == joined(documents)[3]


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("multimodal", [False, True])
def test_the_test_writer_writes_megatrons_bytes(tmp_path, dtype, multimodal):
    """tests/support/megatron.py write_pair: byte for byte what megatron-core writes, so the
    adversarial tests' tiny inputs are Megatron's."""
    documents = random_documents(3, 12, high=100, empty=0.2)
    modes = [[0] * len(d) for d in documents] if multimodal else None
    build_with_megatron(tmp_path / "m", documents, dtype, multimodal=multimodal, modes=modes)
    write_pair(tmp_path / "w", documents, dtype, modes=modes)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"m{suffix}").read_bytes() == (tmp_path / f"w{suffix}").read_bytes()


@pytest.mark.torch
def test_empty_documents_are_refused_or_kept_at_length_zero(tmp_path):
    documents = [[[1, 2]], [], [[3]], [[]], [[4, 5]]]  # no sequence, and a sequence of no tokens
    idx = build_with_megatron(tmp_path / "c", documents)
    with pytest.raises(PackctlError, match=r"c\.idx document 1: empty document \(no tokens\); .*--skip-empty"):
        decoded_rows(idx)
    assert decoded_rows(idx, skip_empty=True) == [[1, 2], [], [3], [], [4, 5]]
    assert document_lengths(str(idx)).tolist() == [2, 0, 1, 0, 2]


@pytest.mark.torch
def test_a_dataset_of_no_documents(tmp_path):
    idx = build_with_megatron(tmp_path / "c", [])
    assert document_lengths(str(idx)).tolist() == []
    with pytest.raises(PackctlError, match="holds no documents"):
        megatron.index_inputs(resolve([str(idx)]), "input_ids")


@pytest.mark.torch
def test_multimodal_text_sequences_are_read_and_other_modes_refused(tmp_path):
    documents = [[[1, 2], [3]], [[4]], [[5, 6]]]
    text = build_with_megatron(tmp_path / "t", documents, multimodal=True, modes=[[0, 0], [0], [0]])
    assert decoded_rows(text) == [[1, 2, 3], [4], [5, 6]]
    mixed = build_with_megatron(tmp_path / "m", documents, multimodal=True, modes=[[0, 0], [0], [1]])
    with pytest.raises(PackctlError, match=r"m\.idx document 2: sequence 3 has mode 1 \(not text\)"):
        decoded_rows(mixed)


@pytest.mark.torch
def test_a_plans_scan_reads_lengths_and_checks_from_the_idx_alone(tmp_path, monkeypatch):
    """`scan_lengths` (pack --plan-only): the lengths decoding gives, over blocks of several pairs,
    the same refusals of what the .idx shows, and no read of the .bin."""
    from packctl.source.kinds import InputOptions
    from packctl.source.scan import index_inputs, scan_blocks

    for k, dtype in enumerate((np.uint16, np.int64)):
        build_with_megatron(tmp_path / "d" / f"p{k}", random_documents(k, 50, max_length=30, empty=0.1), dtype)
    monkeypatch.setattr(megatron, "BLOCK_DOCUMENTS", 7)  # blocks of 7 documents
    index = index_inputs(resolve([str(tmp_path / "d")]), InputOptions())
    assert len(index.blocks) > 10
    decoded, _ = scan_blocks(index, range(3, len(index.blocks) - 2), 1 << 20, skip_empty=True)

    def no_tokens(*args, **kwargs):
        raise AssertionError("the .bin was read")
    monkeypatch.setattr(megatron.IndexedPair, "tokens", no_tokens)
    scanned = megatron.scan_lengths(index, 3, len(index.blocks) - 2, skip_empty=True)
    assert scanned.gid_lo == decoded.gid_lo and scanned.lengths.tolist() == decoded.lengths.tolist()
    assert scanned.loss_tokens.tolist() == np.maximum(decoded.lengths - 1, 0).tolist()
    with pytest.raises(PackctlError, match=r"p0\.idx document \d+: empty document"):
        megatron.scan_lengths(index, 0, len(index.blocks))
    mixed = build_with_megatron(tmp_path / "m" / "m", [[[1, 2], [3]], [[4]], [[5, 6]]], multimodal=True,
                                modes=[[0, 0], [0], [1]])
    index = megatron.index_inputs(resolve([str(mixed)]), "input_ids")
    with pytest.raises(PackctlError, match=r"m\.idx document 2: sequence 3 has mode 1 \(not text\)"):
        megatron.scan_lengths(index, 0, len(index.blocks))


@pytest.mark.torch
@pytest.mark.parametrize("dtype, value", [(np.int8, -3), (np.int16, -1), (np.int32, -7), (np.int64, 2**31),
                                          (np.int64, -2**40)])
def test_token_ids_outside_int32_are_refused_naming_the_document(tmp_path, dtype, value):
    idx = build_with_megatron(tmp_path / "c", [[[1, 2]], [[3], [4, value, 5]]], dtype)
    with pytest.raises(PackctlError, match=rf"c\.bin document 1: token id {value} at position 2 is outside "
                                           r"\[0, 2147483647\]; .*tokenize"):
        decoded_rows(idx)


# --- a damaged .idx or .bin -------------------------------------------------------------------------

def damaged(tmp_path: Path, change) -> Path:
    idx = write_pair(tmp_path / "c", DOCUMENTS)
    change(idx, idx.with_suffix(".bin"))
    return idx


def patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


DAMAGE = {
    "wrong magic": (lambda idx, b: patch(idx, 0, b"NOTANIDX\0"), r"c\.idx: not a Megatron index \(no MMIDIDX magic"),
    "too small": (lambda idx, b: idx.write_bytes(b"MMID"), r"c\.idx: not a Megatron index \(4 bytes, too small\)"),
    "version 2": (lambda idx, b: patch(idx, 9, struct.pack("<Q", 2)), r"c\.idx: Megatron index version 2; packctl "
                                                                       r"reads version 1"),
    "dtype code 9": (lambda idx, b: patch(idx, 17, b"\x09"), r"c\.idx: unknown token dtype code 9"),
    "float32 tokens": (lambda idx, b: patch(idx, 17, b"\x07"), r"c\.idx: tokens are float32; token ids must be "
                                                                r"integers"),
    "truncated .idx": (lambda idx, b: idx.write_bytes(idx.read_bytes()[:-5]), r"c\.idx: \d+ bytes, but its header "
                                                                               r"\(6 sequences, 3 documents\)"),
    "truncated .bin": (lambda idx, b: b.write_bytes(b.read_bytes()[:-4]), r"c\.bin: 44 bytes, but .*c\.idx says its "
                                                                           r"tokens end at byte 48"),
    "longer .bin": (lambda idx, b: b.write_bytes(b.read_bytes() + b"\0" * 4), r"c\.bin: 52 bytes"),
    "pointer past the end": (lambda idx, b: patch(idx, 34 + 24 + 40, struct.pack("<q", 400)),
                             r"c\.bin: 48 bytes, but .* tokens end at byte 404"),
    "document index not from 0": (lambda idx, b: patch(idx, 34 + 72, struct.pack("<q", 1)),
                                  r"document index runs from sequence 1 to 6"),
    "sequences after the last document": (lambda idx, b: patch(idx, 34 + 72 + 24, struct.pack("<q", 5)),
                                          r"runs from sequence 0 to 5, not from 0 to its 6 sequences"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_pair_is_refused_naming_the_file(tmp_path, case):
    change, message = DAMAGE[case]
    idx = damaged(tmp_path, change)
    with pytest.raises(PackctlError, match=message):
        resolve([str(idx)])


def test_sequences_not_back_to_back_are_refused_naming_the_document(tmp_path):
    """Pointers that skip bytes inside the file (the ends still agree): found where the block is read."""
    idx = damaged(tmp_path, lambda idx, b: patch(idx, 34 + 24 + 8 * 3, struct.pack("<q", 24)))
    with pytest.raises(PackctlError, match=r"c\.idx document 2: sequence 3 has length 1 at byte 24 of .*c\.bin, "
                                           r"where the sequences before it end at byte 36"):
        decoded_rows(idx)
    with pytest.raises(PackctlError, match=r"c\.idx document 2: sequence 3"):
        document_lengths(str(idx))


def test_a_decreasing_document_index_is_refused(tmp_path):
    idx = damaged(tmp_path, lambda idx, b: patch(idx, 34 + 72 + 8, struct.pack("<q", 4)))
    with pytest.raises(PackctlError, match=r"c\.idx document 1: the document index goes from sequence 4 to 3"):
        decoded_rows(idx)


# --- blocks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_tokens, block_documents", [(16, 1000), (1, 1000), (1000, 3), (40, 7), (10**9, 10**9)])
def test_blocks_cover_every_document_once_and_cut_by_tokens_and_documents(tmp_path, monkeypatch, block_tokens,
                                                                          block_documents):
    monkeypatch.setattr(megatron, "BLOCK_TOKENS", block_tokens)
    monkeypatch.setattr(megatron, "BLOCK_DOCUMENTS", block_documents)
    documents = random_documents(5, 30, max_length=12)
    idx = write_pair(tmp_path / "c", documents)
    index = megatron.index_inputs(resolve([str(idx)]), "input_ids")
    lengths = [len(r) for r in joined(documents)]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert [b.first_row for b in index.blocks] == list(np.cumsum([0] + [b.rows for b in index.blocks])[:-1])
    assert sum(b.rows for b in index.blocks) == len(documents) and all(b.rows > 0 for b in index.blocks)
    # a block starts at every multiple of block_documents, and at the first document (after the
    # first) that starts at or after each multiple of block_tokens
    cuts = {0, *range(block_documents, len(documents), block_documents)}
    for target in range(block_tokens, int(starts[-1]), block_tokens):
        cuts.add(next((d for d in range(1, len(documents)) if starts[d] >= target), len(documents)))
    assert [b.first_row for b in index.blocks] == sorted(cuts - {len(documents)})
    for b in index.blocks:
        assert b.rows <= block_documents
        tokens = int(starts[b.first_row + b.rows] - starts[b.first_row])
        assert b.nbytes == 4 * tokens + 8 * (b.rows + 1)
        decoded = decode_documents(str(idx), b.first_row, b.rows)
        assert np.diff(decoded.offsets).tolist() == lengths[b.first_row:b.first_row + b.rows]


# --- fingerprint ---------------------------------------------------------------------------------

def test_every_later_open_checks_the_fingerprint(tmp_path):
    idx = write_pair(tmp_path / "c", DOCUMENTS)
    bin_ = idx.with_suffix(".bin")
    fingerprint = resolve([str(idx)]).files[0].fingerprint
    assert fingerprint.size == idx.stat().st_size + bin_.stat().st_size
    assert decoded_rows(idx) == joined(DOCUMENTS)
    decode_documents(str(idx), 0, 3, expected=fingerprint)
    # the same size, another token: the modification time tells
    st = bin_.stat()
    patch(bin_, 0, struct.pack("<i", 99))
    os.utime(bin_, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    with pytest.raises(PackctlError, match=r"c\.bin: changed while packctl was reading it \(its modification time"):
        decode_documents(str(idx), 0, 3, expected=fingerprint)
    write_pair(tmp_path / "c", DOCUMENTS + [[[1]]])
    with pytest.raises(PackctlError, match=r"c\.idx: changed while packctl was reading it \(its size went from"):
        decode_documents(str(idx), 0, 3, expected=fingerprint)
    idx.unlink()
    with pytest.raises(PackctlError, match=r"c\.idx: changed while packctl was reading it \(it was removed"):
        document_lengths(str(idx), fingerprint)


def test_a_pair_rewritten_with_sizes_and_times_kept_is_known_by_its_ends(tmp_path):
    """Sequences [1 2] [3] rewritten as [1] [2 3]: the same sizes, the times put back; the last
    sequence's length and pointer differ."""
    idx = write_pair(tmp_path / "c", [[[1, 2], [3]]])
    fingerprint = resolve([str(idx)]).files[0].fingerprint
    times = {p: p.stat() for p in (idx, idx.with_suffix(".bin"))}
    write_pair(tmp_path / "c", [[[1], [2, 3]]])
    for path, st in times.items():
        assert path.stat().st_size == st.st_size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(PackctlError, match=r"c\.idx: changed while packctl was reading it \(its header or document "
                                           "index differs"):
        decode_documents(str(idx), 0, 1, expected=fingerprint)


# --- resolution ----------------------------------------------------------------------------------

@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("spec", ["data/c.idx", "data/c.bin", "data/c", "./data/c", "data", "data/*", "data/*.idx",
                                  "data/*.bin", "data/**"])
def test_every_spelling_of_a_pair_is_one_input_recorded_by_its_idx(here, spec):
    write_pair(here / "data/c", DOCUMENTS)
    resolution = resolve([spec])
    assert resolution.paths == ["data/c.idx"]


def test_pairs_sort_by_path_like_parquet_files(here):
    for name in ("b", "a", "sub/c"):
        write_pair(here / "data" / name, DOCUMENTS)
    assert resolve(["data"]).paths == ["data/a.idx", "data/b.idx", "data/sub/c.idx"]


@pytest.mark.parametrize("present, missing, this", [("c.bin", "c.idx", "data file"), ("c.idx", "c.bin", "index")])
def test_a_lone_half_of_a_pair_is_refused_naming_the_missing_file(here, present, missing, this):
    write_pair(here / "data/c", DOCUMENTS)
    (here / "data" / missing).unlink()
    for spec in (f"data/{present}", "data", "data/c", "data/*"):
        with pytest.raises(PackctlError, match=rf"data/{present}: a Megatron {this} without its .* data/{missing}; "
                                               rf"packctl reads .bin/.idx pairs: restore data/{missing}"):
            resolve([spec])


def test_parquet_and_megatron_in_one_run_are_refused(here):
    write_pair(here / "data/c", DOCUMENTS)
    write_twin(here / "data/a.parquet", DOCUMENTS)
    with pytest.raises(PackctlError, match=r"data/a.parquet: a Parquet input beside the Megatron input data/c.idx; "
                                           "one run packs one kind of input"):
        resolve(["data"])


def test_a_hard_linked_pair_is_refused(here):
    write_pair(here / "data/c", DOCUMENTS)
    os.link(here / "data/c.bin", here / "data/d.bin")
    os.link(here / "data/c.idx", here / "data/d.idx")
    with pytest.raises(PackctlError, match=r"data/d.bin: the same file as data/c.bin \(hard links"):
        resolve(["data"])


def test_a_symlinked_prefix_is_read_and_a_second_link_to_it_refused(here):
    write_pair(here / "real/c", DOCUMENTS)
    (here / "data").mkdir()
    for suffix in (".bin", ".idx"):
        os.symlink(here / f"real/c{suffix}", here / f"data/link{suffix}")
    assert resolve(["data/link"]).paths == ["data/link.idx"]
    assert decoded_rows(Path("data/link.idx")) == joined(DOCUMENTS)
    with pytest.raises(PackctlError, match="the same file as"):
        resolve(["data", "real"])

"""Bin-packing algorithms: invariants of every algorithm, and exact agreement with small textbook
implementations written here in plain Python (one obvious loop each, no data structures)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.plan.algorithms import ALGORITHMS, KERNELS, Bins, pack_lengths
from support.profiles import examples

WHOLE_ITEM_ALGORITHMS = tuple(name for name, kernel in KERNELS.items() if not kernel.cuts_items)
SETTINGS = settings(max_examples=examples(150), deadline=None, derandomize=True)


# --- plain-Python references ----------------------------------------------------------------------

def decreasing(lengths):
    """Indices by length descending, ties by index ascending."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def reference_concat(lengths, capacity, max_seqs):
    bins = []
    for i, length in enumerate(lengths):
        if bins and sum(lengths[j] for j in bins[-1]) + length <= capacity and len(bins[-1]) < max_seqs:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def reference_first_fit(lengths, order, capacity, max_seqs):
    bins = []
    for i in order:
        for members in bins:
            if sum(lengths[j] for j in members) + lengths[i] <= capacity and len(members) < max_seqs:
                members.append(i)
                break
        else:
            bins.append([i])
    return bins


def reference_best_fit(lengths, order, capacity, max_seqs):
    """Best fit with packctl's tie rule: among bins with the smallest sufficient room, the one that
    has had that room the longest (its last change is the oldest)."""
    bins, last_changed = [], []
    for step, i in enumerate(order):
        fitting = [b for b, members in enumerate(bins)
                   if sum(lengths[j] for j in members) + lengths[i] <= capacity and len(members) < max_seqs]
        if fitting:
            b = min(fitting, key=lambda b: (capacity - sum(lengths[j] for j in bins[b]), last_changed[b]))
            bins[b].append(i)
            last_changed[b] = step
        else:
            bins.append([i])
            last_changed.append(step)
    return bins


def reference_mffd(lengths, capacity, max_seqs):
    """Johnson & Garey's MFFD, phase by phase. "Larger" means earlier in the decreasing order."""
    rank = {i: k for k, i in enumerate(decreasing(lengths))}
    by_size = decreasing(lengths)
    large = [i for i in by_size if 2 * lengths[i] > capacity]
    medium = [i for i in by_size if 3 * lengths[i] > capacity >= 2 * lengths[i]]
    small = [i for i in by_size if 6 * lengths[i] > capacity >= 3 * lengths[i]]
    unpacked = set(by_size) - set(large)
    bins = [[i] for i in large]

    def room(b):
        return capacity - sum(lengths[j] for j in bins[b])

    def put(b, i):
        bins[b].append(i)
        unpacked.remove(i)

    with_medium = set()
    for b in range(len(bins)):  # phase 2
        fitting = [i for i in medium if i in unpacked and lengths[i] <= room(b)]
        if fitting and len(bins[b]) < max_seqs:
            put(b, min(fitting, key=rank.get))
            with_medium.add(b)
    for b in reversed(range(len(bins))):  # phase 3
        smalls = [i for i in small if i in unpacked]
        if b in with_medium or len(bins[b]) + 2 > max_seqs or len(smalls) < 2:
            continue
        if lengths[smalls[-1]] + lengths[smalls[-2]] > room(b):
            continue
        put(b, smalls[-1])
        put(b, min((i for i in smalls[:-1] if lengths[i] <= room(b)), key=rank.get))
    for b in range(len(bins)):  # phase 4
        while len(bins[b]) < max_seqs:
            fitting = [i for i in unpacked if lengths[i] <= room(b)]
            if not fitting:
                break
            put(b, min(fitting, key=rank.get))
    return bins + reference_first_fit(lengths, sorted(unpacked, key=rank.get), capacity, max_seqs)


def reference_split(lengths, capacity, align, max_seqs):
    """Bins as lists of (item, start, length)."""
    bins = [[]]
    for item, length in enumerate(lengths):
        start = 0
        while start < length:
            current = bins[-1]
            room = capacity - sum(piece[2] for piece in current)
            rest = length - start
            if len(current) < max_seqs and rest <= room:
                current.append((item, start, rest))
                start = length
            elif len(current) < max_seqs and room >= align:
                piece = room - room % align
                current.append((item, start, piece))
                start += piece
            else:
                bins.append([])
    return [b for b in bins if b]


def as_lists(bins: Bins):
    return [bins.members[bins.offsets[b]:bins.offsets[b + 1]].tolist() for b in range(bins.num_bins)]


def lengths_of_bins(lengths, bins: Bins):
    return [[lengths[i] for i in members] for members in as_lists(bins)]


def as_pieces(bins: Bins):
    return [list(zip(bins.members[bins.offsets[b]:bins.offsets[b + 1]].tolist(),
                     bins.starts[bins.offsets[b]:bins.offsets[b + 1]].tolist(),
                     bins.lens[bins.offsets[b]:bins.offsets[b + 1]].tolist()))
            for b in range(bins.num_bins)]


# --- invariants -----------------------------------------------------------------------------------

def check_invariants(lengths, capacity, bins: Bins, max_seqs_per_bin=None):
    """Every item covered exactly once, in order; no bin over capacity, over the sequence limit or
    empty; no fewer bins than the token count allows; loads() consistent."""
    lengths = np.asarray(lengths, dtype=np.int64)
    for array in (bins.offsets, bins.members, bins.starts, bins.lens):
        assert array.dtype == np.int64
    assert bins.offsets[0] == 0 and bins.offsets[-1] == len(bins.members)
    assert len(bins.members) == len(bins.starts) == len(bins.lens)
    sizes = np.diff(bins.offsets)
    assert (sizes >= 1).all(), "empty bin"
    if max_seqs_per_bin is not None:
        assert (sizes <= max_seqs_per_bin).all()
    assert (bins.lens >= 1).all()
    assert (bins.loads() <= capacity).all()
    assert np.array_equal(bins.loads(), [int(bins.lens[bins.offsets[b]:bins.offsets[b + 1]].sum())
                                         for b in range(bins.num_bins)])
    total = int(lengths.sum())
    assert bins.num_bins >= math.ceil(total / capacity)
    # Pieces of each item, in pack order, tile [0, length) from left to right.
    covered = np.zeros(len(lengths), dtype=np.int64)
    for member, start, piece in zip(bins.members.tolist(), bins.starts.tolist(), bins.lens.tolist()):
        assert start == covered[member], f"item {member}: piece at {start}, expected {covered[member]}"
        covered[member] += piece
    assert np.array_equal(covered, lengths)


def assert_same_bins(a: Bins, b: Bins):
    for name in ("offsets", "members", "starts", "lens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@st.composite
def packing_inputs(draw, longer_than_capacity=False):
    capacity = draw(st.integers(1, 40))
    top = 3 * capacity if longer_than_capacity else capacity
    lengths = draw(st.lists(st.integers(1, top), max_size=40))
    max_seqs = draw(st.one_of(st.none(), st.integers(1, 6)))
    return lengths, capacity, max_seqs


# --- properties -----------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", WHOLE_ITEM_ALGORITHMS)
@SETTINGS
@given(data=packing_inputs())
def test_invariants_and_determinism(algorithm, data):
    lengths, capacity, max_seqs = data
    bins = pack_lengths(lengths, capacity, algorithm, max_seqs_per_bin=max_seqs, seed=7)
    check_invariants(lengths, capacity, bins, max_seqs)
    assert (bins.starts == 0).all()
    assert np.array_equal(bins.lens, np.asarray(lengths, dtype=np.int64)[bins.members])
    assert_same_bins(bins, pack_lengths(np.array(lengths), capacity, algorithm, max_seqs_per_bin=max_seqs, seed=7))


@SETTINGS
@given(data=packing_inputs(), align=st.sampled_from([1, 2, 4, 8]))
def test_split_invariants_and_reference(data, align):
    lengths, capacity, max_seqs = data
    capacity *= align
    lengths = [length * align for length in lengths]  # the caller pads to the alignment
    bins = pack_lengths(lengths, capacity, "split", max_seqs_per_bin=max_seqs, align=align)
    check_invariants(lengths, capacity, bins, max_seqs)
    assert as_pieces(bins) == reference_split(lengths, capacity, align, max_seqs or len(lengths) + 1)
    if max_seqs is None and lengths:
        # Without a sequence limit nothing is wasted: every bin but the last is exactly full.
        assert (bins.loads()[:-1] == capacity).all()
        assert bins.num_bins == math.ceil(sum(lengths) / capacity)


@SETTINGS
@given(data=packing_inputs(longer_than_capacity=True), align=st.sampled_from([1, 3, 4]))
def test_split_unpadded_lengths_cut_at_align_multiples(data, align):
    lengths, capacity, max_seqs = data
    capacity *= align
    bins = pack_lengths(lengths, capacity, "split", max_seqs_per_bin=max_seqs, align=align)
    check_invariants(lengths, capacity, bins, max_seqs)
    assert (bins.starts % align == 0).all()
    last_piece = bins.starts + bins.lens == np.asarray(lengths, dtype=np.int64)[bins.members]
    assert (bins.lens[~last_piece] % align == 0).all()
    assert as_pieces(bins) == reference_split(lengths, capacity, align, max_seqs or len(lengths) + 1)


@SETTINGS
@given(data=packing_inputs())
def test_concat_matches_reference(data):
    lengths, capacity, max_seqs = data
    bins = pack_lengths(lengths, capacity, "concat", max_seqs_per_bin=max_seqs)
    assert as_lists(bins) == reference_concat(lengths, capacity, max_seqs or len(lengths) + 1)


@SETTINGS
@given(data=packing_inputs())
def test_ffd_matches_reference(data):
    lengths, capacity, max_seqs = data
    bins = pack_lengths(lengths, capacity, "ffd", max_seqs_per_bin=max_seqs)
    expected = reference_first_fit(lengths, decreasing(lengths), capacity, max_seqs or len(lengths) + 1)
    assert as_lists(bins) == expected


@SETTINGS
@given(data=packing_inputs(), seed=st.integers(0, 2**32))
def test_ffs_matches_reference(data, seed):
    lengths, capacity, max_seqs = data
    bins = pack_lengths(lengths, capacity, "ffs", max_seqs_per_bin=max_seqs, seed=seed)
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    assert as_lists(bins) == reference_first_fit(lengths, order, capacity, max_seqs or len(lengths) + 1)


@SETTINGS
@given(data=packing_inputs())
def test_bfd_matches_reference(data):
    lengths, capacity, max_seqs = data
    limit = max_seqs or len(lengths) + 1
    bins = pack_lengths(lengths, capacity, "bfd", max_seqs_per_bin=max_seqs)
    expected = reference_best_fit(lengths, decreasing(lengths), capacity, limit)
    assert bins.num_bins == len(expected)
    assert as_lists(bins) == expected


@SETTINGS
@given(data=packing_inputs())
def test_bfd_is_best_fit(data):
    """Replaying the bins' insertion order: every item went to a fitting bin with the least room."""
    lengths, capacity, max_seqs = data
    limit = max_seqs or len(lengths) + 1
    bins = pack_lengths(lengths, capacity, "bfd", max_seqs_per_bin=max_seqs)
    bin_of = {m: b for b, members in enumerate(as_lists(bins)) for m in members}
    loads, counts, opened = [0] * bins.num_bins, [0] * bins.num_bins, 0
    for i in decreasing(lengths):
        rooms = [capacity - loads[b] for b in range(opened) if counts[b] < limit and loads[b] + lengths[i] <= capacity]
        b = bin_of[i]
        if rooms:
            assert b < opened and capacity - loads[b] == min(rooms)
        else:
            assert b == opened
            opened += 1
        loads[b] += lengths[i]
        counts[b] += 1


@SETTINGS
@given(data=packing_inputs())
def test_mffd_matches_reference(data):
    lengths, capacity, max_seqs = data
    bins = pack_lengths(lengths, capacity, "mffd", max_seqs_per_bin=max_seqs)
    assert as_lists(bins) == reference_mffd(lengths, capacity, max_seqs or len(lengths) + 1)


def random_windows(count, seed):
    """Seeded random inputs from three shapes (uniform, heavy-tailed, mostly between C/8 and C/2,
    where MFFD's size classes all show up), with and without a sequence limit."""
    rng = np.random.default_rng(seed)
    for case in range(count):
        capacity = int(rng.integers(1, 120))
        n = int(rng.integers(0, 120))
        if case % 3 == 0:
            lengths = rng.integers(1, capacity + 1, n)
        elif case % 3 == 1:
            lengths = np.minimum(rng.zipf(1.5, n) * max(1, capacity // 20), capacity)
        else:
            lengths = rng.integers(max(1, capacity // 8), capacity // 2 + 2, n).clip(1, capacity)
        max_seqs = None if case % 2 else int(rng.integers(1, 8))
        yield lengths.tolist(), capacity, max_seqs


REFERENCES = {
    "concat": lambda lengths, capacity, limit: reference_concat(lengths, capacity, limit),
    "ffd": lambda lengths, capacity, limit: reference_first_fit(lengths, decreasing(lengths), capacity, limit),
    "bfd": lambda lengths, capacity, limit: reference_best_fit(lengths, decreasing(lengths), capacity, limit),
    "mffd": reference_mffd,
}


@pytest.mark.parametrize("algorithm", sorted(REFERENCES))
def test_reference_agreement_on_random_windows(algorithm):
    for lengths, capacity, max_seqs in random_windows(300, seed=len(algorithm)):
        bins = pack_lengths(lengths, capacity, algorithm, max_seqs_per_bin=max_seqs)
        check_invariants(lengths, capacity, bins, max_seqs)
        assert as_lists(bins) == REFERENCES[algorithm](lengths, capacity, max_seqs or len(lengths) + 1), (
            lengths, capacity, max_seqs)


def test_mffd_respects_the_sequence_limit_in_the_pair_pass():
    # Capacity 20: the 11-bin has room for the pair 4 + 4, but not under a limit of 2 sequences;
    # phase 4 then adds one 4 and phase 5 opens a bin for the other.
    lengths = [11, 4, 4]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 20, "mffd")) == [[11, 4, 4]]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 20, "mffd", max_seqs_per_bin=2)) == [[11, 4], [4]]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 20, "mffd", max_seqs_per_bin=1)) == [[11], [4], [4]]


@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "mffd"])
def test_capacity_much_larger_than_item_count(algorithm):
    # Few items, huge capacity: the decreasing order comes from a comparison sort, not counting.
    lengths = [700_000, 300_000, 999_999, 1, 300_000, 5]
    capacity = 1_000_000
    bins = pack_lengths(lengths, capacity, algorithm)
    check_invariants(lengths, capacity, bins)
    assert as_lists(bins) == REFERENCES[algorithm](lengths, capacity, 99)


def test_mffd_phases_on_a_worked_example():
    # Capacity 12: large >= 7, medium 5..6, small 3..4, tiny <= 2.
    lengths = [7, 8, 9, 4, 3, 3, 5, 2, 1, 6]
    # Phase 1: [9] [8] [7]. Phase 2 (forward): only the 7-bin (room 5) has room for a medium: 5.
    # Phase 3 (backward over bins without a medium): the two smallest smalls (3 + 3) fit neither the
    # 8-bin (room 4) nor the 9-bin (room 3). Phase 4 (forward, largest that fits): the 9-bin takes 3,
    # the 8-bin 4. Phase 5: first fit decreasing for 6, 3, 2, 1.
    bins = pack_lengths(lengths, 12, "mffd")
    assert lengths_of_bins(lengths, bins) == [[9, 3], [8, 4], [7, 5], [6, 3, 2, 1]]


def test_mffd_small_pairs_beat_ffd():
    # Capacity 20: large >= 11, medium 7..10, small 4..6. No medium fits the large bins; going
    # backward, the 11-bin (room 9) takes the smallest small (4) and the largest that fits beside it
    # (5), which leaves the 10 and the 6 to share a bin: 4 bins where ffd needs 5.
    lengths = [19, 17, 11, 10, 6, 5, 4, 4]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 20, "mffd")) == [[19], [17], [11, 4, 5], [10, 6, 4]]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 20, "ffd")) == [[19], [17], [11, 6], [10, 5, 4], [4]]


def test_mffd_backward_pass_order():
    # Capacity 18: large >= 10, small 4..6, tiny <= 3. The backward pass reaches the 10-bin (room 8)
    # first, which takes the pair 4 + 4; the 11-bin (room 7) then finds no pair and takes the tiny
    # 3s in phase 4.
    lengths = [10, 11, 4, 4, 3, 3]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 18, "mffd")) == [[11, 3, 3], [10, 4, 4]]


def drawing(lengths, capacity, algorithm, **options):
    """Bins as docs/algorithms.md draws them: one letter per token (a = sequence 0), '.' = room."""
    bins = pack_lengths(lengths, capacity, algorithm, **options)
    drawn = []
    for pieces in as_pieces(bins):
        tokens = "".join("abcdefghijklmnopqrstuvwxyz"[member] * length for member, _, length in pieces)
        drawn.append("|" + tokens.ljust(capacity, ".") + "|")
    return "  ".join(drawn)


def test_drawings_in_the_docs():
    example = [6, 5, 4, 3, 2]
    assert drawing(example, 10, "concat") == "|aaaaaa....|  |bbbbbcccc.|  |dddee.....|"
    for algorithm in ("ffd", "bfd", "mffd"):
        assert drawing(example, 10, algorithm) == "|aaaaaacccc|  |bbbbbdddee|"
    assert drawing(example, 10, "ffs", seed=0) == "|cccceeddd.|  |aaaaaa....|  |bbbbb.....|"
    assert drawing(example, 10, "ffs", seed=1) == "|eeaaaaaa..|  |bbbbbcccc.|  |ddd.......|"
    assert drawing(example, 10, "split") == "|aaaaaabbbb|  |bccccdddee|"

    limited = {
        "concat": "|aaaaaa....|  |bbbbbcccc.|  |dddee.....|",
        "ffd": "|aaaaaacccc|  |bbbbbddd..|  |ee........|",
        "bfd": "|aaaaaacccc|  |bbbbbddd..|  |ee........|",
        "mffd": "|aaaaaacccc|  |bbbbbddd..|  |ee........|",
        "ffs": "|ccccee....|  |dddaaaaaa.|  |bbbbb.....|",
        "split": "|aaaaaabbbb|  |bcccc.....|  |dddee.....|",
    }
    for algorithm, expected in limited.items():
        assert drawing(example, 10, algorithm, max_seqs_per_bin=2, seed=0) == expected, algorithm

    assert drawing([8, 6, 3, 1], 10, "ffd") == "|aaaaaaaad.|  |bbbbbbccc.|"
    assert drawing([8, 6, 3, 1], 10, "bfd") == "|aaaaaaaa..|  |bbbbbbcccd|"
    mffd_example = [19, 17, 11, 10, 6, 5, 4, 4]
    assert drawing(mffd_example, 20, "mffd") == (
        "|aaaaaaaaaaaaaaaaaaa.|  |bbbbbbbbbbbbbbbbb...|  |ccccccccccchhhhfffff|  |ddddddddddeeeeeegggg|")
    assert drawing(mffd_example, 20, "ffd") == (
        "|aaaaaaaaaaaaaaaaaaa.|  |bbbbbbbbbbbbbbbbb...|  |ccccccccccceeeeee...|  |ddddddddddfffffgggg.|"
        "  |hhhh................|")
    assert drawing([6, 10, 4], 8, "split", align=2) == "|aaaaaabb|  |bbbbbbbb|  |cccc....|"
    assert pack_lengths(example, 10, "split").starts.tolist() == [0, 0, 4, 0, 0, 0]


def test_ffd_and_bfd_part_ways():
    # Capacity 10: the 1 fits beside the 8 (room 2) and the 6 3 (room 1). First fit takes the first
    # bin, best fit the tighter one, keeping room 2 whole.
    lengths = [8, 6, 3, 1]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 10, "ffd")) == [[8, 1], [6, 3]]
    assert lengths_of_bins(lengths, pack_lengths(lengths, 10, "bfd")) == [[8], [6, 3, 1]]


def test_ffs_depends_on_the_seed_only():
    lengths = np.random.default_rng(1).integers(1, 100, 200)
    first = pack_lengths(lengths, 128, "ffs", seed=3)
    assert_same_bins(first, pack_lengths(lengths, 128, "ffs", seed=3))
    other = pack_lengths(lengths, 128, "ffs", seed=4)
    assert not np.array_equal(first.members, other.members)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_input_gives_no_bins(algorithm):
    bins = pack_lengths([], 16, algorithm)
    assert bins.num_bins == 0
    assert bins.offsets.tolist() == [0]
    assert len(bins.members) == len(bins.starts) == len(bins.lens) == 0
    assert bins.loads().tolist() == []


def zipf_like_lengths(n, capacity, align=8, seed=0):
    raw = np.clip(np.random.default_rng(seed).zipf(1.3, n) * 20, 1, capacity)
    return (raw + align - 1) // align * align


@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "mffd"])
def test_decreasing_algorithms_are_near_the_lower_bound(algorithm):
    lengths = zipf_like_lengths(20_000, 4096)
    bins = pack_lengths(lengths, 4096, algorithm)
    check_invariants(lengths, 4096, bins)
    assert bins.num_bins <= 1.01 * math.ceil(lengths.sum() / 4096)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_large_input_invariants(algorithm):
    lengths = zipf_like_lengths(20_000, 4096, seed=1)
    bins = pack_lengths(lengths, 4096, algorithm, max_seqs_per_bin=16, align=8)
    check_invariants(lengths, 4096, bins, 16)


# --- errors ---------------------------------------------------------------------------------------

def test_unknown_algorithm_lists_the_valid_names():
    with pytest.raises(ValueError, match="concat, ffd, bfd, mffd, ffs, split"):
        pack_lengths([1, 2], 8, "first_fit")


def test_too_long_names_the_first_offending_index_and_the_fix():
    with pytest.raises(ValueError, match=r"lengths\[2\] = 9 exceeds capacity 8.*split"):
        pack_lengths([1, 2, 9, 10], 8, "ffd")
    for algorithm in WHOLE_ITEM_ALGORITHMS:
        with pytest.raises(ValueError, match="exceeds capacity"):
            pack_lengths([9], 8, algorithm)
    pack_lengths([9], 8, "split")  # split cuts it instead


@pytest.mark.parametrize("bad", [[3, 0, 2], [3, -1]])
def test_non_positive_length(bad):
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        pack_lengths(bad, 8, "ffd")


@pytest.mark.parametrize("kwargs, message", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": 8, "max_seqs_per_bin": 0}, "max_seqs_per_bin"),
    ({"capacity": 8, "align": 0}, "align"),
    ({"capacity": 8.5}, "capacity"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_lengths([1, 2], **kwargs)


def test_bad_lengths_array():
    with pytest.raises(ValueError, match="integers"):
        pack_lengths([1.5, 2.0], 8)
    with pytest.raises(ValueError, match="1-D"):
        pack_lengths([[1, 2]], 8)


@pytest.mark.parametrize("capacity, align", [(10, 4), (2, 4)])
def test_split_needs_capacity_multiple_of_align(capacity, align):
    with pytest.raises(ValueError, match="multiple of align"):
        pack_lengths([4, 4], capacity, "split", align=align)


# --- pool -----------------------------------------------------------------------------------------

def reference_pool(lengths, capacity, max_seqs, pool_size, closest):
    waiting, upcoming, bins = [], list(range(len(lengths))), []

    def refill():
        while len(waiting) < pool_size and upcoming:
            waiting.append(upcoming.pop(0))

    refill()
    while waiting:
        members = [waiting.pop(0)]
        refill()
        while len(members) < max_seqs:
            room = capacity - sum(lengths[j] for j in members)
            fits = [i for i in waiting if lengths[i] <= room]
            if not fits:
                break
            pick = max(fits, key=lambda i: (lengths[i], -waiting.index(i))) if closest else fits[0]
            waiting.remove(pick)
            members.append(pick)
            refill()
        bins.append(members)
    return bins


@SETTINGS
@given(data=packing_inputs(), pool_size=st.integers(1, 12), strategy=st.sampled_from(["closest", "first"]))
def test_pool_matches_reference_and_moves_order_little(data, pool_size, strategy):
    lengths, capacity, max_seqs = data
    bins = pack_lengths(lengths, capacity, "pool", max_seqs_per_bin=max_seqs, pool_size=pool_size,
                        pool_strategy=strategy)
    check_invariants(lengths, capacity, bins, max_seqs)
    assert as_lists(bins) == reference_pool(lengths, capacity, max_seqs or len(lengths) + 1, pool_size,
                                            strategy == "closest")
    # item i enters the pool once the items before it are placed or waiting; it is placed within
    # pool_size bins of the bin holding the oldest item waiting then: bin(i) < bin(i - pool_size + 1) + pool_size
    bin_of = np.empty(len(lengths), np.int64)
    bin_of[bins.members] = np.repeat(np.arange(bins.num_bins), np.diff(bins.offsets))
    for i in range(pool_size, len(lengths)):
        assert bin_of[i] <= bin_of[:i - pool_size + 1].max() + pool_size


def test_pool_of_one_is_concat_and_a_big_pool_packs_tighter():
    lengths = zipf_like_lengths(5000, 4096, seed=3)
    assert_same_bins(pack_lengths(lengths, 4096, "pool", pool_size=1), pack_lengths(lengths, 4096, "concat"))
    assert (pack_lengths(lengths, 4096, "pool", pool_size=128).num_bins
            < pack_lengths(lengths, 4096, "pool", pool_size=4).num_bins
            < pack_lengths(lengths, 4096, "concat").num_bins)


def test_pool_options_are_checked():
    with pytest.raises(ValueError, match="pool strategy 'best'"):
        pack_lengths([1, 2], 4, "pool", pool_strategy="best")
    with pytest.raises(ValueError, match="pool_size"):
        pack_lengths([1, 2], 4, "pool", pool_size=0)


# --- the table of kernels -------------------------------------------------------------------------

def test_the_kernel_table_and_the_names_agree():
    """`--algorithm` takes its choices from names.ALGORITHMS (no numba loaded); `pack_lengths`
    runs the rows of KERNELS. Same names, same order."""
    from packctl.plan import names

    assert tuple(KERNELS) == ALGORITHMS == names.ALGORITHMS
    assert WHOLE_ITEM_ALGORITHMS == tuple(a for a in ALGORITHMS if a != "split")


def test_a_kernel_calls_numba_functions_of_its_own_file_only():
    """numba caches a compiled kernel by its own source file: a kernel that called a numba function
    of another file would keep the old callee compiled in after that file changed (why mffd runs
    its last phase, first fit from fit.py, from Python)."""
    import importlib
    import pkgutil
    from types import ModuleType

    from numba.core.dispatcher import Dispatcher

    import packctl.plan

    checked = 0
    for info in pkgutil.iter_modules(packctl.plan.__path__):
        module = importlib.import_module(f"packctl.plan.{info.name}")
        for kernel in vars(module).values():
            if not isinstance(kernel, Dispatcher) or kernel.py_func.__module__ != module.__name__:
                continue
            checked += 1
            names = kernel.py_func.__code__.co_names
            for name in names:
                value = vars(module).get(name)
                callees = [getattr(value, attr, None) for attr in names] if isinstance(value, ModuleType) else [value]
                for callee in callees:
                    if isinstance(callee, Dispatcher):
                        assert callee.py_func.__module__ == module.__name__, (
                            f"{module.__name__}.{kernel.py_func.__name__} calls "
                            f"{callee.py_func.__module__}.{callee.py_func.__name__}")
    assert checked >= 15  # the walk found the kernels


@pytest.mark.parametrize("algorithm", [*KERNELS, "batch"])
def test_cuts_items_says_which_algorithms_take_an_item_over_capacity(algorithm):
    """`cuts_items` is what the planner asks instead of an algorithm's name: an algorithm that cuts
    takes an item over capacity in pieces, the others refuse it; `batch` has no kernel and cuts
    nothing."""
    from packctl.plan.algorithms import cuts_items

    if algorithm == "batch":
        assert cuts_items(algorithm) is False
        return
    try:
        bins = pack_lengths([12, 3], 8, algorithm)
    except ValueError:
        assert not cuts_items(algorithm)
    else:
        assert cuts_items(algorithm)
        assert sorted(bins.lens.tolist()) == [3, 4, 8]

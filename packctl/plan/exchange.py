"""Exchanges at equal cost: the packs of epochs 1.. of --epochs, made to differ from epoch 0's.

The decreasing algorithms (ffd, bfd, mffd) pack a window the same way whatever the order its
sequences come in, up to ties: on a corpus within one --window, epoch e would repeat most of
epoch 0's packs. So, once a window is planned exactly (same packs count, same room), seeded
exchanges move sequences between its packs, each keeping both packs within the capacity and the
--max-seqs-per-bin limit. The number of packs is the exact plan's by construction:

    capacity 10   packs [6 3 1] [5 4] [7 2 1]        rooms 0, 1, 0
    swap 1 <-> 1  [6 3 1'] [5 4] [7 2 1]            equal lengths of different sequences: the
                                                    cheapest move, both packs change
    give 4, take 3 1   [6 3 1] [5 3 1] [7 2 4]?     no: 7 + 2 + 4 = 13 > 10, refused

With budgets besides tokens (`extra` costs per piece, `limits`), an exchange must also keep both
packs within every limit: a move that would put an image too many into a pack is refused like one
a token too long, and the next candidate is tried.

Each pack A not yet changed, visited in a seeded order, tries in turn (first that fits wins):

    1 for 1   an item s of A for an item t of another pack B, |t - s| within the rooms
    2 for 1   two items of A for one item of B
    1 for 2   one item of A for two items of one pack B

candidates found by binary search over the window's movable items sorted by padded length, and
drawn from them with the window's seed, so the exchanges depend on (seed, epoch, window) and the
plan only: the same for any rank count and after --resume. Pieces of split sequences and
members of groups of two or more (`movable` False) never move. O(n log n) a window.
"""
from __future__ import annotations

import numpy as np

from packctl.jit import njit

PROBES = 4  # candidates drawn per item (or pair) of A before the next
PAIRS = 8  # pairs of A tried for "2 for 1" and "2 for 2"
ITEMS = 4  # items of A tried for "1 for 1" and "1 for 2"
PAIR_ITEMS = 8  # items of a pack whose pairs can be taken by "1 for 2" and "2 for 2"
PAIR_PACKS = 2048  # packs (drawn) whose pairs can be taken: enough pairs for every total length
SCAN = 8  # shorter candidates looked at, nearest first, for a pack with room
DRAWS = 4096  # random numbers drawn per window, used in turn
EXCHANGE_WORD = 0x4558  # keeps the exchange draws apart from every other draw seeded by the window


def exchange_pieces(offsets: np.ndarray, padded: np.ndarray, movable: np.ndarray, capacity: int,
                    max_seqs: int, seed: int, extra: np.ndarray | None = None,
                    limits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seeded exchanges between the packs of one window (CSR `offsets` over pieces of `padded`
    tokens). Returns (take, new_offsets): the pieces in their new packs are `take` (indices into
    the old pieces; inside a pack in their old order), cut by `new_offsets`; as many packs as before.
    `extra` (pieces x k costs) and `limits` (k): every pack stays within each limit too (None: tokens
    only; the draws and the exchanges are then those of before).

        >>> take, offsets = exchange_pieces(np.array([0, 2, 4]), np.array([6, 4, 5, 4]),
        ...                                 np.ones(4, bool), 10, 4, seed=1)
        >>> take.tolist(), offsets.tolist()   # the 6 and the 5 changed packs
        ([1, 2, 0, 3], [0, 2, 4])
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    nb = len(offsets) - 1
    if nb < 2 or not movable.any():
        return np.arange(len(padded), dtype=np.int64), offsets
    rng = np.random.default_rng([seed, EXCHANGE_WORD])
    visit = rng.permutation(nb).astype(np.int64)
    draws = rng.integers(0, 1 << 31, size=DRAWS, dtype=np.int64)
    if extra is None:
        extra, limits = np.zeros((len(padded), 0), np.int64), np.zeros(0, np.int64)
    return _exchange_kernel(offsets, np.asarray(padded, np.int64), np.asarray(movable, np.bool_), int(capacity),
                            int(max_seqs), visit, draws, np.ascontiguousarray(extra, np.int64),
                            np.ascontiguousarray(limits, np.int64))


@njit(cache=True)
def _exchange_kernel(offsets, padded, movable, capacity, max_seqs, visit, draws, extra, limits):
    """(take, new offsets) of `exchange_pieces`."""
    nb = offsets.size - 1
    n = padded.size
    bin_of = np.empty(n, np.int64)
    fill = np.zeros(nb, np.int64)
    spent = np.zeros((nb, limits.size), np.int64)  # each pack's sum of each cost column
    count = np.zeros(nb, np.int64)
    # each pack's pieces as a doubly linked list, so moves cost O(1)
    head = np.full(nb, -1, np.int64)
    nxt = np.full(n, -1, np.int64)
    prv = np.full(n, -1, np.int64)
    for b in range(nb):
        last = -1
        for p in range(offsets[b], offsets[b + 1]):
            bin_of[p] = b
            fill[b] += padded[p]
            for j in range(limits.size):
                spent[b, j] += extra[p, j]
            count[b] += 1
            prv[p] = last
            if last >= 0:
                nxt[last] = p
            else:
                head[b] = p
            last = p
    slack = 0  # the most room of any pack: no item shorter by more can come into a pack
    for b in range(nb):
        slack = max(slack, capacity - fill[b])
    by_len = _by_length(padded, movable, max(capacity, padded.max()))
    lens = padded[by_len]
    alone = np.full(by_len.size, -1, np.int64)  # the "second item" of a single item: none
    pair_sum, pair_first, pair_second = _pairs_by_sum(offsets, padded, movable, visit[:PAIR_PACKS])
    changed = np.zeros(nb, np.bool_)
    mine = np.empty(n, np.int64)
    state = np.zeros(1, np.int64)  # draws used

    for a in visit:
        if changed[a]:
            continue
        k = 0
        p = head[a]
        while p >= 0:
            if movable[p]:
                mine[k] = p
                k += 1
            p = nxt[p]
        if k == 0:
            continue
        pairs = k * (k - 1) // 2
        room_a = capacity - fill[a]
        done = -1  # the pack a exchanged with
        # 1 for 1 (another length), 1 for 2, 2 for 1, 2 for 2, then 1 for 1 of the same length:
        # the last changes the pack's samples but not its lengths, so it can give back a pack of
        # epoch 0 (whose planner put the two equal lengths the other way round): last resort
        for move in range(5):
            give_pair = move == 2 or move == 3
            if give_pair and pairs == 0:
                continue
            if move == 1 or move == 3:
                sums, first_of, second_of = pair_sum, pair_first, pair_second
            else:
                sums, first_of, second_of = lens, by_len, alone
            options = min(pairs, PAIRS) if give_pair else min(k, ITEMS)
            first = _draw(draws, state) % options
            for q in range(options):
                if give_pair:
                    r = (first + q) % pairs
                    i = 0
                    while r >= k - 1 - i:  # pair number r of mine[:k] -> (i, i + 1 + r)
                        r -= k - 1 - i
                        i += 1
                    s1, s2 = mine[i], mine[i + 1 + r]
                else:
                    s1, s2 = mine[(first + q) % k], -1
                done = _try_items(a, s1, s2, sums, first_of, second_of, slack, room_a, move == 0, move == 4,
                                  draws, state, bin_of, fill, count, head, nxt, prv, padded, capacity, max_seqs,
                                  extra, limits, spent)
                if done >= 0:
                    break
            if done >= 0:
                break
        if done >= 0:
            changed[a] = changed[done] = True
    # the pieces pack by pack, in their old order inside each (a counting sort by new pack)
    new_offsets = np.zeros(nb + 1, np.int64)
    for b in range(nb):
        new_offsets[b + 1] = new_offsets[b] + count[b]
    slot = new_offsets[:-1].copy()
    take = np.empty(n, np.int64)
    for p in range(n):
        take[slot[bin_of[p]]] = p
        slot[bin_of[p]] += 1
    return take, new_offsets


@njit(cache=True)
def _by_length(padded, movable, capacity):
    """The movable pieces by padded length ascending (ties by index): a counting sort, O(n + C)."""
    count_of = np.zeros(capacity + 2, np.int64)
    m = 0
    for p in range(padded.size):
        if movable[p]:
            count_of[padded[p] + 1] += 1
            m += 1
    for length in range(capacity + 1):
        count_of[length + 1] += count_of[length]
    out = np.empty(m, np.int64)
    for p in range(padded.size):
        if movable[p]:
            out[count_of[padded[p]]] = p
            count_of[padded[p]] += 1
    return out


@njit(cache=True)
def _draw(draws, state):
    value = draws[state[0] % draws.size]
    state[0] += 1
    return value


@njit(cache=True)
def _pairs_by_sum(offsets, padded, movable, packs):
    """Every pair of movable pieces of one of `packs` (the first PAIR_ITEMS of each), sorted by
    total length."""
    total = 0
    for b in packs:
        k = 0
        for p in range(offsets[b], offsets[b + 1]):
            if movable[p]:
                k += 1
        k = min(k, PAIR_ITEMS)
        total += k * (k - 1) // 2
    sums = np.empty(total, np.int64)
    first = np.empty(total, np.int64)
    second = np.empty(total, np.int64)
    j = 0
    for b in packs:
        end = offsets[b]
        taken = 0
        while end < offsets[b + 1] and taken < PAIR_ITEMS:
            if movable[end]:
                taken += 1
            end += 1
        for p in range(offsets[b], end):
            if not movable[p]:
                continue
            for q in range(p + 1, end):
                if movable[q]:
                    sums[j] = padded[p] + padded[q]
                    first[j] = p
                    second[j] = q
                    j += 1
    order = np.argsort(sums, kind="mergesort")
    return sums[order], first[order], second[order]


@njit(cache=True)
def _try_items(a, s1, s2, sums, first, second, slack, room_a, unequal, equal, draws, state, bin_of, fill, count,
               head, nxt, prv, padded, capacity, max_seqs, extra, limits, spent):
    """Exchange s1 (and s2) of pack a for an item (`second` -1) or a pair of one pack whose total
    length (`sums`, sorted) fits both packs: first among those as long (not with `unequal`) or up
    to a's room longer (pack b never grows), then among those up to `slack` shorter; with `equal`
    only among those as long. Returns the other pack, or -1."""
    given = padded[s1] + (padded[s2] if s2 >= 0 else 0)
    longest = given if equal else given + room_a
    b = _try_range(a, s1, s2, given, sums, first, second, given + unequal, longest, False, draws, state, bin_of,
                   fill, count, head, nxt, prv, padded, capacity, max_seqs, extra, limits, spent)
    if b < 0 and slack > 0 and not equal:
        b = _try_range(a, s1, s2, given, sums, first, second, given - slack, given - 1, True, draws, state,
                       bin_of, fill, count, head, nxt, prv, padded, capacity, max_seqs, extra, limits, spent)
    return b


@njit(cache=True)
def _try_range(a, s1, s2, given, sums, first, second, lo_len, hi_len, descending, draws, state, bin_of, fill, count,
               head, nxt, prv, padded, capacity, max_seqs, extra, limits, spent):
    """`_try_items` among the candidates of total length in [lo_len, hi_len]: all of them from a
    drawn start when they are few, else PROBES drawn ones; `descending`: the SCAN longest."""
    lo = np.searchsorted(sums, lo_len)
    hi = np.searchsorted(sums, hi_len, side="right")
    if hi <= lo:
        return -1
    n_given = 1 if s2 < 0 else 2
    few = hi - lo <= 2 * PROBES
    start = 0 if descending else _draw(draws, state) % (hi - lo)
    for probe in range(min(hi - lo, SCAN) if descending else hi - lo if few else PROBES):
        if descending:  # the nearest lengths first: the likeliest to fit the other pack's room
            c = hi - 1 - probe
        else:
            c = lo + ((start + probe) % (hi - lo) if few else _draw(draws, state) % (hi - lo))
        t1, t2 = first[c], second[c]
        b = bin_of[t1]
        if b == a or (t2 >= 0 and bin_of[t2] != b):
            continue
        n_taken = 1 if t2 < 0 else 2
        change = sums[c] - given  # tokens pack a gains
        if fill[a] + change > capacity or fill[b] - change > capacity:
            continue
        if count[a] - n_given + n_taken > max_seqs or count[b] - n_taken + n_given > max_seqs:
            continue
        if n_given == count[a] and n_taken == count[b]:
            continue  # the two packs would trade their whole contents: the same packs
        within = True
        for j in range(limits.size):  # every cost column: what pack a gains, pack b loses
            gain = extra[t1, j] + (extra[t2, j] if t2 >= 0 else 0) - extra[s1, j] - (extra[s2, j] if s2 >= 0 else 0)
            within = within and spent[a, j] + gain <= limits[j] and spent[b, j] - gain <= limits[j]
        if not within:
            continue
        _move(s1, a, b, bin_of, fill, count, head, nxt, prv, padded, extra, spent)
        if s2 >= 0:
            _move(s2, a, b, bin_of, fill, count, head, nxt, prv, padded, extra, spent)
        _move(t1, b, a, bin_of, fill, count, head, nxt, prv, padded, extra, spent)
        if t2 >= 0:
            _move(t2, b, a, bin_of, fill, count, head, nxt, prv, padded, extra, spent)
        return b
    return -1


@njit(cache=True)
def _move(p, src, dst, bin_of, fill, count, head, nxt, prv, padded, extra, spent):
    """Piece p from pack src to the head of pack dst."""
    if prv[p] >= 0:
        nxt[prv[p]] = nxt[p]
    else:
        head[src] = nxt[p]
    if nxt[p] >= 0:
        prv[nxt[p]] = prv[p]
    prv[p] = -1
    nxt[p] = head[dst]
    if head[dst] >= 0:
        prv[head[dst]] = p
    head[dst] = p
    bin_of[p] = dst
    fill[src] -= padded[p]
    fill[dst] += padded[p]
    count[src] -= 1
    count[dst] += 1
    for j in range(spent.shape[1]):
        spent[src, j] -= extra[p, j]
        spent[dst, j] += extra[p, j]

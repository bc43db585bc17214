"""Balance packs over data-parallel ranks: every pack gets a (step, dp_rank, micro_batch).

A training step consumes `dp_size x micro_batches` packs: each of the D ranks runs M micro-batches
(one pack each) and then all ranks synchronize their gradients, so a step lasts as long as its
slowest rank. Packs are cut into steps in output order, inside each planning window, and each
step's packs are shared out so that the ranks' costs are as equal as possible.

    step of 8 packs, D = 2, M = 4, attention cost of each pack (thousands):
        packs in output order    90  10  80  20  70  30  60  40
        round robin              rank 0: 90 80 70 60 = 300     rank 1: 10 20 30 40 = 100  -> max/mean 1.50
        Karmarkar-Karp           rank 0: 90 10 60 40 = 200     rank 1: 80 20 70 30 = 200   -> max/mean 1.00

How (per step, `balance_step`):
1. Karmarkar-Karp largest differencing over the packs (`kk_partition`), M packs per rank when
   equal counts are asked for. Packs are never changed by this, so no pack can exceed the capacity.
   If the result is worse than round robin on the balanced cost, round robin is kept.
2. With `scope="sequences"`, a local search then moves or swaps single sequences between the most
   and the least loaded ranks while that lowers the step's maximum. A move is only made when the
   receiving pack keeps within the capacity and `max_seqs_per_bin`; a pack never loses its last
   sequence, and pieces of a split sequence never move (their order in the output is their order
   in the sample). So the capacity holds after every move: the guarantee is by construction, not
   by a check at the end.
3. Micro-batches: each rank's packs are numbered by decreasing cost, so micro-batch 0 is the
   heaviest on every rank (a memory problem shows in the first micro-batch, and the j-th
   micro-batches of all ranks have similar costs, which matters when ranks synchronize per
   micro-batch as FSDP does).

With --group-scope step the planner has cut the steps already (`PackPlan.step_bins`: each keeps
its groups whole); they are taken as they are instead of being cut here.

A step that has fewer packs than D x M (the last one of a window) or, with `step_tokens`, any
step, gets ceil(P / D) packs per rank: with equal counts, packs holding several sequences are split
in two until the count is a multiple of D (a few more, less full packs, so that no rank waits with
nothing to do). When a step holds fewer sequences than that needs, its counts stay unequal and the
report says how many steps are so.

Costs (`piece_costs`): `tokens` = tokens of the sequences of a pack; `attention` = sum over its
sequences of `a*L + L^2` (L the true length), the cost model of docs/balancing.md and of
`packctl stats`. Capacity is checked on aligned lengths, as the planner does; with --limit every
limit is checked too (`spec.limits`, the pieces' `PackPlan.piece_extra`): a sequence moves only
into a pack that stays within every budget.

A second cost (`--balance-cost COL`, `spec.cost_column`): the ranks should get equal vision work
(the sum of a limited column: images, image tokens) as well as equal attention cost. Each step is
balanced on one combined cost per sequence, each cost taken as its share of the step:

    combined_i = cost_i / sum(cost over the step) + col_i / sum(col over the step)

so the two weigh alike whatever their units. Karmarkar-Karp and the round-robin check run on it;
then `vector_greedy` deals the packs once more looking at both costs (each pack, by decreasing
larger share, to the rank whose larger share after taking it is least), and is kept when its
worst rank share (the larger of cost and vision work, times D) is lower. The local search and the
micro-batch order run on the combined cost. Per step that adds O(P log P + P D) to the
O(P log P x D) of KK. A step without vision work (text only) is balanced on the cost alone, as
without the option.

    step of 4 packs, D = 2, M = 2:  attention  90 80 20 10,  images  0 8 7 1
    attention alone   rank 0: 90 10 (images 0 1)   rank 1: 80 20 (images 8 7)   attention 100/100, images 1/15
    --balance-cost    rank 0: 80 10 (images 8 1)   rank 1: 90 20 (images 0 7)   attention 90/110,  images 9/7
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from packctl.plan.pack_order import average_ranks, order_seed, pack_keys, window_permutation
from packctl.plan.windows import PackPlan
from packctl.specs import BalanceSpec



def piece_costs(lengths: np.ndarray, cost: str, attn_coeff: float) -> np.ndarray:
    """Cost of each sequence (float64): its length, or `a*L + L^2`."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if cost == "tokens":
        return lengths
    return attn_coeff * lengths + lengths * lengths


def kk_partition(costs, k: int, *, equal_counts: bool = False) -> np.ndarray:
    """Karmarkar-Karp largest differencing method: split items into k parts with close sums.

    Returns the part (0..k-1) of each item. Each item starts as a k-tuple of sums (itself and
    k-1 empty parts); repeatedly the two tuples with the largest spread (max - min) are merged,
    the largest part of one with the smallest of the other, until one tuple is left. With
    `equal_counts`, items are first grouped k at a time in decreasing order (one per part), so
    every part ends with floor(n/k) or ceil(n/k) items. Ties break on item order: deterministic.

        >>> kk_partition([8, 7, 6, 5, 4], 2).tolist()
        [1, 0, 1, 0, 0]

    i.e. parts {7, 5, 4} = 16 and {8, 6} = 14 (the best split here is 15 / 15: KK is a heuristic;
    on many items its spread is usually tiny next to the sums).
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if k < 1:
        raise ValueError("k must be >= 1")
    parts = np.zeros(n, dtype=np.int64)
    if n == 0 or k == 1:
        return parts
    order = np.argsort(-costs, kind="stable")
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    if equal_counts:
        for g, lo in enumerate(range(0, n, k)):
            items = order[lo:lo + k].tolist()
            sums = [float(costs[i]) for i in items] + [0.0] * (k - len(items))
            members = [[i] for i in items] + [[] for _ in range(k - len(items))]
            heapq.heappush(heap, (-(max(sums) - min(sums)), g, sums, members))
    else:
        for g, i in enumerate(order.tolist()):
            sums = [float(costs[i])] + [0.0] * (k - 1)
            heapq.heappush(heap, (-sums[0], g, sums, [[i]] + [[] for _ in range(k - 1)]))
    created = len(heap)
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        desc = sorted(range(k), key=lambda j: (-sums_a[j], j))
        asc = sorted(range(k), key=lambda j: (sums_b[j], j))
        sums = [sums_a[i] + sums_b[j] for i, j in zip(desc, asc)]
        members = [members_a[i] + members_b[j] for i, j in zip(desc, asc)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), created, sums, members))
        created += 1
    for part, items in enumerate(heap[0][3]):
        parts[items] = part
    return parts


def round_robin(num_packs: int, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack j of a step -> rank j % D, micro-batch j // D (what a strided sampler does)."""
    j = np.arange(num_packs, dtype=np.int64)
    return j % dp_size, j // dp_size


def step_bounds(pack_tokens: np.ndarray, window_bins: np.ndarray, spec: BalanceSpec) -> np.ndarray:
    """First pack of every step (plus the end). Steps never straddle windows.

    `micro_batches` M: D*M packs a step (the window's last step may be shorter). `step_tokens` T:
    packs are added until the step holds T tokens, then up to the next multiple of D packs.

        window_bins [0, 10], D 2, M 2 -> [0, 4, 8, 10]
    """
    d = spec.dp_size
    bounds = [np.zeros(1, np.int64)]
    for lo, hi in zip(window_bins[:-1].tolist(), window_bins[1:].tolist()):
        if hi == lo:
            continue
        if spec.micro_batches is not None:
            starts = np.arange(lo, hi, d * spec.micro_batches, dtype=np.int64)
        else:
            starts = _token_step_starts(np.asarray(pack_tokens[lo:hi], dtype=np.int64), spec.step_tokens, d) + lo
        bounds.append(np.append(starts[1:], hi))
    return np.concatenate(bounds).astype(np.int64)


def planned_step_bounds(step_bins: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The steps the planner made inside packs lo..hi (`PackPlan.step_bins`), counted from lo.

        step_bins [0, 3, 5, 9], packs 5..9 -> [0, 4]
    """
    inside = step_bins[(step_bins >= lo) & (step_bins <= hi)] - lo
    return np.unique(np.concatenate([[0, hi - lo], inside])).astype(np.int64)


def _token_step_starts(tokens: np.ndarray, step_tokens: int, d: int) -> np.ndarray:
    starts = [0]
    cumulative = np.cumsum(tokens)
    base = 0
    n = len(tokens)
    while True:
        lo = starts[-1]
        # first pack count c >= 1 with tokens[lo:lo+c] >= step_tokens, then rounded up to a multiple of d
        reach = int(np.searchsorted(cumulative, base + step_tokens, side="left")) + 1
        count = max(reach - lo, 1)
        count = -(-count // d) * d
        if lo + count >= n:
            break
        starts.append(lo + count)
        base = int(cumulative[lo + count - 1])
    return np.asarray(starts, dtype=np.int64)


@dataclass
class StepResult:
    """One balanced step: pieces (indices into the step's input pieces) of each output pack."""

    offsets: np.ndarray  # int64, P'+1 over `pieces`
    pieces: np.ndarray  # int64
    dp_rank: np.ndarray  # int64, per output pack
    micro_batch: np.ndarray  # int64, per output pack
    equal: bool  # every rank got the same number of packs


def combined_costs(costs: np.ndarray, media: np.ndarray) -> np.ndarray:
    """`--balance-cost`: each sequence's share of the step's cost plus its share of the step's
    vision work (`media`); the cost alone when the step has none.

        >>> combined_costs(np.array([30.0, 10.0]), np.array([0.0, 4.0])).tolist()
        [0.75, 1.25]
    """
    media_total = float(media.sum())
    if media_total <= 0:
        return costs
    cost_total = float(costs.sum())
    return (costs / cost_total if cost_total > 0 else np.zeros(len(costs))) + media / media_total


def balance_step(offsets: np.ndarray, padded: np.ndarray, costs: np.ndarray, movable: np.ndarray,
                 spec: BalanceSpec, *, strided: bool = False, extra: np.ndarray | None = None,
                 media: np.ndarray | None = None) -> StepResult:
    """Balance one step's packs (CSR `offsets` over pieces with aligned length `padded`, cost
    `costs`; `movable` False for pieces that must stay in their pack) over `spec.dp_size` ranks.
    The output packs are the input packs, possibly with sequences moved between them (scope
    "sequences"), plus, for equal counts, packs split off. `strided`: pack j goes to rank j % D,
    micro-batch j // D, as given (the warm-up steps, whose runs of D packs share a shape).
    `extra` (pieces x k, with `spec.limits`): the pieces' costs in the limited columns, which every
    moved sequence keeps within the limits; `media`: the pieces' vision work of `--balance-cost`,
    balanced with `costs` (`combined_costs`)."""
    d = spec.dp_size
    own_costs = costs
    if media is not None:
        media = np.asarray(media, dtype=np.float64)
        costs = combined_costs(np.asarray(costs, dtype=np.float64), media)
    offsets = np.asarray(offsets, dtype=np.int64)
    num_packs = len(offsets) - 1
    piece_pack = np.repeat(np.arange(num_packs), np.diff(offsets))

    # Equal counts: split packs until every rank can get the same number.
    pack_of = piece_pack.copy()  # output pack of each piece, in the ids of `parent` below
    parent = list(range(num_packs))
    if spec.equal_counts and num_packs % d:
        pack_of, parent = _split_for_counts(pack_of, num_packs, padded, costs, movable, -(-num_packs // d) * d)
    packs = len(parent)
    counts = np.bincount(pack_of, minlength=packs)
    pack_cost = np.bincount(pack_of, weights=costs, minlength=packs)
    equal = packs % d == 0

    rr = np.arange(packs) % d
    if strided:
        rank, micro = rr, np.arange(packs) // d
    else:
        rank = kk_partition(pack_cost, d, equal_counts=spec.equal_counts or equal)
        kk_max = np.bincount(rank, weights=pack_cost, minlength=d).max()
        if np.bincount(rr, weights=pack_cost, minlength=d).max() < kk_max:
            rank = rr
        if media is not None and media.sum() > 0:  # --balance-cost: the greedy of both, when it does better
            greedy = vector_greedy(np.bincount(pack_of, weights=own_costs, minlength=packs),
                                   np.bincount(pack_of, weights=media, minlength=packs), d,
                                   spec.equal_counts or equal)
            if _worst_share(greedy, pack_of, own_costs, media, d) < _worst_share(rank, pack_of, own_costs, media, d):
                rank = greedy
        if spec.scope == "sequences" and d > 1:
            pack_of = _local_search(pack_of, rank, padded, costs, movable, counts, spec, extra)
            pack_cost = np.bincount(pack_of, weights=costs, minlength=packs)
        micro = np.zeros(packs, dtype=np.int64)
        for r in range(d):
            mine = np.flatnonzero(rank == r)
            micro[mine[np.argsort(-pack_cost[mine], kind="stable")]] = np.arange(len(mine))

    # Output order inside the step: micro-batch, then rank (row j of the step is rank j % D,
    # micro-batch j // D whenever the counts are equal, as a strided sampler reads it).
    out_order = np.lexsort((rank, micro))
    position = np.empty(packs, dtype=np.int64)
    position[out_order] = np.arange(packs)
    new_pack = position[pack_of]
    pieces = np.lexsort((np.arange(len(pack_of)), new_pack))
    out_counts = np.bincount(new_pack, minlength=packs)
    return StepResult(offsets=np.concatenate([[0], np.cumsum(out_counts)]).astype(np.int64),
                      pieces=pieces.astype(np.int64), dp_rank=rank[out_order], micro_batch=micro[out_order],
                      equal=equal)


def _worst_share(rank, pack_of, costs, media, d) -> float:
    """The largest share of a step's cost or vision work any rank has, times D (1.0: even)."""
    piece_rank = rank[pack_of]
    worst = 0.0
    for values in (costs, media):
        total = float(values.sum())
        if total > 0:
            worst = max(worst, float(np.bincount(piece_rank, weights=values, minlength=d).max()) * d / total)
    return worst


def vector_greedy(cost: np.ndarray, media: np.ndarray, d: int, equal_counts: bool) -> np.ndarray:
    """Packs to ranks for two costs at once: packs in decreasing order of their larger share,
    each to the rank whose larger share (cost or vision work) after taking it is least (ties: the
    rank with the least of both, then the lowest rank); with `equal_counts` at most ceil(P / D)
    packs a rank. O(P log P + P D).

        >>> vector_greedy(np.array([9., 1, 8, 2]), np.array([0., 8, 1, 9]), 2, True).tolist()
        [1, 1, 0, 0]

    i.e. rank 0 takes costs 8 + 2 = 10 and vision work 1 + 9 = 10, rank 1 takes 10 and 8.
    """
    n = len(cost)
    a = cost / cost.sum() * d if cost.sum() > 0 else np.zeros(n)
    v = media / media.sum() * d if media.sum() > 0 else np.zeros(n)
    order = np.argsort(-np.maximum(a, v), kind="stable")
    most = -(-n // d) if equal_counts else n
    load_a, load_v, count = np.zeros(d), np.zeros(d), np.zeros(d, np.int64)
    rank = np.zeros(n, np.int64)
    for i in order.tolist():
        score = np.maximum(load_a + a[i], load_v + v[i])
        score[count >= most] = np.inf
        best = np.flatnonzero(score == score.min())
        r = int(best[np.argmin((load_a + load_v)[best])])
        rank[i] = r
        load_a[r] += a[i]
        load_v[r] += v[i]
        count[r] += 1
    return rank


def _split_for_counts(pack_of, num_packs, padded, costs, movable, want):
    """Split packs (the one with most movable pieces first) until there are `want` packs, or no
    pack has two movable pieces left. Returns the new piece->pack map and each pack's source."""
    pack_of = pack_of.copy()
    parent = list(range(num_packs))
    while len(parent) < want:
        movable_count = np.bincount(pack_of[movable], minlength=len(parent))
        total_count = np.bincount(pack_of, minlength=len(parent))
        # a pack can give away movable pieces as long as it keeps one piece
        can_give = np.minimum(movable_count, total_count - 1)
        source = int(np.argmax(can_give))
        if can_give[source] < 1:
            break
        mine = np.flatnonzero((pack_of == source) & movable)
        mine = mine[np.argsort(-costs[mine], kind="stable")]
        give = mine[1::2] if len(mine) == total_count[source] else mine[: max(1, len(mine) // 2)]
        give = give[: int(can_give[source])]
        pack_of[give] = len(parent)
        parent.append(parent[source])
    return pack_of, parent


def _local_search(pack_of, rank, padded, costs, movable, counts, spec: BalanceSpec,
                  extra: np.ndarray | None = None) -> np.ndarray:
    """Move or swap single sequences from the most loaded rank to a less loaded one while that
    lowers the larger of the two; every move keeps each pack within capacity, max_seqs and, with
    `extra` (pieces x k), every limit of `spec.limits`."""
    d = spec.dp_size
    packs = _StepPacks.of(pack_of, rank, padded, costs, movable, spec, extra)
    rank_cost = np.bincount(rank, weights=np.bincount(packs.pack_of, weights=costs, minlength=len(rank)),
                            minlength=d)
    iterations = spec.max_iterations if spec.max_iterations is not None else 16 * d
    tolerance = 1e-9 * max(float(rank_cost.max()), 1.0)
    for _ in range(iterations):
        h = int(np.argmax(rank_cost))
        done = True
        for low in np.argsort(rank_cost, kind="stable").tolist():
            gap = rank_cost[h] - rank_cost[low]
            if low == h or gap <= tolerance:
                break
            move = packs.best_transfer(h, low, gap)
            if move is None:
                continue
            delta = packs.transfer(*move)
            rank_cost[h] -= delta
            rank_cost[low] += delta
            done = False
            break
        if done:
            break
    return packs.pack_of


@dataclass
class _StepPacks:
    """One step's packs as the local search changes them: the pack of each piece (`pack_of`,
    updated in place) and each pack's rank, padded load and count of pieces, with what a transfer
    must keep: `capacity`, `max_seqs` and, with limits, `budgets` (extra: pieces x k, extra_load:
    packs x k, limits: k)."""

    pack_of: np.ndarray
    rank: np.ndarray
    padded: np.ndarray  # int64 per piece
    costs: np.ndarray
    movable: np.ndarray
    load: np.ndarray
    count: np.ndarray
    max_seqs: int
    capacity: int
    budgets: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def of(cls, pack_of, rank, padded, costs, movable, spec: BalanceSpec, extra: np.ndarray | None) -> _StepPacks:
        """The packs of a step as balance_step dealt them; `pack_of` is copied, not changed."""
        packs = len(rank)
        pack_of = pack_of.copy()
        load = np.bincount(pack_of, weights=padded, minlength=packs).astype(np.int64)
        budgets = None
        if extra is not None and spec.limits:
            extra = np.asarray(extra, dtype=np.int64)
            extra_load = np.zeros((packs, extra.shape[1]), dtype=np.int64)
            np.add.at(extra_load, pack_of, extra)
            budgets = (extra, extra_load, np.asarray(spec.limits, dtype=np.int64))
        return cls(pack_of=pack_of, rank=rank, padded=np.asarray(padded, dtype=np.int64), costs=costs,
                   movable=movable, load=load, count=np.bincount(pack_of, minlength=packs),
                   max_seqs=spec.max_seqs_per_bin or (len(pack_of) + 1), capacity=spec.capacity, budgets=budgets)

    def transfer(self, x: int, target: int, y: int) -> float:
        """Move piece x into pack `target` and, for a swap (y >= 0), piece y into x's pack; returns
        the cost the rank of x gives the rank of `target`."""
        px = self.pack_of[x]
        self.pack_of[x] = target
        self.load[px] -= self.padded[x]
        self.load[target] += self.padded[x]
        self.count[px] -= 1
        self.count[target] += 1
        delta = self.costs[x]
        if self.budgets is not None:
            extra, extra_load, _ = self.budgets
            extra_load[px] -= extra[x]
            extra_load[target] += extra[x]
            if y >= 0:
                extra_load[target] -= extra[y]
                extra_load[px] += extra[y]
        if y >= 0:
            self.pack_of[y] = px
            self.load[target] -= self.padded[y]
            self.load[px] += self.padded[y]
            self.count[target] -= 1
            self.count[px] += 1
            delta -= self.costs[y]
        return delta

    def best_transfer(self, h: int, low: int, gap: float) -> tuple[int, int, int] | None:
        """The move (x -> a pack of `low`) or swap (x <-> y) that best splits `gap`: transfers cost
        t with 0 < t < gap, maximizing min(t, gap - t); a swap wins only when it splits better.
        None when no feasible one lowers the max. Returns (x, the pack x goes to, y or -1)."""
        piece_rank = self.rank[self.pack_of]
        xs = np.flatnonzero((piece_rank == h) & self.movable)
        if len(xs) == 0:
            return None
        best_score, best = self._best_move(xs, np.flatnonzero(self.rank == low), gap)
        ys = np.flatnonzero((piece_rank == low) & self.movable)
        if len(ys):
            score, swap = self._best_swap(xs, ys, gap)
            if score > best_score:
                best = swap
        return best

    def _best_move(self, xs: np.ndarray, low_packs: np.ndarray, gap: float) -> tuple[float, tuple | None]:
        """(score, move) of the best move of one of `xs`: x leaves a pack that keeps at least one
        piece, into the fullest of `low_packs` it fits; (0.0, None) when none splits the gap."""
        can_leave = xs[self.count[self.pack_of[xs]] > 1]
        open_packs = low_packs[self.count[low_packs] < self.max_seqs]
        if len(can_leave) == 0 or len(open_packs) == 0:
            return 0.0, None
        room = self.capacity - self.load[open_packs]
        t = self.costs[can_leave]
        fits = self.padded[can_leave][:, None] <= room[None, :]
        if self.budgets is not None:
            extra, extra_load, limits = self.budgets
            fits &= (extra[can_leave][:, None, :] <= (limits - extra_load[open_packs])[None, :, :]).all(axis=2)
        ok = fits.any(axis=1) & (t < gap) & (t > 0)
        if not ok.any():
            return 0.0, None
        score = np.where(ok, np.minimum(t, gap - t), -1.0)
        i = int(np.argmax(score))
        if not score[i] > 0.0:
            return 0.0, None
        fit_room = np.where(fits[i], room, np.iinfo(np.int64).max)
        return float(score[i]), (int(can_leave[i]), int(open_packs[np.argmin(fit_room)]), -1)

    def _best_swap(self, xs: np.ndarray, ys: np.ndarray, gap: float) -> tuple[float, tuple | None]:
        """(score, swap) of the best swap of one of `xs` with one of `ys` that keeps both packs
        within capacity (and every limit); (0.0, None) when none splits the gap."""
        t = self.costs[xs][:, None] - self.costs[ys][None, :]
        px, py = self.pack_of[xs], self.pack_of[ys]
        grow_y = self.padded[xs][:, None] - self.padded[ys][None, :]  # load change of y's pack
        ok = ((t > 0) & (t < gap) & (self.load[py][None, :] + grow_y <= self.capacity)
              & (self.load[px][:, None] - grow_y <= self.capacity))
        if self.budgets is not None and ok.any():
            extra, extra_load, limits = self.budgets
            moved = extra[xs][:, None, :] - extra[ys][None, :, :]  # what y's pack gains, x's pack loses
            ok &= ((extra_load[py][None, :, :] + moved <= limits).all(axis=2)
                   & (extra_load[px][:, None, :] - moved <= limits).all(axis=2))
        if not ok.any():
            return 0.0, None
        score = np.where(ok, np.minimum(t, gap - t), -1.0)
        i, j = divmod(int(np.argmax(score)), len(ys))
        return float(score[i, j]), (int(xs[i]), int(py[j]), int(ys[j]))


@dataclass
class BalancedPlan:
    """A plan whose packs carry (step, dp_rank, micro_batch), with per-step figures.

    Steps are numbered from 0 in this plan; under MPI the pipeline adds the steps of the ranks
    before. The grids are steps x dp_size costs per rank, under round robin of the planner's packs
    (`before_*`) and after balancing (`after_*`)."""

    plan: PackPlan
    step: np.ndarray  # int64 per pack
    dp_rank: np.ndarray
    micro_batch: np.ndarray
    step_sequences: np.ndarray  # pieces per step
    step_tokens: np.ndarray  # true tokens per step
    before_tokens: np.ndarray
    before_attention: np.ndarray
    after_tokens: np.ndarray
    after_attention: np.ndarray
    unequal_steps: int
    packs_added: int
    # --balance-cost COL: the same grids of the column's sum (None without it)
    before_cost_column: np.ndarray | None = None
    after_cost_column: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step_sequences)


def balance_plan(plan: PackPlan, spec: BalanceSpec, *, first_window: int = 0,
                 pack_shape: np.ndarray | None = None, pinned: np.ndarray | None = None,
                 context: np.ndarray | None = None) -> BalancedPlan:
    """Cut each window's packs into steps and balance each step (`balance_step`).

    grouping "cost": a window's packs are sorted by cost (ties: output order) and cut into steps
    there, so a step holds packs of similar cost and can be balanced whatever M is; the window's
    steps then run in a seeded random order (its short last step last), so no length trend is left
    inside a window. grouping "order": steps are consecutive packs in the planner's order.
    Pieces of a split sequence keep their order in the output (`_keep_split_order`).
    `first_window`: the global index of the plan's first window (it seeds the step order), so any
    run of whole windows balances the same wherever it is computed.
    `pack_shape` (one value per pack: its padded length, say) asks for warm-up: the corpus's first
    window starts with, for every shape, largest first, a run of dp_size packs of it dealt one per
    rank (`_warmup_first`), so every shape is met, and compiled, in the first steps.
    With --limit (`plan.piece_extra`, `spec.limits`) no moved sequence takes a pack over a limit;
    with `spec.cost_column` each step is balanced on the combined cost (`combined_costs`).
    `context` (--share-prefix): the tokens before each piece that it attends to (a branch: its
    prefix), which add 2 * L * context to its attention cost (the pairs it sees, doubled as L^2 is).
    """
    figures = _PieceFigures.of(plan, spec, pinned, context)
    dealt = _DealtPacks()
    for w in range(plan.num_windows):
        steps = _cut_window(plan, spec, figures, w, first_window + w, pack_shape)
        # each step balanced on its own, whatever its place in the run: the order of the steps may
        # then look at their packs as written (the longest sequence of each, after the moves)
        selected, results = _balance_steps(plan, spec, figures, steps)
        run = _run_order(plan, spec, steps, selected, results, figures.split)
        dealt.add_window(plan, selected, results, run, figures.split)
    return dealt.balanced(plan, spec, figures)


@dataclass(frozen=True)
class _PieceFigures:
    """What balancing reads of the plan's pieces and packs: per piece `padded` (int64, the loads
    capacity bounds), `true` (float64 lengths of the token figures: padded with spec.padded_cost),
    `costs` (what is balanced), `attention` (what is reported), `split` (a piece of a sequence cut
    in pieces), `movable` (neither split nor pinned), `extra` (pieces x k with --limit, else None)
    and `media` (--balance-cost's column as float64, else None); per pack `pack_cost` and
    `pack_tokens` (padded), and `pack_of_piece`."""

    padded: np.ndarray
    true: np.ndarray
    costs: np.ndarray
    attention: np.ndarray
    split: np.ndarray
    movable: np.ndarray
    extra: np.ndarray | None
    media: np.ndarray | None
    pack_of_piece: np.ndarray
    pack_cost: np.ndarray
    pack_tokens: np.ndarray

    @classmethod
    def of(cls, plan: PackPlan, spec: BalanceSpec, pinned: np.ndarray | None,
           context: np.ndarray | None) -> _PieceFigures:
        true = (plan.piece_padded if spec.padded_cost else plan.piece_len).astype(np.float64)
        costs = piece_costs(true, spec.cost, spec.attn_coeff)
        attention = piece_costs(true, "attention", spec.attn_coeff)
        if context is not None:
            attention = attention + 2 * true * context
            costs = attention if spec.cost == "attention" else costs
        split = plan.split_pieces()[0]
        media = None
        if spec.cost_column is not None:
            if plan.piece_extra is None:
                raise ValueError("balance_plan: spec.cost_column needs a plan with piece_extra (--limit)")
            media = plan.piece_extra[:, spec.cost_column].astype(np.float64)
        pack_of_piece = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
        return cls(padded=plan.piece_padded.astype(np.int64), true=true, costs=costs, attention=attention,
                   split=split, movable=~split if pinned is None else ~split & ~pinned,
                   extra=plan.piece_extra if spec.limits and plan.piece_extra is not None else None,
                   media=media, pack_of_piece=pack_of_piece,
                   pack_cost=np.bincount(pack_of_piece, weights=costs, minlength=plan.num_bins),
                   pack_tokens=plan.loads(padded=True))


@dataclass(frozen=True)
class _WindowSteps:
    """A window's packs (lo..hi) cut into steps: step s holds packs[bounds[s]:bounds[s + 1]], the
    first `warm_steps` of them warm-up steps; `window` is the window's global index."""

    lo: int
    hi: int
    window: int
    packs: np.ndarray
    bounds: np.ndarray
    warm_steps: int = 0

    @property
    def num(self) -> int:
        return len(self.bounds) - 1


def _cut_window(plan: PackPlan, spec: BalanceSpec, figures: _PieceFigures, w: int, window: int,
                pack_shape: np.ndarray | None) -> _WindowSteps:
    """Window w (global index `window`) cut into steps: the steps planned with the packs
    (--group-scope step), else its packs in the order of `spec.grouping` cut by `step_bounds`,
    after the warm-up runs of `pack_shape` in the corpus's first window."""
    lo, hi = int(plan.window_bins[w]), int(plan.window_bins[w + 1])
    if plan.step_bins is not None:  # steps planned with the packs (--group-scope step)
        return _WindowSteps(lo, hi, window, np.arange(lo, hi), planned_step_bounds(plan.step_bins, lo, hi))
    if spec.grouping == "cost":
        packs = lo + np.argsort(-figures.pack_cost[lo:hi], kind="stable")
    else:
        packs = np.arange(lo, hi)
    if pack_shape is None or window != 0:
        bounds = step_bounds(figures.pack_tokens[packs], np.array([0, hi - lo]), spec)
        return _WindowSteps(lo, hi, window, packs, bounds)
    packs, warm = _warmup_first(packs, np.asarray(pack_shape), spec.dp_size)
    per_step = spec.dp_size * spec.micro_batches if spec.micro_batches is not None else spec.dp_size
    warm_steps = -(-warm // per_step) if warm else 0
    rest = step_bounds(figures.pack_tokens[packs[warm_steps * per_step:]],
                       np.array([0, hi - lo - min(warm_steps * per_step, hi - lo)]), spec)
    bounds = np.unique(np.concatenate([np.arange(0, warm_steps * per_step, per_step),
                                       warm_steps * per_step + rest]).clip(max=hi - lo))
    return _WindowSteps(lo, hi, window, packs, bounds, warm_steps)


def _balance_steps(plan: PackPlan, spec: BalanceSpec, figures: _PieceFigures,
                   steps: _WindowSteps) -> tuple[list[np.ndarray], list[StepResult]]:
    """Each step of the window balanced on its own (`balance_step`; warm-up steps strided): the
    plan's pieces of each step, pack after pack, and its result."""
    selected, results = [], []
    for s in range(steps.num):
        members = steps.packs[steps.bounds[s]:steps.bounds[s + 1]]
        sel = _pieces_of(plan.bin_offsets, members)
        counts = plan.bin_offsets[members + 1] - plan.bin_offsets[members]
        selected.append(sel)
        results.append(balance_step(np.concatenate([[0], np.cumsum(counts)]), figures.padded[sel],
                                    figures.costs[sel], figures.movable[sel], spec, strided=s < steps.warm_steps,
                                    extra=None if figures.extra is None else figures.extra[sel],
                                    media=None if figures.media is None else figures.media[sel]))
    return selected, results


def _run_order(plan: PackPlan, spec: BalanceSpec, steps: _WindowSteps, selected: list[np.ndarray],
               results: list[StepResult], split: np.ndarray) -> np.ndarray:
    """The order the window's steps run in: `spec.step_order` (`_step_priority`), else with
    grouping "cost" a seeded random order with the short last step last, else the planner's;
    warm-up steps first, and a step with an earlier piece of a split sequence before the step
    with a later one (`_steps_in_split_order`)."""
    num = steps.num
    if num <= 1:
        return np.arange(num)
    step_of_pack = np.empty(plan.num_bins, dtype=np.int64)
    step_of_pack[steps.packs] = np.repeat(np.arange(num), np.diff(steps.bounds))
    linked = _split_step_pairs(step_of_pack, plan, steps.lo, steps.hi, split)
    if spec.step_order != "planner":
        written = [np.maximum.reduceat(plan.piece_len[sel[r.pieces]], r.offsets[:-1]) if len(r.pieces) else
                   np.zeros(0, np.int64) for sel, r in zip(selected, results)]
        priority = _step_priority(plan, steps.packs, steps.bounds, spec, steps.window, steps.warm_steps, linked,
                                  written)
    elif spec.grouping == "cost" and num > 2:
        priority = np.concatenate([np.random.default_rng([spec.seed, steps.window]).permutation(num - 1),
                                   [num - 1]])
    else:
        priority = np.arange(num)
    if steps.warm_steps:
        priority = priority.copy()
        priority[:steps.warm_steps] = np.arange(steps.warm_steps) - steps.warm_steps - num  # before every other step
    return _steps_in_split_order(priority, linked)


@dataclass
class _DealtPacks:
    """The balanced packs of the windows so far, in run order: CSR over the plan's pieces
    (`offsets`, `pieces`: one array per window), each pack's step, dp rank and micro-batch (one
    array per step), the first pack of every window, and how many steps have unequal counts."""

    offsets: list[np.ndarray] = field(default_factory=lambda: [np.zeros(1, np.int64)])
    pieces: list[np.ndarray] = field(default_factory=list)
    steps: list[np.ndarray] = field(default_factory=list)
    ranks: list[np.ndarray] = field(default_factory=list)
    micros: list[np.ndarray] = field(default_factory=list)
    windows: list[int] = field(default_factory=lambda: [0])
    num_steps: int = 0
    num_pieces: int = 0
    unequal: int = 0

    def add_window(self, plan: PackPlan, selected: list[np.ndarray], results: list[StepResult],
                   run: np.ndarray, split: np.ndarray) -> None:
        """Append a window's balanced steps (`selected`: each step's pieces, `results` its
        balancing) in the order `run` gives, the pieces of split sequences put back in order."""
        offsets, pieces, base = [np.zeros(1, np.int64)], [], 0
        for k, s in enumerate(run.tolist()):
            sel, result = selected[s], results[s]
            offsets.append(result.offsets[1:] + base)
            base += len(sel)
            pieces.append(sel[result.pieces])
            self.ranks.append(result.dp_rank)
            self.micros.append(result.micro_batch)
            self.steps.append(np.full(len(result.dp_rank), self.num_steps + k, dtype=np.int64))
            self.unequal += not result.equal
        w_offsets = np.concatenate(offsets)
        w_pieces = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        w_pieces, w_offsets = _keep_split_order(w_pieces, w_offsets, plan.piece_gid, split)
        self.offsets.append(w_offsets[1:] + self.num_pieces)
        self.num_pieces += len(w_pieces)
        self.pieces.append(w_pieces)
        self.windows.append(self.windows[-1] + len(w_offsets) - 1)
        self.num_steps += len(run)

    def balanced(self, plan: PackPlan, spec: BalanceSpec, figures: _PieceFigures) -> BalancedPlan:
        """The plan of the dealt packs, with the per-step figures before balancing (the planner's
        packs in output order, round robin over consecutive steps) and after."""
        d, num_steps = spec.dp_size, self.num_steps
        take = np.concatenate(self.pieces) if self.pieces else np.zeros(0, np.int64)
        new_offsets = np.concatenate(self.offsets)
        balanced = PackPlan(
            window_bins=np.asarray(self.windows, dtype=np.int64), bin_offsets=new_offsets,
            piece_gid=plan.piece_gid[take], piece_start=plan.piece_start[take], piece_len=plan.piece_len[take],
            piece_padded=plan.piece_padded[take], dropped=plan.dropped, truncated=plan.truncated,
            tokens_dropped=plan.tokens_dropped, tokens_truncated=plan.tokens_truncated,
            piece_extra=plan.take_pieces(take), over_limit=plan.over_limit)
        cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))
        step, dp_rank, micro_batch = cat(self.steps), cat(self.ranks), cat(self.micros)

        def grid(cell: np.ndarray, weights: np.ndarray, steps_in: int) -> np.ndarray:
            return np.bincount(cell, weights=weights, minlength=steps_in * d).reshape(steps_in, d)

        rr_bounds = (plan.step_bins if plan.step_bins is not None
                     else step_bounds(figures.pack_tokens, plan.window_bins, spec))
        rr_step = np.searchsorted(rr_bounds, figures.pack_of_piece, side="right") - 1
        before_cell = rr_step * d + (figures.pack_of_piece - rr_bounds[rr_step]) % d
        rr_steps = len(rr_bounds) - 1
        new_pack = np.repeat(np.arange(balanced.num_bins), np.diff(new_offsets))
        piece_step = step[new_pack]
        after_cell = piece_step * d + dp_rank[new_pack]
        true, attention, media = figures.true, figures.attention, figures.media
        return BalancedPlan(
            plan=balanced, step=step, dp_rank=dp_rank, micro_batch=micro_batch,
            step_sequences=np.bincount(piece_step, minlength=num_steps).astype(np.int64),
            step_tokens=np.bincount(piece_step, weights=balanced.piece_len, minlength=num_steps).astype(np.int64),
            before_tokens=grid(before_cell, true, rr_steps),
            before_attention=grid(before_cell, attention, rr_steps),
            after_tokens=grid(after_cell, true[take], num_steps),
            after_attention=grid(after_cell, attention[take], num_steps),
            unequal_steps=self.unequal, packs_added=balanced.num_bins - plan.num_bins,
            before_cost_column=None if media is None else grid(before_cell, media, rr_steps),
            after_cost_column=None if media is None else grid(after_cell, media[take], num_steps),
        )


def _step_priority(plan: PackPlan, packs: np.ndarray, bounds: np.ndarray, spec: BalanceSpec, window: int,
                   warm_steps: int, linked: np.ndarray | None = None,
                   written: list[np.ndarray] | None = None) -> np.ndarray:
    """The run position of each of a window's steps for `spec.step_order` (plan/pack_order.py): a
    step is kept whole, and the window's short step (fewer than D x M packs) runs wherever the
    order puts it. Warm-up steps stay first. `longest` and `mean` key a step by its longest
    sequence or its mean sequence length.

    `shuffle` leaves no trend of the packs' longest sequence with their position, which is what
    `packctl stats` checks: a step is keyed by the ranks of its packs' longest sequences as
    balanced (`written`, each step's), less the window's mean rank, summed; the shuffle
    decorrelates position from those sums, so a step of one long pack and seven short ones
    counts for what it adds: packs of ranks [9 8] in step A and [1 0] in step B, the window's
    mean rank 4.5, key A +8 and B -8. `linked` (`_split_step_pairs`: step a holds an earlier piece of a
    sequence than step b) makes the steps of a split sequence one unit, side by side, as packs
    are without --dp-size (`pack_order.split_units`); dealt apart, the topological order of
    `_steps_in_split_order` then put a sequence's full pieces (long) before its tail (short).
    Keyed by the step's longest sequence with its split steps apart, 10 of 40 seeds of
    sample_data at --dp-size 4 --micro-batches 2 are over the 0.05 bound (up to 0.15); so keyed
    and linked, none is over 0.011 (docs/algorithms.md)."""
    num = len(bounds) - 1
    keys = pack_keys(plan, "mean" if spec.step_order == "mean" else "longest")
    step = np.repeat(np.arange(num), np.diff(bounds))
    pieces = np.bincount(step, weights=np.diff(plan.bin_offsets)[packs], minlength=num)
    if spec.step_order == "shuffle" and written is not None:
        sizes = np.array([len(longest) for longest in written], dtype=np.int64)
        ranks = average_ranks(np.concatenate(written))
        step_keys = np.bincount(np.repeat(np.arange(num), sizes), weights=ranks - ranks.mean(), minlength=num)
    elif spec.step_order == "mean":
        tokens = np.bincount(step, weights=keys[packs] * np.diff(plan.bin_offsets)[packs], minlength=num)
        step_keys = tokens / np.maximum(pieces, 1)
    else:
        step_keys = np.full(num, -np.inf)
        np.maximum.at(step_keys, step, keys[packs])
    first = warm_steps
    before = None
    if spec.step_order == "shuffle" and linked is not None and len(linked):
        before = linked[(linked >= first).all(axis=1)] - first
    rest = first + window_permutation(step_keys[first:], spec.step_order,
                                      np.random.default_rng(order_seed(spec.seed, window)), before,
                                      values=step_keys[first:] if spec.step_order == "shuffle" else None)
    run = np.concatenate([np.arange(first), rest])
    priority = np.empty(num, dtype=np.int64)
    priority[run] = np.arange(num)
    return priority


def _split_step_pairs(step_of_pack: np.ndarray, plan: PackPlan, lo: int, hi: int,
                      pinned: np.ndarray) -> np.ndarray | None:
    """(a, b) for each step a holding a piece of a split sequence whose next piece is in step b
    (steps of the window lo..hi), without repeats; None when no sequence spans two steps.

        sequence x cut in 3: piece 0 in step 4, piece 1 in step 4, piece 2 in step 1  ->  [[4, 1]]
    """
    p_lo, p_hi = int(plan.bin_offsets[lo]), int(plan.bin_offsets[hi])
    split = np.flatnonzero(pinned[p_lo:p_hi]) + p_lo
    if len(split) == 0:
        return None
    pack = np.searchsorted(plan.bin_offsets, split, side="right") - 1
    order = np.lexsort((split, plan.piece_gid[split]))
    g, st = plan.piece_gid[split][order], step_of_pack[pack[order]]
    cross = np.flatnonzero((g[1:] == g[:-1]) & (st[1:] != st[:-1]))
    if len(cross) == 0:
        return None
    return np.unique(np.stack([st[cross], st[cross + 1]], axis=1).astype(np.int64), axis=0)


def _steps_in_split_order(priority: np.ndarray, linked: np.ndarray | None) -> np.ndarray:
    """The window's steps in `priority` order, except that a step holding an earlier piece of a
    split sequence runs before the step holding a later one (`linked`, `_split_step_pairs`: a
    topological order of those constraints, ties by priority). On a cycle the rest follow by
    priority; `_keep_split_order` then fixes the packs involved."""
    num = len(priority)
    after: dict[int, set[int]] = {}
    indegree = np.zeros(num, dtype=np.int64)
    for a, b in ([] if linked is None else linked.tolist()):
        if b not in after.setdefault(a, set()):
            after[a].add(b)
            indegree[b] += 1
    heap = [(int(priority[s]), s) for s in range(num) if indegree[s] == 0]
    heapq.heapify(heap)
    out: list[int] = []
    placed = np.zeros(num, dtype=bool)
    while len(out) < num:
        if not heap:  # a cycle: take the remaining step of lowest priority
            rest = np.flatnonzero(~placed)
            s = int(rest[np.argmin(priority[rest])])
            heapq.heappush(heap, (int(priority[s]), s))
            indegree[s] = 0
        _, s = heapq.heappop(heap)
        if placed[s]:
            continue
        placed[s] = True
        out.append(s)
        for b in after.get(s, ()):
            indegree[b] -= 1
            if indegree[b] == 0 and not placed[b]:
                heapq.heappush(heap, (int(priority[b]), b))
    return np.asarray(out, dtype=np.int64)


def _warmup_first(packs: np.ndarray, shape: np.ndarray, d: int) -> tuple[np.ndarray, int]:
    """`packs` reordered with, first, for every shape (largest first) a run of `d` packs of it
    (fewer when the window has fewer): strided over the ranks, each run gives every rank one pack
    of its shape. Returns the order and how many packs lead."""
    taken = np.zeros(len(packs), dtype=bool)
    lead: list[np.ndarray] = []
    of_pack = shape[packs]
    for value in np.unique(of_pack)[::-1].tolist():
        mine = np.flatnonzero(of_pack == value)[:d]
        taken[mine] = True
        lead.append(mine)
    first = np.concatenate(lead) if lead else np.zeros(0, np.int64)
    return np.concatenate([packs[first], packs[~taken]]), len(first)


def _pieces_of(bin_offsets: np.ndarray, packs: np.ndarray) -> np.ndarray:
    """Piece indices of the given packs, pack after pack."""
    starts = bin_offsets[packs]
    counts = bin_offsets[packs + 1] - starts
    return np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(int(counts.sum()))


def _keep_split_order(pieces: np.ndarray, offsets: np.ndarray, gid: np.ndarray, pinned: np.ndarray):
    """Put the pieces of every split sequence back in their original order.

    Packs linked by a split sequence (they hold pieces of the same sample) form a group; the
    group's packs keep the output slots they were given, but take them in their original
    relative order, which had the pieces in order. Pieces that never move (`pinned`) are exactly
    the split ones, so only these groups need it."""
    num_packs = len(offsets) - 1
    pack = np.repeat(np.arange(num_packs), np.diff(offsets))
    split = np.flatnonzero(pinned[pieces])
    if len(split) == 0:
        return pieces, offsets
    parent = list(range(num_packs))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    by_gid: dict[int, int] = {}
    for i in split.tolist():
        g, p = int(gid[pieces[i]]), int(pack[i])
        if g in by_gid:
            a, b = find(by_gid[g]), find(p)
            if a != b:
                parent[max(a, b)] = min(a, b)
        else:
            by_gid[g] = p
    groups: dict[int, list[int]] = {}
    for p in sorted({int(pack[i]) for i in split.tolist()}):
        groups.setdefault(find(p), []).append(p)
    slot_of = np.arange(num_packs)
    for members in groups.values():
        if len(members) < 2:
            continue
        # original order of a pack = the smallest original index of its split pieces (these never
        # move, and the planner's order had them in order)
        first = [int(pieces[offsets[p]:offsets[p + 1]][pinned[pieces[offsets[p]:offsets[p + 1]]]].min())
                 for p in members]
        in_order = [members[i] for i in np.argsort(first, kind="stable")]
        slot_of[in_order] = sorted(members)
    order = np.argsort(slot_of, kind="stable")  # pack now in slot j
    counts = np.diff(offsets)[order]
    new_pieces = pieces[_pieces_of(offsets, order)]
    return new_pieces, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def imbalance(grid: np.ndarray) -> np.ndarray:
    """max / mean over ranks, per step (a step with no cost counts 1.0)."""
    grid = np.asarray(grid, dtype=np.float64)
    if grid.size == 0:
        return np.zeros(0)
    mean = grid.mean(axis=1)
    return np.where(mean > 0, grid.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def imbalance_summary(grid: np.ndarray) -> dict:
    """Per-step max/mean summarized: mean and worst over steps, and `weighted` = sum over steps
    of the slowest rank / sum of the mean rank (the share of a run's time spent waiting is
    1 - 1/weighted)."""
    return imbalance_summary_of_steps(*step_figures(grid))


def step_figures(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `imbalance_summary` needs of each step (a row of `grid`, one cost per rank): its
    imbalance, mean and max. Row by row, so the figures of consecutive runs of steps, laid end to
    end, are those of all the steps."""
    grid = np.asarray(grid, dtype=np.float64)
    if grid.size == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    return imbalance(grid), grid.mean(axis=1), grid.max(axis=1)


def imbalance_summary_of_steps(per_step: np.ndarray, step_mean: np.ndarray, step_max: np.ndarray) -> dict:
    """`imbalance_summary` from `step_figures` (of every step, in step order)."""
    if len(per_step) == 0:
        return {"mean": 1.0, "max": 1.0, "weighted": 1.0, "worst_step": None}
    mean_total = step_mean.sum()
    worst = int(np.argmax(per_step))
    return {"mean": float(per_step.mean()), "max": float(per_step[worst]),
            "weighted": float(step_max.sum() / mean_total) if mean_total > 0 else 1.0,
            "worst_step": worst}


def lr_scales(sizes: np.ndarray, ref: float, scaling: str) -> np.ndarray:
    """Learning-rate multiplier of each step from its realized batch size (DeepSpeed's variable
    batch-size rule): linear `size / ref`, sqrt `sqrt(size / ref)`, none 1.0.

        >>> lr_scales(np.array([512, 256, 1024]), 512, "sqrt").round(3).tolist()
        [1.0, 0.707, 1.414]
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    if scaling == "none":
        return np.ones(len(sizes))
    ratio = sizes / float(ref)
    return ratio if scaling == "linear" else np.sqrt(ratio)

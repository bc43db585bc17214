"""The order stage of a blend of sources (`--source`, docs/mixtures.md): the uses every source
gives (plan/mixture.py `draw_uses`), each source's uses in the run's order, the sources
interleaved so every window holds the blend, and this rank's whole windows of it.

    --source web=W:0.75 --source code=C:0.25, --order shuffle:
      web's uses shuffled, code's uses shuffled, then merged by their place on their source's axis
      -> w c w w c w w w c w ...  -> windows of --window uses, dealt to ranks as order.py deals them

Every rank computes the same global order from every gid's length (gathered once: 8 bytes a
sequence on each rank, as the group starts of --group-column are), so the order and the plan of
every window do not depend on the number of ranks.
"""
from __future__ import annotations

import numpy as np

from packctl.plan.align import round_up
from packctl.errors import PackctlError
from packctl.mpi.comm import Comm
from packctl.plan.mixture import (SEQUENCES, Blend, Draw, EmptySource, RepeatOverCap, blend_groups, draw_blend,
                                  interleave, member_uses, source_order, uses_of, window_deviation)
from packctl.specs import MixtureSpec, OrderSpec


def gathered_lengths(comm: Comm, index) -> tuple[np.ndarray, np.ndarray | None]:
    """Every gid's true length (and --limit costs), on every rank: ranks scanned runs of gids in rank order."""
    lengths = np.concatenate(comm.allgather(np.asarray(index.lengths, dtype=np.int64)))
    extra = getattr(index, "extra", None)
    if extra is not None:
        extra = np.concatenate(comm.allgather(extra), axis=0)
    return lengths, extra


def draw(lengths: np.ndarray, mix: MixtureSpec, skip_empty: bool,
         groups: np.ndarray | None = None) -> tuple[Draw, list[np.ndarray]]:
    """The uses of every row of every source (`lengths`: every gid's), and each source's gids
    that may be drawn (with --skip-empty, those of rows that are not empty); a mix that needs more
    passes over a source than its cap is refused naming the source and the cap it would need."""
    epochs_of = mix.names.index(mix.epochs_of) if mix.epochs_of is not None else None
    try:
        blend = Blend(gid_starts=mix.gid_starts, weights=mix.weights, caps=mix.max_repeats, unit=mix.unit,
                      size=mix.size, epochs_of=epochs_of, seed=mix.seed)
        return draw_blend(lengths, blend, skip_empty=skip_empty, group_starts=groups)
    except RepeatOverCap as exc:
        name, cap = mix.names[exc.source], _cap_needed(exc.needed)
        raise PackctlError(
            f"--source {name}: the mix needs {exc.needed:.4g} passes over its {exc.size:,} {mix.unit} "
            f"({exc.target:,.0f} of {_size_text(mix)} at weight {mix.weights[exc.source]:.4g}), more than its cap "
            f"max-repeat {exc.cap:g}; raise its cap to {cap} ({name}=PATH:WEIGHT:{cap}, or max-repeat in "
            f"[sources.{name}]), lower its weight, or ask for fewer --tokens", everywhere=True) from None
    except EmptySource as exc:
        raise PackctlError(f"--source {mix.names[exc.source]}: holds no {mix.unit} to draw from; give it a "
                           "non-empty input, or leave it out", everywhere=True) from None


def _size_text(mix: MixtureSpec) -> str:
    if mix.size is not None:
        return f"--tokens {mix.size:,}"
    if mix.epochs_of is not None:
        return f"--epochs-of {mix.epochs_of}"
    return "the largest blend that repeats no source"


def _cap_needed(needed: float) -> str:
    """The cap that allows `needed` passes, rounded up to 2 decimals: 2.341 -> '2.35'."""
    return f"{np.ceil(needed * 100 - 1e-9) / 100:g}"


def blend_order(lengths: np.ndarray, spec: OrderSpec, group_starts: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, Draw, np.ndarray | None]:
    """The global order of one epoch's uses (spec.seed: the epoch's): their gids and sources, and
    with --group-column (`group_starts`) True on the first row of each use of a group.

    Groups are drawn and interleaved whole (a group's units: its rows' summed); each use of a
    group then becomes its rows in gid order (with --skip-empty, those not empty), the order the
    order stage keeps groups in without a blend.

        group_starts [0, 2, 3], group uses in order [2, 0] -> gids [2, 0, 1], starts [T, T, F]"""
    mix = spec.mixture
    groups = None if group_starts is None else blend_groups(group_starts, mix.gid_starts)
    found, gids = draw(lengths, mix, spec.skip_empty, groups)
    padded_of = round_up(np.asarray(lengths, dtype=np.int64), spec.align)
    if groups is not None:
        first = groups[:-1]
        size_of = np.zeros(len(lengths), np.int64)
        size_of[first] = np.add.reduceat(np.asarray(lengths, dtype=np.int64), first) if len(first) else 0
        padded = np.zeros(len(lengths), np.int64)
        padded[first] = np.add.reduceat(padded_of, first) if len(first) else 0
        rows = np.zeros(len(lengths), np.int64)
        rows[first] = np.diff(groups)
    else:
        size_of, padded, rows = np.asarray(lengths, dtype=np.int64), padded_of, np.ones(len(lengths), np.int64)
    ordered_gids, units = [], []
    for k, (ids, counts) in enumerate(zip(gids, found.counts)):
        use_gids, passes = uses_of(ids, counts)
        perm = source_order(use_gids, passes, padded[use_gids], str(spec.order), seed=spec.seed, source=k,
                            num_sequences=len(lengths), curriculum_order=str(spec.curriculum_order))
        ordered_gids.append(use_gids[perm])
        units.append((rows if mix.unit == SEQUENCES else size_of)[use_gids[perm]])
    positions = interleave(units)
    all_gids = np.concatenate(ordered_gids) if ordered_gids else np.zeros(0, np.int64)
    source_of = np.repeat(np.arange(len(gids), dtype=np.int64), [len(g) for g in ordered_gids])
    all_gids, source_of = all_gids[positions], source_of[positions]
    if groups is None:
        return all_gids, source_of, found, None
    counts = rows[all_gids]
    member = np.repeat(all_gids, counts) + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
    starts = np.zeros(len(member), dtype=bool)
    starts[np.cumsum(counts) - counts] = True
    source_of = np.repeat(source_of, counts)
    if spec.skip_empty:  # an empty row takes no place; a group's first kept row starts its use
        use = np.cumsum(starts) - 1
        kept = lengths[member] > 0
        member, source_of, use = member[kept], source_of[kept], use[kept]
        starts = np.ones(len(member), dtype=bool)
        starts[1:] = use[1:] != use[:-1]
    return member, source_of, found, starts


def order_blend(comm: Comm, index, spec: OrderSpec, epoch: int):
    """This rank's whole windows of the blend's global order (pipeline/order.py `Ordered`), dealt
    to ranks by the rule of `order.window_owners`: rank r plans the windows whose middle lies in
    the r-th of comm.size equal parts of every epoch's sequences. With --group-column windows
    count uses of groups, so a group never straddles a window, nor a rank (the order stage then
    checks that every group fits, as without a blend)."""
    from packctl.pipeline.ordered import Ordered

    lengths, extra = gathered_lengths(comm, index)
    group_starts = getattr(index, "group_starts", None)
    gids, _, _, starts = blend_order(lengths, spec, group_starts)
    if starts is not None:
        ordered = _windows_of(comm, spec, epoch, np.flatnonzero(starts), len(gids))
        lo_row, hi_row, first, num_windows = ordered
        gids, starts = gids[lo_row:hi_row], starts[lo_row:hi_row]
        out = Ordered(gids=gids, lengths=lengths[gids], first_window=min(first, num_windows), new_group=starts,
                      group_starts=group_starts, extra=None if extra is None else np.ascontiguousarray(extra[gids]))
        return out
    lo_row, hi_row, first, num_windows = _windows_of(comm, spec, epoch, np.arange(len(gids)), len(gids))
    gids = gids[lo_row:hi_row]  # every row a use of its own
    return Ordered(gids=gids, lengths=lengths[gids], first_window=min(first, num_windows),
                   extra=None if extra is None else np.ascontiguousarray(extra[gids]))


def check_uses_fit_step(comm: Comm, ordered, index, windows) -> None:
    """A blend's steps (--dp-size with --micro-batches) are planned from runs of its uses, each
    step into at most its packs: a use that --too-long split cuts into more pieces than that
    cannot be placed. Names the one of smallest gid, on every rank.

        capacity 512, 2 packs a step: a use of 1,200 tokens is 3 pieces -> refused"""
    if not windows.step_scope or windows.step_packs is None or str(windows.too_long) != "split":
        return
    pieces = -(-np.asarray(ordered.lengths, dtype=np.int64) // windows.capacity)
    over = np.flatnonzero(pieces > windows.step_packs)
    mine = [] if not len(over) else [min((int(ordered.gids[i]), int(ordered.lengths[i]), int(pieces[i]))
                                         for i in over.tolist())]
    found = [f for part in comm.allgather(mine) for f in part]
    if found:
        gid, length, count = min(found)
        raise PackctlError(
            f"{index.describe(gid)}: --too-long split cuts this sequence of {length:,} tokens into {count} packs, "
            f"more than the {windows.step_packs} packs of an optimizer step (--dp-size x --micro-batches); a "
            "blend's steps are planned from its consecutive sequences: raise --micro-batches or --capacity, or "
            "pass --too-long truncate or drop", everywhere=True)


def _windows_of(comm: Comm, spec: OrderSpec, epoch: int, use_first: np.ndarray, rows: int):
    """This rank's rows [lo, hi) of an order of group uses (`use_first`: each use's first row),
    its first window and the number of windows: windows of --window uses, dealt as `order_blend`
    deals windows of rows."""
    total = len(use_first)
    num_windows = -(-total // spec.window)
    lo = np.arange(num_windows, dtype=np.int64) * spec.window
    hi = np.minimum(lo + spec.window, total)
    middle2 = 2 * epoch * total + lo + hi
    owner = np.minimum(middle2 * comm.size // (2 * spec.epochs * max(total, 1)), comm.size - 1)
    mine = np.flatnonzero(owner == comm.rank)
    first = int(np.count_nonzero(owner < comm.rank))
    edges = np.append(use_first, rows)
    if not len(mine):
        return 0, 0, first, num_windows
    return int(edges[lo[mine[0]]]), int(edges[hi[mine[-1]]]), first, num_windows


def blend_metrics(comm: Comm, index, spec: OrderSpec, planned=None) -> dict:
    """`_metrics.json`'s `mixture`: per source its rows, the rows used, uses, tokens, passes
    (uses / rows drawn from), target and realized share of the output's units, and the worst
    |share - target| over the windows of epoch 0 (and with --dp-size over its steps: `planned`,
    this rank's plan of epoch 0)."""
    mix = spec.mixture
    lengths, _ = gathered_lengths(comm, index)
    gids, source_of, found, _ = blend_order(lengths, spec, getattr(index, "group_starts", None))
    units = np.ones(len(gids), np.int64) if mix.unit == SEQUENCES else lengths[gids]
    weights = np.asarray(mix.weights)
    worst = window_deviation(source_of, units, spec.window, weights)
    total_units = max(int(units.sum()), 1)
    sources = []
    for k, name in enumerate(mix.names):
        mine = source_of == k
        rows = mix.gid_starts[k + 1] - mix.gid_starts[k]
        counts = found.counts[k]
        drawn_from = len(counts)
        sources.append({
            "name": name, "weight": float(mix.weights[k]), "max_repeat": float(mix.max_repeats[k]),
            "rows": int(rows), "rows_used": int(np.count_nonzero(counts)), "uses": int(mine.sum()),
            "tokens": int(lengths[gids[mine]].sum()),
            "repeats": float(counts.sum() / drawn_from) if drawn_from else 0.0,
            "max_uses_of_a_row": int(counts.max()) if drawn_from else 0,
            "realized": float(units[mine].sum() / total_units),
            "worst_window_deviation": float(worst[k]),
        })
    report = {"unit": mix.unit, "size": float(found.size), "window": spec.window, "sources": sources,
              "worst_window_deviation": float(worst.max()) if len(worst) else 0.0}
    steps = step_deviation(comm, planned, mix) if planned is not None else None
    if steps is not None:
        for entry, deviation in zip(sources, steps):
            entry["worst_step_deviation"] = float(deviation)
        report["worst_step_deviation"] = float(steps.max())
    return report


def with_mixture(specs, config, index, source_files: list[int] | None):
    """`specs` with the blend of `config.sources` in its order stage (None: no blend): the
    weights normalized to sum 1, each source's cap (its own, else --max-repeat) and gid run."""
    if source_files is None:
        return specs
    import dataclasses

    entries = config.source_entries()
    total = sum(e.weight for e in entries)
    mix = MixtureSpec(names=tuple(e.name for e in entries), weights=tuple(e.weight / total for e in entries),
                      max_repeats=tuple(float(e.max_repeat if e.max_repeat is not None else config.max_repeat)
                                        for e in entries),
                      gid_starts=tuple(int(index.file_offsets[f]) for f in source_files),
                      file_starts=tuple(int(f) for f in source_files), unit=config.mix_unit,
                      size=config.tokens, epochs_of=config.epochs_of, seed=config.seed)
    return dataclasses.replace(specs, order=dataclasses.replace(specs.order, mixture=mix))


def source_table(mix: MixtureSpec, files, fingerprints) -> list[dict]:
    """The manifest's `sources`: per source its name, weight (normalized), cap, the manifest's
    `inputs` it reads ([first, end) of their indices), its gids ([first, end)) and a fingerprint of
    its files (sha256 of each file's path, rows, size and footer digest)."""
    import hashlib
    import json

    table = []
    for k, name in enumerate(mix.names):
        first, end = mix.file_starts[k], mix.file_starts[k + 1]
        described = [[f.path, f.rows, f.bytes, fingerprints[i].footer if fingerprints else None]
                     for i, f in enumerate(files) if first <= i < end]
        table.append({"name": name, "weight": mix.weights[k], "max_repeat": mix.max_repeats[k],
                      "inputs": [first, end], "gids": [mix.gid_starts[k], mix.gid_starts[k + 1]],
                      "fingerprint": hashlib.sha256(json.dumps(described).encode()).hexdigest()})
    return table


def blend_corpus(comm: Comm, index, spec: OrderSpec, corpus):
    """The corpus counts of a blend: what it feeds the planner is its uses (a row drawn twice is
    two sequences in), so the manifest's identities (tokens_in = packed + dropped + truncated)
    hold; rows never drawn, empty ones among them, are not in it."""
    import dataclasses

    lengths, _ = gathered_lengths(comm, index)
    group_starts = getattr(index, "group_starts", None)
    groups = None if group_starts is None else blend_groups(group_starts, spec.mixture.gid_starts)
    found, gids = draw(lengths, spec.mixture, spec.skip_empty, groups)
    per_row = member_uses(len(lengths), gids, found.counts, groups)
    if spec.skip_empty:
        per_row[lengths == 0] = 0
    uses = int(per_row.sum())
    tokens = int((per_row * lengths).sum())
    return dataclasses.replace(corpus, sequences=uses, tokens=tokens, skipped_empty=0)


def step_deviation(comm: Comm, planned, mix: MixtureSpec) -> np.ndarray | None:
    """Each source's worst |share - weight| over the optimizer steps (--dp-size) of one epoch's
    plan, in the blend's unit (tokens written, or sequences: pieces that start one); None without
    steps. Every step lies in one window, so whole on one rank: each rank measures its own."""
    if planned.balanced is None:
        return None
    plan = planned.plan
    step_of_pack = np.asarray(planned.balanced.result.step, dtype=np.int64)
    k = len(mix.names)
    worst = np.zeros(k)
    if plan.num_bins:
        step = np.repeat(step_of_pack, np.diff(plan.bin_offsets))
        source = np.searchsorted(np.asarray(mix.gid_starts, dtype=np.int64), plan.piece_gid, side="right") - 1
        units = plan.piece_len if mix.unit != SEQUENCES else (plan.piece_start == 0).astype(np.int64)
        steps, at = np.unique(step, return_inverse=True)
        per = np.zeros((len(steps), k))
        np.add.at(per, (at, source), units)
        totals = per.sum(axis=1, keepdims=True)
        shares = np.divide(per, totals, out=np.zeros_like(per), where=totals > 0)
        worst = np.abs(shares - np.asarray(mix.weights)[None, :]).max(axis=0)
    return np.max(np.stack(comm.allgather(worst)), axis=0)

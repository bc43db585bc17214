"""A blend's optimizer steps (--source with --dp-size): plan/windows.py plans each step from a run
of the blend's consecutive uses (`plan_window_steps`, every use a group of one), so a step holds
the tolerance docs/mixtures.md states for any run of uses, at the step's size. Checked over 2 to 5
sources of skewed sizes and weights, every packing algorithm and steps of 1 to 6 packs."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from packctl.plan.mixture import Blend, draw_blend, interleave, uses_of
from packctl.plan.windows import plan_windows
from packctl.specs import WindowOptions

CAPACITY = 512


def _stream(seed: int, sources: int):
    """The interleaved uses of a blend of `sources` sources (rows 3 to 400 of 1 to 300 tokens,
    weights from 0.02 up): each use's tokens and source, in blend order."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(3, 400, sources)
    lengths = np.concatenate([rng.integers(1, rng.integers(2, 300), n) for n in rows])
    starts = np.concatenate([[0], np.cumsum(rows)])
    weights = rng.uniform(0.02, 1.0, sources)
    found, gids = draw_blend(lengths, Blend(starts, weights / weights.sum(), [10.0] * sources, seed=seed))
    units = [lengths[uses_of(g, c)[0]] for g, c in zip(gids, found.counts)]
    positions = interleave(units)
    tokens = np.concatenate(units)[positions]
    source_of = np.repeat(np.arange(sources), [len(u) for u in units])[positions]
    return tokens, source_of


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(2, 5), st.sampled_from(["concat", "ffd", "bfd", "ffs", "pool"]),
       st.integers(1, 6), st.sampled_from([50, 200, 100_000]))
def test_every_step_holds_each_source_within_the_stated_tolerance(seed, sources, algorithm, step_packs, window):
    tokens, source_of = _stream(seed, sources)
    options = WindowOptions(capacity=CAPACITY, align=1, algorithm=algorithm, too_long="error", window=window,
                            seed=seed, step_packs=step_packs)
    plan = plan_windows(np.arange(len(tokens)), tokens, options)  # a piece's gid is its use's place in the blend
    assert plan.step_bins is not None
    share = np.bincount(source_of, weights=tokens, minlength=sources) / tokens.sum()
    longest = np.zeros(sources)
    np.maximum.at(longest, source_of, tokens)  # 0 for a source the draw gave no use
    seen = np.zeros(len(tokens), dtype=np.int64)
    for lo, hi in zip(plan.step_bins[:-1], plan.step_bins[1:]):
        assert hi - lo <= step_packs
        used = np.unique(plan.piece_gid[plan.bin_offsets[lo]:plan.bin_offsets[hi]])
        seen[used] += 1
        assert used.tolist() == list(range(used[0], used[-1] + 1))  # a run of consecutive uses
        held = np.bincount(source_of[used], weights=tokens[used], minlength=sources)
        assert (np.abs(held - share * held.sum()) <= longest + share * longest.sum() + 1e-6).all()
    assert (seen == 1).all()  # every use in exactly one step


def test_the_docstring_example_of_consecutive_steps():
    from packctl.plan.windows import plan_window_steps

    lengths = np.array([5, 3, 6, 4, 4, 2])
    new_group = np.array([1, 0, 1, 1, 0, 1], dtype=bool)
    options = WindowOptions(capacity=8, align=1, algorithm="ffd", too_long="error", window=6, step_packs=2)
    _, ahead = plan_window_steps(np.arange(6), lengths, new_group, options, seed=0)
    _, consecutive = plan_window_steps(np.arange(6), lengths, new_group, options, seed=0, consecutive=True)
    # [5 3] [6 2] | [4 4]  against  [5 3] [6] | [4 4] [2]
    assert ahead.tolist() == [0, 2, 3] and consecutive.tolist() == [0, 2, 4]


"""--share-prefix after scan: the tokens each row's group stores once, on every rank.

Scan compared every row with the row before it on its rank (source/prefix.py); here each rank's
first row is compared with the previous rank's last row (one row a rank travels), and the groups
cut by a rank boundary join their common prefixes (a group id and a number per edge, as
`group_totals` joins padded lengths). The result, `index.shared`, travels with each gid through
order and planning like a --limit cost.

    rank 0 rows [1 2 3 9] [1 2 3 8] | rank 1 rows [1 2 5], one group of three rows
    common [-1, 3] | [2]  ->  p = min(3, 2) = 2  ->  shared [1, 1, 1] on both ranks
"""
from __future__ import annotations

import numpy as np

from packctl.mpi.comm import Comm
from packctl.plan.groups import group_ids, group_sizes
from packctl.plan.prefix import common_length, run_prefixes, shared_of
from packctl.source.index import SequenceIndex


def share_prefix_lengths(comm: Comm, index: SequenceIndex) -> np.ndarray:
    """int64 per gid of this rank: p - 1 for the rows of a group stored shared, else 0
    (plan/prefix.py). Needs `index.prefix_scan` and `index.group_starts`."""
    scan = index.prefix_scan
    common = scan.common.copy()
    lasts = comm.allgather(scan.last)
    before = next((row for row in reversed(lasts[:comm.rank]) if row is not None), None)
    if len(common):
        common[0] = common_length(*before, *scan.first) if before is not None else 0
    gids = index.gid_lo + np.arange(len(common), dtype=np.int64)
    ids = group_ids(gids, index.group_starts)
    first, p = run_prefixes(common, gids, ids, scan.bound)
    if comm.size > 1:
        edges = {int(ids[i]): int(p[k]) for k, i in ((0, 0), (len(first) - 1, first[-1]))} if len(first) else {}
        joined: dict[int, int] = {}
        for found in comm.allgather(edges):
            for g, value in found.items():
                joined[g] = min(joined.get(g, value), value)
        for k in (0, len(first) - 1) if len(first) else ():
            p[k] = joined[int(ids[first[k]])]
    shared = shared_of(p, group_sizes(ids[first], index.group_starts))
    return np.repeat(shared, np.diff(np.append(first, len(common))))

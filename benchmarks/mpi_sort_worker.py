"""Run under mpiexec by bench_mpi.py: time the distributed sample sort of N (key, gid) pairs."""
import json
import sys
import time

import numpy as np

from packctl.mpi.comm import get_comm
from packctl.mpi.samplesort import sample_sort

comm = get_comm()
total = int(sys.argv[1])
share = np.linspace(0, total, comm.size + 1).astype(np.int64)
lo, hi = share[comm.rank], share[comm.rank + 1]
rng = np.random.default_rng(comm.rank)
keys = rng.integers(0, 1 << 40, hi - lo)
gids = np.arange(lo, hi, dtype=np.int64)
comm.barrier()
t0 = time.perf_counter()
out_keys, _, _ = sample_sort(comm, keys, gids, payload=gids)
comm.barrier()
elapsed = time.perf_counter() - t0
sizes = comm.allgather(len(out_keys))
if comm.rank == 0:
    print(json.dumps({"ranks": comm.size, "seconds": elapsed, "keys": total, "imbalance": max(sizes) / (total / comm.size),
                      "bytes_sent": getattr(comm, "bytes_sent", 0)}))

"""An in-process communicator: N ranks as N threads, so multi-rank code runs in plain pytest.

    results = run_ranks(3, lambda comm: pack(config, comm=comm))

It implements `packctl.mpi.comm.Comm` with a shared slot per rank and a barrier: every
collective is an allgather underneath. Like MPI, every rank must call the same collectives in the
same order; a rank that raises breaks the barrier, so the others fail too instead of hanging.
"""
from __future__ import annotations

import threading
from functools import reduce
from operator import add
from typing import Any, Callable

import numpy as np


class _Shared:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[Any] = [None] * size


class ThreadComm:
    is_mpi = False

    def __init__(self, shared: _Shared, rank: int):
        self._shared = shared
        self.rank = rank
        self.size = shared.size
        self.bytes_sent = 0
        self.bytes_received = 0

    def allgather(self, obj: Any) -> list[Any]:
        self._shared.slots[self.rank] = obj
        self._shared.barrier.wait()
        out = list(self._shared.slots)
        self._shared.barrier.wait()
        return out

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        everything = self.allgather(obj)
        return everything if self.rank == root else None

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.allgather(obj)[root]

    def exscan(self, value: int) -> int:
        return sum(self.allgather(value)[:self.rank])

    def allreduce_sum(self, value):
        return reduce(add, self.allgather(value))

    def allreduce_max(self, value):
        return max(self.allgather(value))

    def alltoall(self, objs: list[Any]) -> list[Any]:
        got = self.allgather(list(objs))
        return [got[j][self.rank] for j in range(self.size)]

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        send = np.ascontiguousarray(send)
        offsets = np.concatenate([[0], np.cumsum(np.asarray(send_counts, dtype=np.int64))])
        parts = [send[offsets[j]:offsets[j + 1]].copy() for j in range(self.size)]
        got = self.alltoall(parts)
        self.bytes_sent += sum(p.nbytes for j, p in enumerate(parts) if j != self.rank)
        self.bytes_received += sum(p.nbytes for j, p in enumerate(got) if j != self.rank)
        recv = np.concatenate(got) if got else np.zeros(0, send.dtype)
        return recv.astype(send.dtype, copy=False), np.array([len(p) for p in got], dtype=np.int64)

    def barrier(self) -> None:
        self._shared.barrier.wait()

    def abort(self, code: int = 1) -> None:
        self._shared.barrier.abort()
        raise SystemExit(code)


def run_ranks(size: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """fn(comm) on `size` threads, one per rank; their results in rank order (the first error re-raised)."""
    shared = _Shared(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(shared, rank))
        except BaseException as exc:  # handed to the caller
            errors[rank] = exc
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results

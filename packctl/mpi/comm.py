"""One communicator API for the pipeline: MPI under `mpiexec`/`srun`, a single process otherwise.

Every stage receives a `Comm`; without MPI it is `SingleComm` (rank 0 of 1), whose collectives
are identities, so there is one code path.

    comm = get_comm()
    counts = comm.allgather(len(local))          # [n_0, n_1, ...] on every rank
    first = comm.exscan(len(local))              # sum over lower ranks (0 on rank 0)
    recv, recv_counts = comm.alltoallv(send, send_counts)   # numpy payloads, any size
"""
from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import numpy as np

from packctl.errors import MissingExtraError, PackctlError

# Environment variables that MPI launchers set in every rank they start.
_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
# Largest element count of one MPI message piece: counts and displacements stay below 2^31.
MAX_MESSAGE_ELEMENTS = 2**30


class Comm(Protocol):
    """What every stage may ask of its communicator (SingleComm, MPIComm, tests' fakes)."""

    rank: int
    size: int
    is_mpi: bool
    bytes_sent: int  # payload bytes sent to other ranks by alltoallv so far
    bytes_received: int

    def allgather(self, obj: Any) -> list[Any]: ...
    def gather(self, obj: Any, root: int = 0) -> list[Any] | None: ...
    def bcast(self, obj: Any, root: int = 0) -> Any: ...
    def exscan(self, value: int) -> int: ...
    def allreduce_sum(self, value: Any) -> Any: ...
    def allreduce_max(self, value: Any) -> Any: ...
    def alltoall(self, objs: list[Any]) -> list[Any]: ...
    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def barrier(self) -> None: ...
    def abort(self, code: int = 1) -> None: ...


def broadcast_outcome(comm: Comm, fn):
    """Run `fn` on rank 0 and give every rank its result, or raise its PackctlError on every rank
    (so all ranks stop together, and only rank 0 needs to print)."""
    outcome = None
    if comm.rank == 0:
        try:
            outcome = ("ok", fn())
        except PackctlError as exc:
            outcome = ("error", exc)
    if comm.size > 1:
        outcome = comm.bcast(outcome)
    if outcome[0] == "error":
        outcome[1].everywhere = True
        raise outcome[1]
    return outcome[1]


class SingleComm:
    """The communicator of a run without MPI: one rank, collectives return their input."""

    rank = 0
    size = 1
    is_mpi = False
    bytes_sent = 0
    bytes_received = 0

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def exscan(self, value: int) -> int:
        return 0

    def allreduce_sum(self, value):
        return value

    def allreduce_max(self, value):
        return value

    def alltoall(self, objs: list[Any]) -> list[Any]:
        return list(objs)

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return send, np.asarray(send_counts, dtype=np.int64)

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        sys.exit(code)


class MPIComm:
    """`MPI.COMM_WORLD` behind the same API; numpy payloads move with Alltoallv in chunks."""

    is_mpi = True

    def __init__(self, mpi_comm):
        self._comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.bytes_sent = 0
        self.bytes_received = 0

    def allgather(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's `obj` on `root` (in rank order), None elsewhere: what only rank 0 needs
        (the plans, for metrics.json) is not copied to every rank."""
        return self._comm.gather(obj, root=root)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._comm.bcast(obj, root=root)

    def exscan(self, value: int) -> int:
        return sum(self._comm.allgather(value)[: self.rank])

    def allreduce_sum(self, value):
        return self._comm.allreduce(value)

    def allreduce_max(self, value):
        from mpi4py import MPI

        return self._comm.allreduce(value, op=MPI.MAX)

    def alltoall(self, objs: list[Any]) -> list[Any]:
        return self._comm.alltoall(objs)

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Send send[displ[j] : displ[j] + send_counts[j]] to rank j; returns what arrived, in rank
        order, and the count from each rank. Large payloads go in several rounds so that no count
        or displacement reaches 2^31 elements."""
        from mpi4py import MPI

        send = np.ascontiguousarray(send)
        send_counts = np.asarray(send_counts, dtype=np.int64)
        recv_counts = np.asarray(self._comm.alltoall(send_counts.tolist()), dtype=np.int64)
        recv = np.empty(int(recv_counts.sum()), dtype=send.dtype)
        send_displ = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
        recv_displ = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
        # Every rank runs the same number of rounds: each round moves at most `step` elements per peer.
        step = max(1, MAX_MESSAGE_ELEMENTS // max(1, self.size))
        rounds = self._comm.allreduce(int(-(-max(int(send_counts.max(initial=0)), 1) // step)), op=MPI.MAX)
        mpi_type = MPI._typedict[send.dtype.char]
        if rounds == 1:
            self._comm.Alltoallv([send, (send_counts.astype(np.int32), send_displ.astype(np.int32)), mpi_type],
                                 [recv, (recv_counts.astype(np.int32), recv_displ.astype(np.int32)), mpi_type])
            rounds = 0
        for k in range(rounds):
            lo = k * step
            s_cnt = np.clip(send_counts - lo, 0, step)
            r_cnt = np.clip(recv_counts - lo, 0, step)
            s_buf = np.concatenate([send[d + lo:d + lo + c] for d, c in zip(send_displ, s_cnt)]) if len(send) else send
            r_buf = np.empty(int(r_cnt.sum()), dtype=send.dtype)
            self._comm.Alltoallv([s_buf, (s_cnt.astype(np.int32), _displ(s_cnt)), mpi_type],
                                 [r_buf, (r_cnt.astype(np.int32), _displ(r_cnt)), mpi_type])
            for j, (d, c, start) in enumerate(zip(recv_displ, r_cnt, _displ(r_cnt))):
                recv[d + lo:d + lo + c] = r_buf[start:start + c]
        self.bytes_sent += int(send_counts.sum() - send_counts[self.rank]) * send.itemsize
        self.bytes_received += int(recv_counts.sum() - recv_counts[self.rank]) * send.itemsize
        return recv, recv_counts

    def barrier(self) -> None:
        self._comm.Barrier()

    def abort(self, code: int = 1) -> None:
        sys.stderr.flush()
        self._comm.Abort(code)


def _displ(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process as one of several ranks."""
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value and value.isdigit() and int(value) > 1:
            return True
    return False


def get_comm() -> Comm:
    """MPIComm when launched by mpiexec/srun with more than one rank (mpi4py required), else
    SingleComm. `mpiexec -n 1 packctl pack` runs as a single process."""
    if not launched_by_mpi():
        return SingleComm()
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MissingExtraError("mpi4py", "mpi", "packctl pack under mpiexec") from exc
    return MPIComm(MPI.COMM_WORLD)

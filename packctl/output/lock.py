"""`.OUT.packctl-lock`: one run at a time writes OUT.

The lock holds {"pid", "host", "started"} of the run writing OUT (under MPI, rank 0). It is whole
before it appears: the JSON is written and fsynced to `.OUT.packctl-lock.<pid>.tmp`, then linked to
the lock's name (a link fails where the name exists: exclusive creation), so no run sees an empty
or half-written lock of this version, and a run that cannot write one (a full or read-only disk)
leaves nothing.

    a lock of this host whose process no longer exists   stale: taken over (a crash, SIGKILL, a
        (or whose pid a later process now has)           multi-rank run's rank 0 killed)
    an empty or unreadable lock older than GRACE_S       stale: taken over (an older packctl
                                                         killed between creating and writing it)
    a live process of this host                          refused: wait for it
    a process of another host                            refused: packctl cannot see it run;
                                                         delete the lock if that run is gone
"""
from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path

from packctl.errors import PackctlError
from packctl.output.fs import write_failed
from packctl.output.journal import fsync_dir

LOCK_SUFFIX = ".packctl-lock"
GRACE_S = 10.0  # an unreadable lock younger than this may be one an older packctl is still writing

_HELD: set[str] = set()  # locks this process holds (another OutputLock of this process must not take them)
_HELD_GUARD = threading.Lock()


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


class OutputLock:
    """`.OUT.packctl-lock`: one run at a time writes OUT (module docstring)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self.held = False
        self._inode: int | None = None

    def acquire(self) -> "OutputLock":
        text = (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n").encode()
        staged = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_whole(staged, text)
            for _ in range(3):
                if self._link(staged, text):
                    self._clear_leftovers()
                    return self
                self._break_stale()  # raises unless the lock was stale (and is gone now)
        except OSError as exc:
            raise write_failed(self.path, exc) from None
        finally:
            try:
                staged.unlink(missing_ok=True)
            except OSError:
                pass
        raise PackctlError(f"{self.out}: cannot take the lock {self.path} (it keeps changing); delete it if no "
                           "packctl run is writing OUT")

    def _link(self, staged: Path, text: bytes) -> bool:
        """Create the lock from `staged`; False when a lock is there already."""
        try:
            os.link(staged, self.path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a filesystem without hard links: exclusive creation, then the JSON in one write
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            try:
                os.write(fd, text)
                os.fsync(fd)
            except OSError:
                self.path.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
        fsync_dir(self.path.parent)
        self._inode = os.stat(self.path).st_ino
        self.held = True
        with _HELD_GUARD:
            _HELD.add(str(self.path.absolute()))
        return True

    def _break_stale(self) -> None:
        """Remove the lock if it is stale, else raise the error that says who holds it."""
        try:
            owner, inode, age = self._read()
        except FileNotFoundError:
            return  # released meanwhile: try again
        if owner is None:
            if age < GRACE_S:
                raise PackctlError(f"{self.out}: the lock {self.path} is empty or unreadable and {age:.0f} s old "
                                   "(another packctl run starting?); wait and run again, or delete it if no packctl "
                                   "run is writing OUT")
        elif not self._is_stale(owner, time.time() - age):
            who = f"pid {owner.get('pid')} on {owner.get('host')}"
            raise PackctlError(
                f"{self.out}: another packctl run ({who}) is writing it (lock {self.path}); wait for it to "
                "finish, or delete the lock file if that run is gone")
        # Stale: moved aside first, so a lock another run took meanwhile is given back, not deleted.
        grave = self.path.with_name(f"{self.path.name}.{os.getpid()}.stale")
        try:
            os.rename(self.path, grave)
        except FileNotFoundError:
            return
        try:
            if os.lstat(grave).st_ino != inode:
                try:
                    os.link(grave, self.path)
                except FileExistsError:
                    pass
        finally:
            grave.unlink(missing_ok=True)

    def _read(self) -> tuple[dict | None, int, float]:
        """(owner or None if empty or unreadable, inode, age in seconds) of the lock there now."""
        with open(self.path, "rb") as fh:
            st = os.fstat(fh.fileno())
            data = fh.read(4096)
        try:
            owner = json.loads(data)
        except ValueError:
            owner = None
        return (owner if isinstance(owner, dict) else None), st.st_ino, max(0.0, time.time() - st.st_mtime)

    def _is_stale(self, owner: dict, written: float) -> bool:
        pid = owner.get("pid")
        if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
            return False  # another machine's process: cannot tell, so never take it over
        if pid == os.getpid():  # this process: alive, unless it holds no such lock (a pid of an earlier life)
            with _HELD_GUARD:
                return str(self.path.absolute()) not in _HELD
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        started = _process_start(pid)
        return started is not None and started > written + 2.0  # the pid now belongs to a later process

    def _clear_leftovers(self) -> None:
        """Staged or set-aside lock files that a run killed in the middle of taking a lock left."""
        for path in self.path.parent.glob(f"{self.path.name}.*"):
            try:
                if time.time() - path.lstat().st_mtime > GRACE_S:
                    path.unlink()
            except OSError:
                pass

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        with _HELD_GUARD:
            _HELD.discard(str(self.path.absolute()))
        try:
            owner, inode, _ = self._read()
            if inode == self._inode and (owner is None or owner.get("pid") == os.getpid()):
                self.path.unlink()
        except OSError:
            pass  # already gone (OUT's parent removed), or another run's now


def _write_whole(path: Path, data: bytes) -> None:
    """`data` as the whole of a new file, fsynced; on failure no file is left."""
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), where /proc tells (Linux); else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None

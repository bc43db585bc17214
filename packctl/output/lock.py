"""`.OUT.packctl-lock`: one run at a time writes OUT."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from packctl.errors import PackctlError

LOCK_SUFFIX = ".packctl-lock"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


class OutputLock:
    """`.OUT.packctl-lock`: one run at a time writes OUT.

    Created with O_EXCL and holding {"pid", "host"}. A lock left by a process of this host that no
    longer exists (a crash, SIGKILL) is stale and taken over; a live one is an error.
    """

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self.held = False

    def acquire(self) -> "OutputLock":
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and self._is_stale(owner):
                    self.path.unlink(missing_ok=True)
                    continue
                who = f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "unknown process"
                raise PackctlError(
                    f"{self.out}: another packctl run ({who}) is writing it (lock {self.path}); wait for it to "
                    "finish, or delete the lock file if that run is gone") from None
            except OSError as exc:
                raise PackctlError(f"{self.out}: cannot create the lock file {self.path} "
                                   f"({exc.strerror or exc}); choose a writable -o") from None
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(me) + "\n")
            self.held = True
            return self
        raise PackctlError(f"{self.out}: cannot take the lock {self.path}; delete it if no packctl run is writing OUT")

    def _owner(self) -> dict | None:
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) else None
        except (OSError, ValueError):
            return None

    @staticmethod
    def _is_stale(owner: dict) -> bool:
        if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
            return False  # another machine's process: cannot tell, so never take it over
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        if self.held:
            owner = self._owner()
            if owner is None or owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

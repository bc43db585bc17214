"""The output lock on its own (output/lock.py): whole before it appears, never left empty, and which
locks are stale."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from packctl.errors import PackctlError
from packctl.output import lock as lock_module
from packctl.output.lock import GRACE_S, OutputLock, lock_path


def _beside(out) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_the_lock_holds_its_owner_and_nothing_else_is_left_beside_out(tmp_path):
    out = tmp_path / "out"
    lock = OutputLock(out).acquire()
    owner = json.loads(lock_path(out).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and owner["started"]
    assert _beside(out) == [".out.packctl-lock"]
    lock.release()
    assert _beside(out) == []


@pytest.mark.parametrize("content", ["", "{\"pid\": 12", "[1, 2]"])
def test_an_empty_or_unreadable_lock_is_refused_while_young_and_taken_over_once_old(tmp_path, content):
    out = tmp_path / "out"
    lock_path(out).write_text(content)
    with pytest.raises(PackctlError, match=r"is empty or unreadable and 0 s old .*delete it if no packctl run"):
        OutputLock(out).acquire()
    assert lock_path(out).read_text() == content
    _age(lock_path(out), GRACE_S + 1)
    lock = OutputLock(out).acquire()
    assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_lock_of_this_pid_is_stale_unless_this_process_holds_it(tmp_path):
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    first = OutputLock(out).acquire()  # an earlier process of the same pid (a restarted container) wrote it
    with pytest.raises(PackctlError, match=rf"another packctl run \(pid {os.getpid()} on "):
        OutputLock(out).acquire()  # held by this process: a second run in it must wait
    first.release()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times from /proc (Linux)")
def test_a_pid_that_a_later_process_took_is_stale(tmp_path):
    out = tmp_path / "out"
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_path(out).write_text(json.dumps({"pid": later.pid, "host": socket.gethostname()}))
        with pytest.raises(PackctlError, match=rf"pid {later.pid}"):
            OutputLock(out).acquire()  # written after that process started: its own
        _age(lock_path(out), 3600)  # written an hour before that process started: a crashed run's
        OutputLock(out).acquire().release()
    finally:
        later.kill()
        later.wait()


class _FullDisk:
    """os, but writes fail with ENOSPC."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_fails_in_one_line_naming_the_lock_and_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(lock_module, "os", _FullDisk())
    with pytest.raises(PackctlError) as failure:
        OutputLock(out).acquire()
    message = str(failure.value)
    assert message.startswith(f"{lock_path(out)}: write failed (No space left on device, on the filesystem "
                              "mounted at ") and "free space there" in message
    assert _beside(out) == []


def test_without_hard_links_the_lock_is_created_exclusively_and_whole(tmp_path, monkeypatch):
    out = tmp_path / "out"

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(lock_module.os, "link", no_links)
    lock = OutputLock(out).acquire()
    assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    with pytest.raises(PackctlError, match="another packctl run"):
        OutputLock(out).acquire()
    lock.release()
    assert _beside(out) == []


def test_leftovers_of_a_run_killed_while_taking_the_lock_are_cleared(tmp_path):
    out = tmp_path / "out"
    staged = tmp_path / ".out.packctl-lock.4242.tmp"
    staged.write_text("{}")
    fresh = tmp_path / ".out.packctl-lock.4343.tmp"
    fresh.write_text("{}")  # maybe a live run's, this very moment: left alone
    _age(staged, GRACE_S + 1)
    OutputLock(out).acquire().release()
    assert _beside(out) == [fresh.name]

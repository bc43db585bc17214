"""`python -m packctl` = the `packctl` command."""
import os
import signal
import sys


def tune_arrow_allocator() -> None:
    """Have Arrow's allocator (mimalloc) keep freed pages for a second instead of 10 ms, so that
    the next block decoded or shard encoded reuses them instead of filling fresh pages: `pack` runs
    6-9% faster, peak memory stays within the budget's margin (docs/performance.md). mimalloc reads
    MIMALLOC_PURGE_DELAY once, when pyarrow loads, so this runs before any import of the command;
    a user's own setting wins. Only the `packctl` process sets it: `import packctl` leaves the
    environment of a program alone (such a program may set the variable itself)."""
    os.environ.setdefault("MIMALLOC_PURGE_DELAY", "1000")


def entry() -> None:
    """The `packctl` executable. SIGINT or SIGTERM while Python loads the command line waits for
    the imports, then ends the process in one line (exit 130, 143): never a traceback of the
    imports, never lost inside one."""
    tune_arrow_allocator()
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: came.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    from packctl.cli import main

    for signum, handler in previous.items():
        signal.signal(signum, handler)
    if came:
        sys.stderr.write(f"error: interrupted by {signal.Signals(came[0]).name} before the command started; "
                         "nothing was written\n")
        raise SystemExit(128 + came[0])
    main()


if __name__ == "__main__":
    entry()

"""`python -m packctl` = the `packctl` command."""
import signal
import sys


def entry() -> None:
    """The `packctl` executable. SIGINT or SIGTERM while Python loads the command line waits for
    the imports, then ends the process in one line (exit 130, 143): never a traceback of the
    imports, never lost inside one."""
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

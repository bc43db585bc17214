"""`packctl pack` as a user runs it, with a failure at a chosen point (tests of crashes and resume).

    python tests/faulty_pack.py --kill-after 2[:SIGTERM] pack CORPUS -o OUT ...   # also under mpiexec
    python tests/faulty_pack.py --fail-write-after 0 pack CORPUS -o OUT ...

The options become a `packctl.output.outdir.Faults` handed to `packctl.pipeline.pack`; the rest of the
command line goes to the CLI unchanged, so exit codes and messages are the real ones.
"""
from __future__ import annotations

import functools
import signal
import sys


def main(argv: list[str]) -> None:
    from packctl import pipeline
    from packctl.cli import main as cli_main
    from packctl.output.outdir import Faults

    kill_after = kill_signal = fail_after = None
    while argv and argv[0].startswith("--"):
        option, value = argv[0], argv[1]
        argv = argv[2:]
        if option == "--kill-after":
            count, _, name = value.partition(":")
            kill_after, kill_signal = int(count), getattr(signal, name) if name else signal.SIGKILL
        elif option == "--fail-write-after":
            fail_after = int(value)
        else:
            raise SystemExit(f"unknown option {option}")
    faults = Faults(kill_after_shards=kill_after, kill_signal=int(kill_signal or signal.SIGKILL),
                    fail_write_after_shards=fail_after)
    pipeline.pack = functools.partial(pipeline.pack, faults=faults)
    sys.argv = ["packctl", *argv]
    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])

"""`python -m packctl.online`: compile every planning kernel of the online API into numba's disk
cache (`warm_up`), so that the first call of a training job loads them instead of compiling them.
Run it where a training image is built, or once after installing packctl."""
from __future__ import annotations

import sys
import time

from packctl.jit import compile_seconds
from packctl.online import warm_up


def main() -> int:
    started = time.perf_counter()
    warm_up()
    print(f"packctl.online: kernels cached ({compile_seconds():.1f} s compiling, "
          f"{time.perf_counter() - started:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fixed cost of a packctl process: `packctl pack` of a small corpus against a plain copy of it,
`packctl --help`, and the first run after an install against the runs after it.

    python benchmarks/bench_startup.py [--runs 7] [--data sample_data] [--baseline OTHER_CHECKOUT]

Every figure is a whole process (start to exit, imports included), timed from outside with
Python's own clock; CPU is the user + system time of the finished child (os.wait4). Two commands
A and B run in turn, A B A B ..., after one warm-up of each, and their ratio is taken pair by pair,
so that a machine whose speed drifts during the run still gives a meaningful ratio. Each figure is
printed as median, min and max: quote the median; a wide spread says the machine was busy.

    pack        packctl pack DATA -o OUT --too-long split -q --overwrite
                vs a plain copy: benchmarks/copy_parquet.py DATA OUT (pyarrow read + zstd write)
    help        packctl --help
    pack-help   packctl pack --help
    first-run   the same pack with numba's cache of packctl's kernels emptied just before it (the
                first run after an install), vs the same pack again (its kernels cached)

packctl is this checkout's (PYTHONPATH=its root, `python -m packctl`). With --baseline DIR, every
packctl figure also runs the packctl of DIR (another checkout: the release before a change) as B,
pair by pair, so before and after are measured under the same conditions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one whole process, run in a scratch directory (`python -m`
    puts the working directory first on sys.path: no packctl there shadows PYTHONPATH's)."""
    with tempfile.TemporaryFile() as stderr, tempfile.TemporaryDirectory() as cwd:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}:\n{stderr.read().decode(errors='replace')}")
    return wall, usage.ru_utime + usage.ru_stime


class Command:
    """A command to time, with what must happen before each run (not timed)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], before=None):
        self.name, self.cmd, self.env, self.before = name, cmd, env, before

    def run(self) -> tuple[float, float]:
        if self.before is not None:
            self.before()
        return timed(self.cmd, self.env)


def paired(a: Command, b: Command, runs: int) -> dict[str, list[float]]:
    """A B A B ... after one warm-up of each: wall and CPU of each, and their ratios pair by pair."""
    a.run(), b.run()
    out: dict[str, list[float]] = {k: [] for k in ("a_wall", "a_cpu", "b_wall", "b_cpu")}
    for _ in range(runs):
        for key, command in (("a", a), ("b", b)):
            wall, cpu = command.run()
            out[f"{key}_wall"].append(wall)
            out[f"{key}_cpu"].append(cpu)
    out["wall_ratio"] = [x / y for x, y in zip(out["a_wall"], out["b_wall"])]
    out["cpu_ratio"] = [x / y for x, y in zip(out["a_cpu"], out["b_cpu"])]
    out["wall_diff"] = [x - y for x, y in zip(out["a_wall"], out["b_wall"])]
    return out


def row(label: str, values: list[float], unit: str = "s") -> str:
    fmt = (lambda v: f"{v:.3f}") if unit == "s" else (lambda v: f"{v:.2f}")
    return (f"| {label} | {fmt(statistics.median(values))} | {fmt(min(values))} | {fmt(max(values))} |")


def report(title: str, a: Command, b: Command, result: dict[str, list[float]], diff: bool = False) -> None:
    print(f"\n{title}  (A = {a.name}, B = {b.name}; {len(result['a_wall'])} pairs)\n")
    print("| figure | median | min | max |\n|---|---|---|---|")
    print(row(f"A wall ({a.name})", result["a_wall"]))
    print(row(f"B wall ({b.name})", result["b_wall"]))
    print(row("A CPU", result["a_cpu"]))
    print(row("B CPU", result["b_cpu"]))
    print(row("**A / B wall, pair by pair**", result["wall_ratio"], unit="x"))
    print(row("A / B CPU, pair by pair", result["cpu_ratio"], unit="x"))
    if diff:
        print(row("**A - B wall, pair by pair**", result["wall_diff"]))
    sys.stdout.flush()


def packctl_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    return env


def kernel_caches(tree: Path) -> list[Path]:
    """The files where numba keeps the compiled kernels of `tree`'s packctl: beside its sources,
    in packctl's own cache directory (packctl/cachedir.py: where the sources' folders cannot be
    written), and under NUMBA_CACHE_DIR when it is set."""
    places = [tree / "packctl", Path.home() / ".cache" / "packctl" / "numba",
              Path(tempfile.gettempdir()) / f"packctl-numba-{os.getuid()}"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        places.append(Path(xdg) / "packctl" / "numba")
    if os.environ.get("NUMBA_CACHE_DIR"):
        places += [p for p in Path(os.environ["NUMBA_CACHE_DIR"]).glob("*") if "packctl" in p.name]
    return [p for place in places if place.is_dir() for pattern in ("*.nbi", "*.nbc") for p in place.rglob(pattern)]


def empty_kernel_cache(tree: Path) -> None:
    for path in kernel_caches(tree):
        path.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="pairs after the warm-up (default 7)")
    ap.add_argument("--data", type=Path, default=ROOT / "sample_data", help="input corpus (default sample_data)")
    ap.add_argument("--baseline", type=Path, help="another checkout whose packctl is B of every packctl figure")
    ap.add_argument("--only", nargs="*", choices=["pack", "help", "pack-help", "first-run"],
                    help="figures to measure (default all)")
    args = ap.parse_args()
    args.data = args.data.resolve()
    args.baseline = args.baseline.resolve() if args.baseline else None
    only = set(args.only or ["pack", "help", "pack-help", "first-run"])
    work = Path(tempfile.mkdtemp(prefix="packctl-startup-"))
    python = sys.executable
    env = packctl_env(ROOT)
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
          f"bytecode cache {'off (PYTHONDONTWRITEBYTECODE)' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'on'}; "
          f"packctl from {ROOT}" + (f", baseline from {args.baseline}" if args.baseline else ""))

    def pack(tree: Path, name: str, out: str, before=None) -> Command:
        return Command(name, [python, "-m", "packctl", "pack", str(args.data), "-o", str(work / out),
                              "--too-long", "split", "-q", "--overwrite"], packctl_env(tree), before)

    try:
        if "pack" in only:
            copy = Command("plain copy", [python, str(HERE / "copy_parquet.py"), str(args.data), str(work / "copy")],
                           dict(os.environ))
            report("packctl pack vs a plain copy of its input", pack(ROOT, "packctl pack", "pack"), copy,
                   paired(pack(ROOT, "packctl pack", "pack"), copy, args.runs))
            if args.baseline:
                a, b = pack(ROOT, "packctl pack", "pack"), pack(args.baseline, "baseline pack", "base")
                report("packctl pack, this checkout vs the baseline", a, b, paired(a, b, args.runs))
        for figure, extra in (("help", ["--help"]), ("pack-help", ["pack", "--help"])):
            if figure in only:
                a = Command(f"packctl {' '.join(extra)}", [python, "-m", "packctl", *extra], env)
                b = (Command(f"baseline {' '.join(extra)}", [python, "-m", "packctl", *extra],
                             packctl_env(args.baseline)) if args.baseline else
                     Command("python -c pass", [python, "-c", "pass"], dict(os.environ)))
                report(f"packctl {' '.join(extra)}", a, b, paired(a, b, args.runs))
        if "first-run" in only:
            for tree, name in [(ROOT, "packctl")] + ([(args.baseline, "baseline")] if args.baseline else []):
                cold = pack(tree, f"{name} pack, kernels not cached", f"cold-{name}",
                            before=lambda tree=tree: empty_kernel_cache(tree))
                warm = pack(tree, f"{name} pack, kernels cached", f"warm-{name}")
                report(f"first run after an install ({name})", cold, warm, paired(cold, warm, args.runs), diff=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

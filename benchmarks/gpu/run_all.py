"""The steps of run_all.sh: pack, verify every backend in bf16 and fp16 with --bench, the loss and
gradient equivalence tests, the train example on flash-attn; one results file, JSON and markdown.

    python benchmarks/gpu/run_all.py --out DIR [--dry-run] [--budget-s 390]

Each step is a subprocess with its own timeout, cut further so that the whole run ends within
--budget-s; a step that runs out of time is recorded as `timeout`, one that finds no time left as
`skipped`, and the results are rewritten after every step, so a run stopped from outside still
leaves what it measured. Steps run in order of what matters most: flash-attn first, flex (the
slowest to compile) last.

On a GPU node (the default): `sample_data` packed at 4096 (`--too-long split`), a 3,000-sequence
rl-longtail corpus packed at 16384 with cp 1 and 2; verify on cuda with flash-attn, torch-varlen,
sdpa and flex. `--dry-run` runs the same steps on the CPU in a minute or two: tiny corpora from
`packctl sample`, backend sdpa, the same results layout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESERVE_S = 10  # kept back from the budget to write the results


@dataclass(frozen=True)
class Corpus:
    """One packed output the verify steps read: `name` in the tables, `source` given to pack."""

    name: str
    source: str
    pack_options: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    device: str
    backends: tuple[str, ...]
    dtypes: str
    sample: int  # packs per verify
    wide: tuple[int, int, int]  # heads, head dim, packs of the bench at a model's width
    generate: tuple[str, ...]  # packctl sample options of the rl-longtail corpus
    small: tuple[str, ...]  # packctl sample options standing in for sample_data ('' = sample_data itself)
    corpora: tuple[Corpus, ...]
    equivalence: tuple[str, ...]  # pytest arguments: the loss and gradient proofs (and on a GPU flash-attn's own test)
    train: tuple[str, ...]  # train_tiny.py arguments
    timeouts: dict[str, int] = field(default_factory=dict)


def gpu_plan(work: Path) -> Plan:
    rl = str(work / "rl-longtail")
    return Plan(
        device="cuda", backends=("flash-attn", "torch-varlen", "sdpa", "flex"), dtypes="bf16,fp16", sample=8,
        wide=(16, 128, 4),
        generate=("--sequences", "3000", "--distribution", "rl-longtail", "--max-length", "16384"), small=(),
        corpora=(Corpus("sample_data, 4096", "sample_data", ("--capacity", "4096", "--too-long", "split")),
                 Corpus("rl-longtail, 16384", rl, ("--capacity", "16384")),
                 Corpus("rl-longtail, 16384, cp 2", rl, ("--capacity", "16384", "--cp-size", "2"))),
        equivalence=("tests/integration/training/test_torch_equivalence.py",
                     "tests/integration/training/test_loss_normalization.py",
                     "tests/integration/training/test_torch_loaders.py::test_flash_attn_varlen_matches_sdpa_on_gpu"),
        train=("--device", "cuda", "--attention", "flash-attn", "--head-dim", "64", "--steps", "6"),
        timeouts={"sample": 60, "pack": 60, "verify": 75, "wide": 90, "equivalence": 150, "train": 120})


def dry_plan(work: Path) -> Plan:
    rl, small = str(work / "rl-longtail"), str(work / "small")
    return Plan(
        device="cpu", backends=("sdpa",), dtypes="bf16,fp16", sample=2, wide=(4, 32, 2),
        generate=("--sequences", "60", "--distribution", "rl-longtail", "--max-length", "2048", "--shards", "1"),
        small=("--sequences", "60", "--max-length", "1024", "--shards", "1"),
        corpora=(Corpus("sample, 1024", small, ("--capacity", "1024", "--too-long", "split")),
                 Corpus("rl-longtail, 2048", rl, ("--capacity", "2048")),
                 Corpus("rl-longtail, 2048, cp 2", rl, ("--capacity", "2048", "--cp-size", "2"))),
        equivalence=("tests/integration/training/test_torch_equivalence.py", "-k", "hf_padding_free"),
        train=("--device", "cpu", "--attention", "sdpa", "--head-dim", "16", "--steps", "2", "--packs-per-step", "2"),
        timeouts={"sample": 60, "pack": 90, "verify": 120, "wide": 120, "equivalence": 180, "train": 180})


class Runner:
    """Runs the steps under one deadline and keeps the results file up to date."""

    def __init__(self, out: Path, budget_s: float, results: dict):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.results = results

    def step(self, name: str, command: list[str], timeout: float) -> subprocess.CompletedProcess | None:
        left = self.deadline - time.monotonic() - RESERVE_S
        entry = {"step": name, "command": shlex.join(command), "status": "skipped", "rc": None, "seconds": 0.0}
        self.results["steps"].append(entry)
        if left < 5:
            entry["note"] = "no time left in the budget"
            self.write()
            return None
        started = time.monotonic()
        try:
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=min(timeout, left))
        except subprocess.TimeoutExpired as exc:
            entry.update(status="timeout", seconds=round(time.monotonic() - started, 1),
                         note=f"stopped after {min(timeout, left):.0f} s", tail=_tail(exc.stdout, exc.stderr))
            self.write()
            return None
        entry.update(status="ok" if done.returncode == 0 else "failed", rc=done.returncode,
                     seconds=round(time.monotonic() - started, 1))
        if done.returncode != 0:
            entry["tail"] = _tail(done.stdout, done.stderr)
        self.write()
        return done

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")
        (self.out / "results.md").write_text(markdown(self.results))


def _tail(stdout, stderr, size: int = 1500) -> str:
    text = "".join(t.decode(errors="replace") if isinstance(t, bytes) else (t or "") for t in (stderr, stdout))
    return text[-size:]


def packctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "packctl", *args]


def run(out: Path, work: Path, dry_run: bool, budget_s: float, install: str) -> dict:
    plan = (dry_plan if dry_run else gpu_plan)(work)
    results = {"dry_run": dry_run, "device": plan.device, "install": install, "budget_s": budget_s,
               "environment": {}, "steps": [], "attention": [], "contamination": [], "cp": [], "bench": [],
               "equivalence": {}, "train": {}, "shared_prefix": {}}
    runner = Runner(out, budget_s, results)
    t = plan.timeouts

    probe = runner.step("environment", [sys.executable, str(Path(__file__).with_name("environment.py"))], 60)
    if probe is not None and probe.returncode == 0:
        results["environment"] = json.loads(probe.stdout)
        runner.write()

    runner.step("sample rl-longtail", packctl("sample", "-o", str(work / "rl-longtail"), *plan.generate,
                                              "--overwrite"), t["sample"])
    if plan.small:
        runner.step("sample small", packctl("sample", "-o", str(work / "small"), *plan.small, "--overwrite"),
                    t["sample"])
    outputs = {}
    for corpus in plan.corpora:
        target = work / re.sub(r"[^a-z0-9]+", "-", corpus.name.lower()).strip("-")
        done = runner.step(f"pack {corpus.name}", packctl("pack", corpus.source, "-o", str(target),
                                                          *corpus.pack_options, "--overwrite"), t["pack"])
        if done is not None and done.returncode == 0:
            outputs[corpus.name] = (target, corpus.source)

    def verify(backend: str, name: str, extra: tuple[str, ...], timeout: int, label: str = "") -> None:
        if name not in outputs:
            return
        target, source = outputs[name]
        done = runner.step(f"verify {name}{label} {backend}",
                           packctl("verify", str(target), "--source", source, "--device", plan.device,
                                   "--backend", backend, "--bench", "--json", *extra), timeout)
        if done is not None and done.stdout.strip().startswith("{"):
            collect(results, name + label, json.loads(done.stdout))
            runner.write()

    first, *others = plan.backends
    order = [first] + ([others[0]] if others else [])
    for backend in order:  # flash-attn, then torch-varlen: the kernels trainers run
        for corpus in plan.corpora:
            verify(backend, corpus.name, ("--dtype", plan.dtypes, "--sample", str(plan.sample)), t["verify"])
    heads, head_dim, packs = plan.wide
    wide = ("--dtype", plan.dtypes.split(",")[0], "--heads", str(heads), "--head-dim", str(head_dim),
            "--sample", str(packs))
    for backend in order:
        verify(backend, plan.corpora[1].name, wide, t["wide"], f", {heads} x {head_dim}")

    done = runner.step("equivalence", [sys.executable, "-m", "pytest", *plan.equivalence, "-p", "no:cacheprovider"],
                       t["equivalence"])
    if done is not None:
        summary = re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", done.stdout)
        results["equivalence"] = {kind: int(n) for n, kind in summary} | {"rc": done.returncode}
    done = runner.step("train", [sys.executable, "docs/examples/train_tiny.py", *plan.train], t["train"])
    if done is not None:
        results["train"] = train_rows(done.stdout, plan.train)
    for backend in others[1:]:  # sdpa and flex: the references, last
        for corpus in plan.corpora:
            verify(backend, corpus.name, ("--dtype", plan.dtypes, "--sample", str(plan.sample)), t["verify"])

    import packctl.torch as packed_torch  # noqa: PLC0415 - only for the note below

    prefix = [n for n in dir(packed_torch) if "prefix" in n.lower()]
    results["shared_prefix"] = ({"status": "skipped", "reason": f"{', '.join(prefix)} is not run by this script yet"}
                                if prefix else {"status": "skipped", "reason": "packctl.torch has no shared-prefix "
                                                                               "collate"})
    runner.write()
    return results


def collect(results: dict, output: str, report: dict) -> None:
    """The rows of one verify --json report, each tagged with its output."""
    checks = report.get("checks", {})
    heads = checks.get("attention", {}).get("heads")
    head_dim = checks.get("attention", {}).get("head_dim")
    for row in checks.get("attention", {}).get("results", []):
        results["attention"].append({"output": output, **row})
    for row in checks.get("contamination", {}).get("results", []):
        results["contamination"].append({"output": output, **row})
    cp = checks.get("cp", {})
    if cp.get("status") not in (None, "skipped"):
        results["cp"].append({"output": output, **cp})
    for row in checks.get("bench", {}).get("results", []):
        results["bench"].append({"output": output, "heads": heads, "head_dim": head_dim, **row})


def train_rows(stdout: str, arguments: tuple[str, ...]) -> dict:
    """train_tiny.py's table -> {attention, steps: [[step, sequences, packed, unpacked, diff]], max_diff}."""
    steps = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0].isdigit():
            steps.append([int(parts[0]), int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])])
    attention = arguments[arguments.index("--attention") + 1]
    return {"attention": attention, "steps": steps, "max_diff": max((s[4] for s in steps), default=None)}


def _num(value, digits: str = ".1e") -> str:
    return "" if value is None else format(value, digits)


def markdown(results: dict) -> str:
    env = results.get("environment", {})
    lines = ["# packctl on a GPU: flash-attn and the other backends" + (" (dry run: CPU, tiny corpora)"
                                                                       if results["dry_run"] else ""), ""]
    lines.append(f"Device: {env.get('device_name', results['device'])}; torch {env.get('torch', '?')} "
                 f"(CUDA {env.get('torch_cuda')}); Python {env.get('python', '?')}; "
                 f"flash-attn: {env.get('flash_attn') or 'not installed'}; install: {results['install']}.")
    lines += ["", "## Attention: backends x dtypes", "",
              "| output | backend | mode | dtype | max error packed | max error unpacked | bound | pass |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results["attention"]:
        passed = r["status"] if r["status"] != "ok" else "ok"
        if r.get("reason"):
            passed = f"{r['status']}: {r['reason']}"
        lines.append(f"| {r['output']} | {r['backend']} | {r.get('mode', '')} | {r['dtype']} | "
                     f"{_num(r.get('max_error_packed'))} | {_num(r.get('max_error_unpacked'))} | "
                     f"{_num(r.get('bound'))} | {passed} |")
    lines += ["", "## Contamination", "", "| output | backend | dtype | packs | max change | pass |", "|---|---|---|---|---|---|"]
    for r in results["contamination"]:
        lines.append(f"| {r['output']} | {r['backend']} | {r['dtype']} | {r.get('packs', '')} | "
                     f"{_num(r.get('max_change'))} | {r['status']} |")
    lines += ["", "## Packed vs padded", "",
              "| output | backend | dtype | heads x dim | packs | packed | padded | speed-up | tokens packed / padded |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results["bench"]:
        lines.append(f"| {r['output']} | {r['backend']} | {r['dtype']} | {r['heads']} x {r['head_dim']} | "
                     f"{r['packs']} | {r['packed_ms']:.2f} ms | {r['padded_ms']:.2f} ms (batches of "
                     f"{r.get('padded_batch', '?')}) | {r['speedup']:.2f}x | "
                     f"{r['tokens_packed']:,} / {r['tokens_padded']:,} |")
    for r in results["cp"]:
        lines.append(f"\nCP check, {r['output']}: {r.get('status')} (cp {r.get('cp_size')})")
    eq = results["equivalence"]
    lines += ["", "## Loss and gradient equivalence (tests/support/torch_proof.py)", "",
              ("not run" if not eq else ", ".join(f"{v} {k}" for k, v in eq.items() if k != "rc") +
               f" (exit {eq['rc']})")]
    train = results["train"]
    lines += ["", f"## Train example (docs/examples/train_tiny.py, attention {train.get('attention', '?')})", ""]
    if train.get("steps"):
        lines += ["| step | sequences | packed loss | unpacked loss | diff |", "|---|---|---|---|---|"]
        lines += [f"| {s} | {n} | {p:.6f} | {u:.6f} | {d:.1e} |" for s, n, p, u, d in train["steps"]]
    else:
        lines.append("not run")
    prefix = results["shared_prefix"]
    lines += ["", f"Shared-prefix collate with FlexAttention: {prefix.get('status', 'not run')}"
              + (f" ({prefix['reason']})" if prefix.get("reason") else ""), ""]
    lines += ["## Steps", "", "| step | status | seconds | note |", "|---|---|---|---|"]
    for s in results["steps"]:
        note = s.get("note", "") or (s.get("tail", "").strip().splitlines() or [""])[-1]
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']} | {note.replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of results.json and results.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny corpora, backend sdpa")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "packctl-gpu-work",
                        help="folder of the corpora and packed outputs (kept out of --out: they are large)")
    parser.add_argument("--budget-s", type=float, default=390, help="the whole run ends within this")
    parser.add_argument("--install", default="not recorded", help="what run_all.sh's install step did")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = run(args.out, args.work, args.dry_run, args.budget_s, args.install)
    print((args.out / "results.md").read_text())
    failed = [s["step"] for s in results["steps"] if s["status"] != "ok"]
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'}; "
          + (f"not ok: {', '.join(failed)}" if failed else "every step ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

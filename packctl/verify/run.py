"""`packctl.verify.verify(OUT, options)`: every check of a packed output, in one pass over its shards.

    structure      every contract rule, shard checksums, the manifest's counts      (always)
    conservation   every source sample exactly once, or accounted for               (--source)
    attention      packed varlen attention == each sequence's own attention         (torch; --sample packs)
    contamination  changing one sequence never moves another's output               (with attention)
    cp             each context-parallel rank's share is a valid THD layout         (cp_size > 1)
    bench          packed varlen vs padded-batch attention time                     (--bench)

Shards are taken one at a time, in manifest order (read once, hashed while parsed: the reader of
packctl/contract/reader.py); the sampled packs are kept for the attention checks, so memory holds
one shard plus a few integers per sequence.
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from packctl.arrays import offsets_of
from packctl.config import as_python
from packctl.contract.layout import Layout
from packctl.contract.manifest import MANIFEST, manifest_problems, read_manifest_json, relative_path_problem
from packctl.source.pieces import BlockCache, plan_source
from packctl.errors import MissingExtraError, PackctlError
from packctl.verify import backends
from packctl.verify.attention import Pack, ProbeEmbedding, run_attention
from packctl.verify.conservation import OutputPieces, check_conservation, match_sources
from packctl.verify.cp import CpWork, check_cp
from packctl.verify.groups import GroupRule
from packctl.verify.report import CheckResult, VerifyReport
from packctl.verify.counts import Totals, check_counts, check_metrics
from packctl.verify.shard_rules import StepLoss
from packctl.verify.structure import check_shard, manifest_violations, unlisted_shards
from packctl.verify.violation import Violation
from packctl.urls import is_url

if TYPE_CHECKING:  # verify runs without the packing pipeline loaded
    from packctl.runtime import Progress

Stage = Callable[[str, "int | None"], Callable[[int], None]]  # a Progress's `stage`


def _unshown(name: str, total: int | None) -> Callable[[int], None]:
    return lambda n: None


@dataclass
class VerifyOptions:
    """What `packctl verify` checks. Field names are the CLI flags (`head_dim` -> `--head-dim`).

    Args:
        source: the INPUT given to packctl pack (files, directories, globs); empty: no conservation.
        split: the dataset split of a --source directory that holds several; default the manifest's.
        tokenizer: the tokenizer directory that reads raw --source records; default the manifest's
            (an output packed with pack --tokenizer records it).
        attention: run the attention and contamination checks (needs torch).
        sample: number of packs drawn (seeded) for the attention checks.
        seed: seed of the pack sample, of the probe embedding and of the probed sequences.
        backend: auto, flash-attn, torch-varlen, flex or sdpa.
        device: auto (cuda when torch sees a GPU), cpu or cuda.
        dtype: comma-separated fp32, bf16, fp16; default fp32 on CPU, bf16,fp16 on CUDA.
        heads, head_dim: shape of the probe attention.
        cp_size: context-parallel size to check; default the manifest's layout cp_size.
        bench: time packed against padded-batch attention.
    """

    source: list[str] = field(default_factory=list)
    split: str | None = None
    tokenizer: str | None = None
    attention: bool = True
    sample: int = 8
    seed: int = 0
    backend: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    heads: int = 2
    head_dim: int = 64
    cp_size: int | None = None
    bench: bool = False

    def __post_init__(self) -> None:
        # The Python API takes paths as os.PathLike and numpy scalars, as PackConfig does.
        for name, value in vars(self).items():
            setattr(self, name, as_python(value))
        if isinstance(self.source, (list, tuple)):
            self.source = [as_python(s, path=True) for s in self.source]

    def validate(self) -> None:
        """Raise PackctlError naming the flag for any value of the wrong type or outside its range,
        before any shard is read (also the ones only the attention checks use)."""
        for name, (wanted, accepts) in _TYPES.items():
            value = getattr(self, name)
            if not accepts(value):
                raise PackctlError(f"--{name.replace('_', '-')} {value!r}: must be {wanted}")
        for name, (low, high, why) in _RANGES.items():
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise PackctlError(f"--{name.replace('_', '-')} {value}: must be in [{low:,}, {high:,}] ({why})")
        if self.head_dim % 8:
            raise PackctlError(f"--head-dim {self.head_dim}: must be a multiple of 8 in [8, 256]")
        if self.backend != "auto" and self.backend not in backends.BACKENDS:
            raise PackctlError(f"--backend {self.backend!r}: choose one of auto, {', '.join(backends.BACKENDS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise PackctlError(f"--device {self.device!r}: choose one of auto, cpu, cuda")
        for part in (self.dtype or "").split(","):
            if part.strip() and part.strip().lower() not in backends.DTYPES:
                raise PackctlError(f"--dtype {part.strip()!r}: choose from fp32, bf16, fp16 (comma-separated)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What each option of VerifyOptions is, and the range of its whole numbers (with why).
_TYPES = {
    "source": ("a list of paths", lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)),
    "attention": ("true or false", lambda v: isinstance(v, bool)),
    "sample": ("a whole number", _is_int),
    "seed": ("a whole number", _is_int),
    "backend": ("a string", lambda v: isinstance(v, str)),
    "device": ("a string", lambda v: isinstance(v, str)),
    "dtype": ("a string such as fp32,bf16 (or unset)", lambda v: v is None or isinstance(v, str)),
    "heads": ("a whole number", _is_int),
    "head_dim": ("a whole number", _is_int),
    "cp_size": ("a whole number (or unset)", lambda v: v is None or _is_int(v)),
    "bench": ("true or false", lambda v: isinstance(v, bool)),
}
_RANGES = {
    "sample": (0, 2**63 - 1, "packs drawn, at most all of them"),
    "seed": (0, 2**63 - 1, "seeds are 63-bit"),
    "heads": (1, 256, "a probe of the attention: more heads test nothing more"),
    "head_dim": (8, 256, "the head sizes attention kernels take"),
    "cp_size": (1, 2**31 - 1, "a sequence is cut into 2*cp chunks"),
}


@dataclass
class _AttentionPlan:
    backends: list = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None


def _plan_attention(options: VerifyOptions) -> _AttentionPlan:
    """Backends and dtypes to run, resolved before any shard is read so a bad flag fails at once.

    Without torch, `auto` skips the attention checks (with the install line); an explicit backend
    or device is an error.
    """
    if not options.attention:
        return _AttentionPlan(skipped="--no-attention")
    try:
        backends.import_torch()
    except MissingExtraError as exc:
        if options.backend == "auto" and options.device in ("auto", "cpu"):
            return _AttentionPlan(skipped=f"torch is missing: {exc}")
        raise
    device = backends.resolve_device(options.device)
    dtypes = backends.parse_dtypes(options.dtype, device)
    chosen, notes = backends.select_backends(options.backend, device)
    return _AttentionPlan(backends=chosen, dtypes=dtypes, device=device, notes=notes)


def _sample_packs(readable: list[tuple[int, dict[str, Any]]], sample: int, seed: int) -> dict[int, list[int]]:
    """{shard index: rows} of `sample` packs drawn without replacement over the shards that can
    be read (index, manifest entry), by the rows their entries list."""
    index = [i for i, _ in readable]
    rows = np.array([entry["rows"] if isinstance(entry.get("rows"), int) else 0 for _, entry in readable],
                    dtype=np.int64)
    total = int(rows.sum())
    if total == 0 or sample == 0:
        return {}
    picks = np.sort(np.random.default_rng(seed).choice(total, size=min(sample, total), replace=False))
    offsets = offsets_of(rows)
    shard = np.searchsorted(offsets, picks, side="right") - 1
    chosen: dict[int, list[int]] = {}
    for s, p in zip(shard.tolist(), picks.tolist()):
        chosen.setdefault(index[s], []).append(p - int(offsets[s]))
    return chosen


def _blend_rows(manifest: dict[str, Any], otherwise: int | None) -> int | None:
    """The rows a blend's sample ids name: the end of its last source's gids."""
    try:
        return int(manifest["sources"][-1]["gids"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return otherwise


def _top_field(name: str) -> str:
    """The manifest key a problem's field belongs to: 'shards[3].rows' -> 'shards'."""
    return name.split(".", 1)[0].split("[", 1)[0]


def _status(found: list[Violation]) -> str:
    return "failed" if found else "ok"


def verify(out: str | Path, options: VerifyOptions | None = None, *, progress: Progress | None = None
           ) -> VerifyReport:
    """Run every check on the packed output directory `out`; `progress` shows the checks that
    take time as stages (structure: shards, conservation: source files, attention: packs), and
    each check's result records its seconds.

    Raises PackctlError (exit 2) when the output or the options cannot be used at all; broken
    rules are returned in the report (exit 1).

        >>> report = verify("out", VerifyOptions(source=["sample_data"]))   # doctest: +SKIP
        >>> report.ok, [str(v) for v in report.violations]                  # doctest: +SKIP
        (True, [])
    """
    options = options or VerifyOptions()
    if is_url(out):
        return _verify_stored(str(out), options, progress)
    stage: Stage = progress.stage if progress is not None else _unshown
    options.validate()
    plan = _plan_attention(options)
    output = _Output.read(Path(out))
    picks = _sample_packs(output.readable, options.sample, options.seed) if plan.skipped is None else {}
    sources, conservation_skipped = _matched_sources(output, options)  # a wrong --source fails first
    cp_size = options.cp_size or (output.layout.cp_size if output.layout is not None else 1)
    shards = _check_shards(output, picks, OutputPieces() if sources is not None else None,
                           CpWork(cp_size) if cp_size > 1 else None, stage)
    checks: dict[str, CheckResult] = {"structure": shards.structure_result(len(output.shards))}
    violations: list[Violation] = list(shards.structure)
    if conservation_skipped is not None:
        checks["conservation"] = CheckResult("skipped", [f"skipped: {conservation_skipped}"],
                                             {"reason": conservation_skipped})
    elif sources is None:
        checks["conservation"] = CheckResult("skipped", ["pass --source INPUT to compare with the input"],
                                             {"reason": "no --source"})
    else:
        checks["conservation"], found = _conservation(output, sources, shards.pieces, options, stage)
        violations += found
    checks["cp"] = shards.cp_result()
    violations += shards.cp_found
    _attention_checks(checks, violations, plan, shards.packs, options, stage)
    return VerifyReport(output=str(output.path), checks=checks, violations=violations)


@dataclass(frozen=True)
class _Output:
    """A packed output as verify reads it before its shards: the manifest and its `problems`, the
    top-level fields they break (`broken`: not trusted, so not used), and what the checks take
    from it: the layout, the counts, the rows that sample ids name (`sequences_in`; of a blend,
    its rows), the shards and those that can be read ((index, entry) pairs).

        a manifest whose `counts` lacks tokens_in: broken {'counts'}, counts {}"""

    path: Path
    manifest: dict[str, Any]
    problems: list
    broken: set[str]
    layout: Layout | None
    counts: dict[str, Any]
    sequences_in: int | None
    shards: list[dict[str, Any]]
    readable: list[tuple[int, dict[str, Any]]]

    @classmethod
    def read(cls, out: Path) -> "_Output":
        # exit 2 only for what is no manifest at all (missing, not a JSON object, an unknown version);
        # everything else wrong with it is a broken rule, and the shards it can still name are checked
        out, _, manifest = read_manifest_json(out)
        problems = manifest_problems(out, manifest)
        broken = {_top_field(p.field) for p in problems if p.rule == "manifest-fields"}
        counts = manifest["counts"] if "counts" not in broken else {}
        sequences_in = counts.get("sequences_in")
        if isinstance(manifest.get("sources"), list):  # a blend counts its uses; sample ids are its rows
            sequences_in = _blend_rows(manifest, sequences_in)
        shards = manifest["shards"] if isinstance(manifest.get("shards"), list) else []
        unreadable = {p.shard for p in problems if p.unreadable}
        return cls(path=out, manifest=manifest, problems=problems, broken=broken,
                   layout=Layout.from_manifest(manifest) if "layout" not in broken else None, counts=counts,
                   sequences_in=sequences_in, shards=shards,
                   readable=[(i, entry) for i, entry in enumerate(shards) if i not in unreadable])


def _matched_sources(output: _Output, options: VerifyOptions) -> tuple[list[str] | None, str | None]:
    """The --source files in the manifest's `inputs` order (`match_sources`; None without
    --source), or why conservation is skipped though --source was given."""
    if options.source and output.broken & {"inputs", "config", "counts"}:
        return None, "the manifest's inputs, config or counts are broken (see structure)"
    if not options.source:
        return None, None
    return match_sources(output.manifest, options.source, options.split, options.tokenizer), None


@dataclass
class _ShardPass:
    """What the pass over the shards found: the structure violations and the totals of what was
    read, each shard's sequences for conservation (`pieces`, None without --source), the packs
    kept for the attention checks, and the context-parallel split (`cp_work`, None at cp_size 1)
    with its violations; the seconds of the structure rules and of the cp split apart."""

    structure: list[Violation]
    pieces: OutputPieces | None
    cp_work: CpWork | None
    totals: Totals = field(default_factory=Totals)
    packs: list[Pack] = field(default_factory=list)
    cp_found: list[Violation] = field(default_factory=list)
    structure_seconds: float = 0.0
    cp_seconds: float = 0.0

    def structure_result(self, shards: int) -> CheckResult:
        totals = self.totals
        return CheckResult(
            _status(self.structure),
            [f"{shards} shards, {totals.packs:,} packs, {totals.pieces:,} sequences, {totals.tokens:,} tokens"],
            {"shards": shards, "packs": totals.packs, "sequences": totals.pieces, "tokens": totals.tokens,
             "violations": len(self.structure)}, seconds=self.structure_seconds)

    def cp_result(self) -> CheckResult:
        if self.cp_work is None:
            return CheckResult("skipped", ["cp_size 1 (pass --cp-size N to check a split)"],
                               {"reason": "cp_size 1", "cp_size": 1})
        s, cp_size, found = self.cp_work.summary(), self.cp_work.cp_size, self.cp_found
        lines = [f"cp {cp_size}: {s['packs']:,} packs split into valid THD shares"] if not found else [
            f"cp {cp_size}: {len(found)} broken rule(s)"]
        if s.get("packs"):
            lines.append(f"real-token causal work per rank {s['rank_work_real']}: imbalance {s['imbalance']:.3f} "
                         f"(worst pack {s['worst_pack_imbalance']:.3f})")
        return CheckResult(_status(found), lines, {**s, "violations": len(found)}, seconds=self.cp_seconds)


def _check_shards(output: _Output, picks: dict[int, list[int]], pieces: OutputPieces | None,
                  cp_work: CpWork | None, stage: Stage) -> _ShardPass:
    """The structure check: the manifest's problems, unlisted shards, the metrics, then every
    readable shard in manifest order, each read once for its rules, its sequences (added to
    `pieces`), its cp split (`cp_work`) and the packs `picks` names; the counts last."""
    out, manifest = output.path, output.manifest
    structure = manifest_violations(output.problems)
    structure += unlisted_shards(out, [entry["path"] for _, entry in output.readable])
    structure += check_metrics(out, manifest, counts_ok="counts" not in output.broken)
    found = _ShardPass(structure=structure, pieces=pieces, cp_work=cp_work)
    steps, groups = StepLoss(), GroupRule.from_manifest(manifest)
    complete = len(output.readable) == len(output.shards)
    plan_blocks = None
    if manifest.get("kind") == "plan":  # a plan is checked with its tokens read from its source
        plan_blocks = BlockCache(*plan_source(manifest, out / MANIFEST))
    started = time.perf_counter()
    advance = stage("structure", len(output.readable))
    for i, entry in output.readable:
        name = entry["path"]
        rows, broken = check_shard(out, entry, manifest, output.layout, sequences_in=output.sequences_in,
                                   steps=steps, groups=groups, plan_blocks=plan_blocks)
        advance(1)
        structure += broken
        if pieces is not None:
            pieces.add(name, rows)
        if rows is None:
            complete = False
            continue
        found.totals.add(rows)
        if cp_work is not None:
            cp_started = time.perf_counter()
            found.cp_found += check_cp(rows, cp_work.cp_size, cp_work, shard=name)
            found.cp_seconds += time.perf_counter() - cp_started
        found.packs += [Pack.from_rows(rows, r, name) for r in picks.get(i, []) if r < rows.num_rows]
    structure += check_counts(manifest, found.totals, complete=complete)
    if complete:
        structure += steps.check() + groups.check()
    found.structure_seconds = time.perf_counter() - started - found.cp_seconds
    return found


def _conservation(output: _Output, sources: list[str], pieces: OutputPieces, options: VerifyOptions,
                  stage: Stage) -> tuple[CheckResult, list[Violation]]:
    """The conservation check of the shards' `pieces` against the --source files, and what it found."""
    started = time.perf_counter()
    result = check_conservation(output.path, output.manifest, sources, pieces,
                                advance=stage("conservation", len(sources)), tokenizer=options.tokenizer)
    s = result.summary
    lines = ([f"{s['samples']:,} samples: {s['samples_packed']:,} packed, {s['dropped']:,} dropped, "
              f"{s['truncated']:,} truncated, {s['split']:,} split; {s['tokens_compared']:,} tokens compared"]
             if "sources" not in s else  # a blend: each source's rows as often as drawn
             [f"{s['samples']:,} samples, {s['samples_packed']:,} packed; " + ", ".join(
                 f"{x['name']}: {x['rows_used']:,} rows, {x['uses']:,} uses" for x in s["sources"])
              + f"; {s['tokens_compared']:,} tokens compared"])
    return CheckResult(_status(result.violations), lines, {**s, "violations": len(result.violations)},
                       seconds=time.perf_counter() - started), result.violations


def _verify_stored(url: str, options: VerifyOptions, progress: Progress | None) -> VerifyReport:
    """`verify` of an output on an object store: its manifest and every object the manifest lists,
    fetched as they are into a scratch folder (an object the store lacks is left out, for the
    structure check to report as a missing shard), then checked as a local output; the report
    names the URL."""
    from packctl.contract.mirror import mirror_output
    from packctl.store import stat_object

    options.validate()
    with tempfile.TemporaryDirectory(prefix="packctl-verify-") as scratch:
        mirror = mirror_output(url, scratch, check=False)
        _, _, manifest = read_manifest_json(mirror.root)
        shards = manifest.get("shards") if isinstance(manifest.get("shards"), list) else []
        for entry in shards:
            path = entry.get("path") if isinstance(entry, dict) else None
            if isinstance(path, str) and relative_path_problem(path) is None and \
                    stat_object(f"{mirror.url}/{path}") is not None:
                mirror.fetch(path, entry.get("sha256"))
        report = verify(mirror.root, options, progress=progress)
    return _spelled(report, mirror.local_name)


def _spelled(value, rename):
    """`value` (a report, its checks and violations) with every string passed through `rename`."""
    if isinstance(value, str):
        return rename(value)
    if isinstance(value, list):
        return [_spelled(v, rename) for v in value]
    if isinstance(value, tuple):
        return tuple(_spelled(v, rename) for v in value)
    if isinstance(value, dict):
        return {k: _spelled(v, rename) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _spelled(getattr(value, f.name), rename)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _attention_checks(checks: dict[str, CheckResult], violations: list[Violation], plan: _AttentionPlan,
                      packs: list, options: VerifyOptions, stage: Stage) -> None:
    if plan.skipped is not None:
        for name in ("attention", "contamination"):
            checks[name] = CheckResult("skipped", [f"skipped: {plan.skipped}"], {"reason": plan.skipped})
        checks["bench"] = CheckResult("skipped", [f"skipped: {plan.skipped}"], {"reason": plan.skipped})
        return
    embedding = ProbeEmbedding(seed=options.seed, heads=options.heads, head_dim=options.head_dim)
    started = time.perf_counter()
    run = run_attention(packs, plan.backends, plan.dtypes, embedding, seed=options.seed, bench=options.bench,
                        advance=stage("attention", len(packs)))
    seconds = time.perf_counter() - started - run.contamination_seconds - run.bench_seconds
    violations += run.violations
    where = [{"shard": p.shard, "row": p.row} for p in packs]
    common = {"device": plan.device, "heads": options.heads, "head_dim": options.head_dim, "seed": options.seed,
              "packs": where, "notes": plan.notes}

    att = [v for v in run.violations if v.check == "attention"]
    lines = []
    for r in run.results:
        label = f"{r['backend']} {r['dtype']} ({plan.device})"
        if r["status"] == "skipped":
            lines.append(f"{label}: skipped, {r['reason']}")
        else:
            lines.append(f"{label}: max error {r['max_error_packed']:.2e} (unpacked {r['max_error_unpacked']:.2e}; "
                         f"bound {r['bound'] if r['bound'] is None else format(r['bound'], '.2e')}), "
                         f"{r['packs']} packs, {r['sequences']} sequences")
    lines += [f"note: {n}" for n in plan.notes]
    ran = any(r["status"] != "skipped" for r in run.results)
    status = "failed" if att or any(r["status"] == "failed" for r in run.results) else ("ok" if ran else "skipped")
    if not packs:
        status, lines = "skipped", lines + ["no pack sampled (--sample 0 or no readable shard)"]
    checks["attention"] = CheckResult(status, lines, {**common, "results": run.results, "violations": len(att)},
                                      seconds=seconds)

    con = [v for v in run.violations if v.check == "contamination"]
    lines = [f"{r['backend']} {r['dtype']}: {r['packs']} packs probed, max change outside the changed sequence "
             f"{r['max_change']:.2e} ({'bitwise' if r['exact'] else 'within atol'})" for r in run.contamination]
    probed = any(r["packs"] for r in run.contamination)
    checks["contamination"] = CheckResult("failed" if con else ("ok" if probed else "skipped"),
                                          lines or ["no pack with two or more sequences sampled"],
                                          {"results": run.contamination, "violations": len(con)},
                                          seconds=run.contamination_seconds)
    if not options.bench:
        checks["bench"] = CheckResult("skipped", ["pass --bench to time packed vs padded attention"],
                                      {"reason": "no --bench"})
    else:
        lines = [f"{b['backend']} {b['dtype']} ({b['device']}): packed {b['packed_ms']:.1f} ms vs padded batch "
                 f"{b['padded_ms']:.1f} ms (batches of {b['padded_batch']}) over {b['packs']} packs: {b['speedup']:.2f}x "
                 f"({b['tokens_packed']:,} packed vs {b['tokens_padded']:,} padded tokens)" for b in run.bench]
        checks["bench"] = CheckResult("ok" if run.bench else "skipped", lines or ["nothing to time"],
                                      {"results": run.bench}, seconds=run.bench_seconds)

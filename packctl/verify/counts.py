"""The counts of a packed output: the manifest's `counts` against each other and against what the
shards hold (rule `manifest-counts`), and the packing report's against the manifest's (`metrics`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from packctl.contract.manifest import COUNT_KEYS, OPTIONAL_COUNT_KEYS, metrics_path
from packctl.contract.thd import PackRows
from packctl.verify.violation import Violation


@dataclass
class Totals:
    """What the shards hold, summed while they are checked, for `check_counts`."""

    packs: int = 0
    tokens: int = 0
    pieces: int = 0
    sample_ids: list[np.ndarray] | None = None

    def add(self, rows: PackRows) -> None:
        self.packs += rows.num_rows
        self.tokens += int(np.asarray(rows.num_tokens, dtype=np.int64).sum())
        self.pieces += len(rows.seq_lens)
        if self.sample_ids is None:
            self.sample_ids = []
        self.sample_ids.append(np.asarray(rows.sample_ids, dtype=np.int64))


def check_counts(manifest: dict[str, Any], totals: Totals, *, complete: bool) -> list[Violation]:
    """The manifest's counts against each other and, when every shard was read (`complete`), against
    what the shards hold. Counts that are not all there as integers are `manifest-fields`
    (`manifest_problems`), and checked no further here."""
    counts = manifest.get("counts")
    if not isinstance(counts, dict) or not all(isinstance(counts.get(k), int) for k in COUNT_KEYS) or not all(
            isinstance(counts[k], int) for k in OPTIONAL_COUNT_KEYS if k in counts):
        return []
    c = {k: int(counts[k]) for k in COUNT_KEYS + OPTIONAL_COUNT_KEYS if k in counts}
    found: list[Violation] = []

    def expect(rule_text: str, actual: int, expected: int) -> None:
        if actual != expected:
            found.append(Violation("structure", "manifest-counts", f"{rule_text}: {actual} != {expected}"))

    # a blend (--source) counts its uses: a row drawn twice is two sequences in, under one sample id
    blend = isinstance(manifest.get("sources"), list)
    inputs = manifest.get("inputs")
    if not blend and isinstance(inputs, list) and all(isinstance(i, dict) and isinstance(i.get("rows"), int) for i in inputs):
        expect("counts.sequences_in vs the rows of manifest inputs", c["sequences_in"],
               sum(i["rows"] for i in inputs))
    expect("counts.sequences_packed vs sequences_in - sequences_dropped", c["sequences_packed"],
           c["sequences_in"] - c["sequences_dropped"])
    # --share-prefix: a shared prefix is stored once for its group (counts.tokens_shared the others)
    expect("counts.tokens_in vs tokens_packed + tokens_shared + tokens_dropped + tokens_truncated", c["tokens_in"],
           c["tokens_packed"] + c.get("tokens_shared", 0) + c["tokens_dropped"] + c["tokens_truncated"])
    # counts.packs and counts.tokens_packed against the shard entries: manifest_problems
    if not complete:
        return found
    if "packs" in c:
        expect("packs in the shards vs counts.packs", totals.packs, c["packs"])
    expect("tokens in the shards (sum of num_tokens) vs counts.tokens_packed", totals.tokens, c["tokens_packed"])
    if "pieces" in c:
        expect("sequences in the shards vs counts.pieces", totals.pieces, c["pieces"])
    if blend:  # how often each row is there is conservation's check (verify --source)
        return found
    sids = np.concatenate(totals.sample_ids) if totals.sample_ids else np.zeros(0, np.int64)
    sids = sids[sids >= 0]  # -1: a prefix segment of --share-prefix, no input row
    ids, per_id = np.unique(sids, return_counts=True)
    expect("distinct sample ids in the shards vs counts.sequences_packed", len(ids), c["sequences_packed"])
    multi = ids[per_id > 1]
    if len(multi) != c["sequences_split"]:
        listed = ", ".join(str(int(g)) for g in multi[:5]) + (" ..." if len(multi) > 5 else "")
        found.append(Violation(
            "structure", "manifest-counts",
            f"{len(multi)} sample ids appear in more than one sequence ({listed or 'none'}), the manifest counts "
            f"{c['sequences_split']} split samples: a sample is duplicated or the counts are wrong "
            "(--source tells which)"))
    return found


def check_metrics(out: Path, manifest: dict[str, Any], *, counts_ok: bool = True) -> list[Violation]:
    """Rule `metrics`: the packing report (`_metrics.json`) is a readable JSON object whose `counts`
    are the manifest's (`counts_ok` False: the manifest's counts are broken, compared no further)."""
    path = metrics_path(out)
    try:
        report = json.loads(path.read_bytes())
    except OSError as exc:
        return [Violation("structure", "metrics", f"{path.name} cannot be read ({exc.strerror or exc}); packctl pack "
                          "writes it beside the manifest")]
    except ValueError as exc:
        return [Violation("structure", "metrics", f"{path.name} is not readable JSON ({str(exc).splitlines()[0]})")]
    if not isinstance(report, dict):
        return [Violation("structure", "metrics", f"{path.name} holds {type(report).__name__}, not a JSON object")]
    if not counts_ok:
        return []
    said, counts = report.get("counts"), manifest["counts"]
    if not isinstance(said, dict):
        return [Violation("structure", "metrics", f"{path.name} has no counts object")]
    differ = sorted(k for k in said.keys() | counts.keys() if said.get(k) != counts.get(k))
    if differ:
        shown = ", ".join(f"{k} {said.get(k)} vs {counts.get(k)}" for k in differ[:3])
        return [Violation("structure", "metrics", f"the counts of {path.name} differ from the manifest's ({shown}"
                          f"{' ...' if len(differ) > 3 else ''})", count=len(differ))]
    return []

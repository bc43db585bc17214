"""Structure: every rule of the output contract (docs/format.md), shard by shard, then over the
whole output.

    check_shard            one shard listed in the manifest: its file (checksum, readable, metadata,
                           manifest-shard: packctl/contract/reader.py), its columns (`schema`,
                           shard_rules.py) and its packs (pack_rules.py)
    manifest_violations    the manifest's fields, paths, order and counts (packctl/contract/manifest.py)
    unlisted_shards        Parquet files in OUT the manifest does not list
    counts.py              the manifest's counts against the shards and the packing report

The rules themselves are tables of small functions: `PACK_RULES` (pack_rules.py) over the columns
of a run of packs, `SHARD_RULES` (shard_rules.py) over one shard's table; `packctl.verify.run`
takes the shards one at a time. A broken rule is reported once, at its first offending shard / row
/ sequence, with the number of places it breaks.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from packctl.contract.layout import Layout
from packctl.contract.manifest import ManifestProblem, inside, read_manifest
from packctl.contract.reader import check_shard_bytes, read_shard_file, unlisted_parquet
from packctl.contract.schema import SAMPLE_IDS, SEQ_LENS, SEQ_LENS_PADDED, SEQ_STARTS
from packctl.contract.thd import PackRows
from packctl.source.pieces import with_tokens
from packctl.verify.pack_rules import PACK_RULES
from packctl.verify.shard_rules import (SHARD_RULES, Shard, StepLoss, check_shard_rules, readable_as_packs,
                                        rows_from_table, schema_violations)
from packctl.verify.violation import Violation

# The rules of the manifest, of the shard files and of the counts (reported here, by the reader,
# packctl/contract/manifest.py, counts.py and shard_rules.py's schema_violations and rows_from_table);
# with the tables' rules, every rule of the structure check (`structure_rules`, docs/verify.md).
FILE_RULES = ("manifest-fields", "manifest-paths", "manifest-order", "checksum", "shard-missing", "shard-unlisted",
              "readable", "metrics", "schema", "metadata", "column-lengths", "manifest-shard", "manifest-counts")


def structure_rules() -> list[str]:
    """Every rule id the structure check reports, each once: FILE_RULES, then SHARD_RULES' and
    PACK_RULES'. docs/verify.md lists them (a test holds the two together)."""
    return list(dict.fromkeys([*FILE_RULES, *(r for rule in SHARD_RULES for r in rule.rules),
                               *(rule.rule for rule in PACK_RULES)]))


def load_manifest(out: str | Path) -> dict[str, Any]:
    """OUT's manifest, or PackctlError (exit 2) when there is none to read (contract/manifest.py)."""
    return read_manifest(out)[1]


def check_shard(out: Path, entry: dict[str, Any], manifest: dict[str, Any], layout: Layout | None, *,
                sequences_in: int | None, steps: StepLoss | None = None,
                groups: Any = None, plan_blocks: Any = None) -> tuple[PackRows | None, list[Violation]]:
    """Checksum, schema, metadata, counts and every pack rule of one shard listed in the manifest;
    with `steps`, what the step rule (`StepLoss.check`, after the last shard) needs; with `groups`
    (a `packctl.verify.groups.GroupRule`), the shard's `group_ids` when it has them. `layout`
    None (the manifest's is broken, rule `manifest-fields`): the pack rules are left out.

    The shard is read as every reader reads it (`packctl.contract.reader.check_shard_bytes`: one
    read, hashed while parsed), and its findings become rules (`checksum`, `readable`, `metadata`,
    `manifest-shard`). `entry["path"]` must have passed `manifest_problems` (relative, inside OUT).

    A plan's shard (`plan_blocks`: the source's `packctl.source.pieces.BlockCache`) is checked
    as the shard `packctl materialize` writes of it: its token columns gathered from the source.

    Returns the shard's rows (None when it cannot be read as packs) and the broken rules.
    """
    name = entry["path"]
    path = out / name
    if not inside(os.path.realpath(out), path):  # a link made since the manifest was checked
        return None, [Violation("structure", "manifest-paths", "leads out of OUT through a symbolic link; not read",
                                shard=name)]
    if not path.is_file():
        return None, [Violation("structure", "shard-missing", "listed in the manifest but missing", shard=name)]
    try:
        data = read_shard_file(path)
    except OSError as exc:
        return None, [Violation("structure", "readable", f"cannot be read ({exc.strerror or exc})", shard=name)]
    checked = check_shard_bytes(data, entry, manifest)
    del data
    found = [Violation("structure", f.rule, f.message, shard=name) for f in checked.findings]
    table = checked.table
    if table is None:
        return None, found
    if plan_blocks is not None and not found and readable_as_plan(table.schema):
        table = with_tokens(table, plan_blocks, int(manifest["layout"]["pad_token_id"]))
    found += schema_violations(table.schema, manifest.get("format_version", 1), name)
    if not readable_as_packs(table.schema):
        return None, found
    rows, problems = rows_from_table(table, shard=name)
    found += problems
    if rows is None:
        return None, found
    found += check_shard_rules(Shard(name, table, rows, layout, sequences_in=sequences_in, steps=steps,
                                     groups=groups))
    return rows, found


def readable_as_plan(schema) -> bool:
    """Whether a plan's shard holds what its token columns are rebuilt from."""
    return all(name in schema.names for name in (SEQ_LENS, SEQ_LENS_PADDED, SAMPLE_IDS, SEQ_STARTS))


def manifest_violations(problems: list[ManifestProblem]) -> list[Violation]:
    """`manifest_problems` as rules: each rule once, at its first problem, with the number of
    fields that break it (`manifest-fields`, `manifest-paths`, `manifest-order`, `manifest-counts`)."""
    firsts: dict[str, ManifestProblem] = {}
    counts: dict[str, int] = {}
    for problem in problems:
        firsts.setdefault(problem.rule, problem)
        counts[problem.rule] = counts.get(problem.rule, 0) + 1
    return [Violation("structure", rule, f"the manifest's {first}", count=counts[rule]) for rule, first in
            firsts.items()]


def unlisted_shards(out: Path, listed: list[str]) -> list[Violation]:
    """Parquet files in OUT that the manifest does not list (readers of the directory would take them)."""
    return [Violation("structure", "shard-unlisted", "a Parquet file in OUT that the manifest does not list",
                      shard=rel) for rel in unlisted_parquet(out, listed)]

"""`packctl verify`: prove a packed output is correct and trains exactly like unpacked data.

    >>> from packctl.verify import VerifyOptions, verify
    >>> report = verify("out", VerifyOptions(source=["sample_data"]))      # doctest: +SKIP
    >>> report.ok, report.exit_code                                        # doctest: +SKIP
    (True, 0)

Checks (docs/verify.md): `structure` (every contract rule, checksums, manifest counts),
`conservation` (against --source), `attention` and `contamination` (torch), `cp` (context-parallel
split) and `bench`. Modules: structure (one shard, the manifest), pack_rules and shard_rules (the
contract's rules as tables), counts, violation, conservation, attention, backends, cp, groups,
report, run.
torch and flash-attn are imported only by the attention checks.
"""
from __future__ import annotations

from packctl.verify.report import CheckResult, VerifyReport
from packctl.verify.run import VerifyOptions, verify
from packctl.contract.layout import Layout
from packctl.verify.pack_rules import check_pack_rows
from packctl.verify.structure import load_manifest
from packctl.verify.violation import Violation

__all__ = ["CheckResult", "Layout", "VerifyOptions", "VerifyReport", "Violation", "check_pack_rows",
           "load_manifest", "verify"]

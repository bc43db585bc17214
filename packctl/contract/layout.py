"""The layout of a packed output: what every pack must look like (the manifest's `layout`).

The writer makes it from its options (`packctl.pipeline.manifest.layout_of`), records it in the
manifest and in every shard's `packctl` metadata; `packctl verify` holds the packs against it.

    >>> layout = Layout.from_dict({"capacity": 16, "align": 4, "pad_to": "capacity", "pad_token_id": 0})
    >>> layout.pack_multiple, layout.ignore_index, layout.cp_size     # what the manifest may leave out
    (4, -100, 1)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from packctl.contract.schema import IGNORE_INDEX
from packctl.errors import PackctlError


@dataclass(frozen=True)
class Layout:
    """The manifest's `layout`: what every pack of the output must look like."""

    capacity: int
    align: int
    pad_to: str
    pack_multiple: int
    pad_token_id: int
    ignore_index: int = IGNORE_INDEX
    cp_size: int = 1
    tp_size: int = 1
    # --limit COL=N: every pack's COL_sum is at most N and the sum of its COL (in --limit order)
    limits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], where: str = "the manifest") -> "Layout":
        return cls.from_dict(manifest.get("layout"), where)

    @classmethod
    def from_dict(cls, layout: Any, where: str = "the manifest") -> "Layout":
        """From a layout dict: the manifest's, or `packctl.pipeline.manifest.layout_of(config)` in the writer."""
        if not isinstance(layout, dict):
            raise PackctlError(f"{where}: no 'layout' object; the output was not written by packctl pack "
                               "(or by a version that predates format version 1)")
        try:
            return cls(capacity=int(layout["capacity"]), align=int(layout["align"]), pad_to=str(layout["pad_to"]),
                       pack_multiple=int(layout.get("pack_multiple") or layout["align"]),
                       pad_token_id=int(layout["pad_token_id"]),
                       ignore_index=int(layout.get("ignore_index", IGNORE_INDEX)),
                       cp_size=int(layout.get("cp_size", 1)), tp_size=int(layout.get("tp_size", 1)),
                       limits={str(k): int(n) for k, n in (layout.get("limits") or {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise PackctlError(f"{where}: layout lacks or mangles {exc}; it needs capacity, align, pad_to, "
                               "pad_token_id") from None

"""The group rules (`--group-column`), checked when the shards have a `group_ids` column.

`group_ids` holds, for each sequence (aligned with `sample_ids`), the gid of its group's first row.
A group is a run of consecutive gids, packed whole: two packs of an output that keep them

    pack 0  sample_ids [8, 2, 3, 4]   group_ids [8, 2, 2, 2]
    pack 1  sample_ids [0, 1, 5]      group_ids [0, 0, 5]

Rules (over every shard at once, since a group could be cut across shards):
    group-ids       one int64 per sequence, each <= its sample id and below the next group's id
                    (groups are runs of gids: gid 5 in group 2 would overlap group 5)
    group-whole     all members of a group in one pack (only a group of one may be split, under
                    --too-long split: its pieces are one sample id)
    group-adjacent  members next to each other, in input order (increasing sample_ids)

A blend (`--source`) may draw a group more than once: each member's k-th appearance in the
output (shards, packs and sequences in order) belongs to the group's k-th use, and the rules
hold for every use.

    pack 0  sample_ids [2, 3]   pack 1  sample_ids [3, 2]  -> use 0 whole; use 1 not in input order

With --group-scope step (the manifest's config says `group_scope: "step"`) a group may spread over
several packs, and group-whole and group-adjacent give way to
    group-step      all members of a group in packs of one optimizer step (the `step` column)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from packctl.contract.schema import COLUMN, GROUP_IDS, STEP
from packctl.contract.thd import PackRows
from packctl.verify.violation import Violation


@dataclass
class GroupRule:
    """Collects every shard's group ids; `check` applies the rules after the last shard."""

    scope: str = "pack"  # or "step": --group-scope of the run
    blend: bool = False  # --source: a group may be used more than once
    parts: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "GroupRule":
        config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        return cls(scope="step" if config.get("group_scope") == "step" else "pack", blend=bool(config.get("sources")))

    def add(self, table: pa.Table, rows: PackRows, shard: str) -> list[Violation]:
        """Keep one shard's group ids; returns what is wrong with the column itself."""
        arr = table.column(GROUP_IDS).combine_chunks()  # of its declared type (rule `schema`)
        if arr.null_count or arr.values.null_count:
            return [Violation("structure", "schema", f"column {GROUP_IDS} is {arr.type} with {arr.null_count} null "
                              f"rows, the contract says {COLUMN[GROUP_IDS].type_text} without nulls", shard=shard)]
        offsets = np.asarray(arr.offsets, dtype=np.int64)
        seq_offsets = np.asarray(rows.seq_offsets, dtype=np.int64)
        ragged = np.diff(offsets) != np.diff(seq_offsets)
        if ragged.any():
            return [Violation("structure", "group-ids", f"{GROUP_IDS} does not hold one id per sequence",
                              shard=shard, row=int(np.argmax(ragged)), count=int(ragged.sum()))]
        values = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy()
        row = np.repeat(np.arange(rows.num_rows, dtype=np.int64), np.diff(seq_offsets))
        position = np.arange(len(row), dtype=np.int64) - seq_offsets[row]
        sample = np.asarray(rows.sample_ids, dtype=np.int64)
        # a prefix segment of --share-prefix (sample -1; pack_rules.py checks where) counts as its group's first row
        if isinstance(rows, PackRows) and rows.parent_segments is not None:
            sample = np.where(sample < 0, values, sample)
        self.parts.append((shard, row, position, sample, values))
        if self.scope == "step":
            if STEP not in table.schema.names:
                return [Violation("structure", "group-step", "the run kept groups within steps (--group-scope step) "
                                  f"but the shard has no {STEP} column", shard=shard)]
            self.steps.append(np.asarray(table.column(STEP).to_numpy(), dtype=np.int64)[row])
        return []

    def check(self) -> list[Violation]:
        if not self.parts:
            return []
        shard_of = np.concatenate([np.full(len(p[1]), i) for i, p in enumerate(self.parts)])
        row, position, sample, group = (np.concatenate([p[k] for p in self.parts]) for k in range(1, 5))
        pack = shard_of * (int(row.max()) + 1) + row  # one number per pack of the output
        step = np.concatenate(self.steps) if self.scope == "step" and len(self.steps) == len(self.parts) else None
        use = self._uses(pack, position, sample) if self.blend else np.zeros(len(sample), np.int64)
        order = np.lexsort((sample, use, group))
        pack, position, sample, group, shard_of, row, use = (a[order] for a in (pack, position, sample, group,
                                                                                  shard_of, row, use))
        found = []

        def report(rule: str, bad: np.ndarray, message) -> None:
            if bad.any():
                k = int(np.argmax(bad))
                found.append(Violation("structure", rule, message(k), shard=self.parts[shard_of[k]][0],
                                       row=int(row[k]), sequence=int(position[k]), count=int(bad.sum())))

        one_group = group[1:] == group[:-1]
        same = one_group & (use[1:] == use[:-1])  # one use of one group
        members = same & (sample[1:] != sample[:-1])  # pieces of a split sequence (a group of one) may part
        # the id of the next group in id order, for each sequence: the group that follows its own
        unset = np.iinfo(np.int64).max
        at_group_end = np.where(np.append(~one_group, True), np.append(group[1:], unset), unset)
        next_group = np.minimum.accumulate(at_group_end[::-1])[::-1]
        report("group-ids", (group > sample) | (sample >= next_group),
               lambda k: f"sample {sample[k]} has group id {group[k]}, but a group is a run of sample ids starting at "
                         "its id and ending before the next group's")
        if self.scope == "step":
            if step is not None:
                step = step[order]
                report("group-step", np.append(same & (step[1:] != step[:-1]), False),
                       lambda k: f"group {group[k]} is cut across steps (sample {sample[k]} in step {step[k]}, "
                                 f"sample {sample[k + 1]} in step {step[k + 1]})")
            return found
        report("group-whole", np.append(members & (pack[1:] != pack[:-1]), False),
               lambda k: f"group {group[k]} is cut across packs (sample {sample[k]} and {sample[k + 1]})")
        report("group-adjacent", np.append(members & (pack[1:] == pack[:-1]) & (position[1:] != position[:-1] + 1),
                                           False),
               lambda k: f"members of group {group[k]} are not next to each other in input order (sample "
                         f"{sample[k]}, then {sample[k + 1]})")
        return found

    @staticmethod
    def _uses(pack: np.ndarray, position: np.ndarray, sample: np.ndarray) -> np.ndarray:
        """Each sequence's appearance of its sample before it in the output: 0 for the first."""
        at = np.lexsort((position, pack))
        by_sample = at[np.argsort(sample[at], kind="stable")]
        s = sample[by_sample]
        first = np.concatenate([[0], np.flatnonzero(s[1:] != s[:-1]) + 1]) if len(s) else np.zeros(0, np.int64)
        rank = np.arange(len(s)) - np.repeat(first, np.diff(np.append(first, len(s))))
        use = np.empty(len(s), np.int64)
        use[by_sample] = rank
        return use

"""verify's rules as tables (packctl/verify/pack_rules.py, shard_rules.py): each per-pack rule fires
where its row of the table says, the token-level rules wait for the sequences to tile the packs,
and docs/verify.md lists exactly the rules of the code."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from packctl.contract.layout import Layout
from packctl.contract.thd import build_pack_rows
from packctl.verify import check_pack_rows
from packctl.verify.pack_rules import PACK_RULES, Packs
from packctl.verify.shard_rules import SHARD_RULES
from packctl.verify.structure import structure_rules
from support.paths import DOCS

LAYOUT = Layout(capacity=16, align=4, pad_to="capacity", pack_multiple=4, pad_token_id=0)


def _rows():
    """Two packs of 16 (align 4, pad 0): a (5 tokens) and b (6) padded to 8 each; c (3) padded to 4
    plus 12 of tail. Labels are the tokens, each sequence's first one -100."""
    tokens = np.array([11, 12, 13, 14, 15, 21, 22, 23, 24, 25, 26, 31, 32, 33], np.int32)
    return build_pack_rows(np.array([0, 2, 3]), np.array([5, 6, 3]), np.array([8, 8, 4]), np.array([7, 3, 4]),
                           tokens, tokens, np.array([16, 16]), pad_token_id=0)


def _set(name, index, value):
    def change(rows):
        getattr(rows, name)[index] = value
    return change


def _drop_cu_entry(rows):  # pack 1 loses its last cu entry
    rows.cu_seqlens, rows.cu_seqlens_padded = rows.cu_seqlens[:-1], rows.cu_seqlens_padded[:-1]
    rows.cu_offsets = rows.cu_offsets - np.array([0, 0, 1])


def _short_padded(rows):  # c's padded length (with the tail) 12 in a pack of 16, cu_seqlens_padded agreeing
    rows.seq_lens_padded[2] = 12
    rows.cu_seqlens_padded[-1] = 12


BATCH = dict(pad_to="batch")
# (the table row's check, what breaks it, layout changes, check_pack_rows arguments) -> (rule, row, sequence)
CASES = {
    "pack_not_empty": (lambda r: setattr(r, "seq_offsets", np.array([0, 0, 3])), {}, {}, (0, None)),
    "pack_within_capacity": (None, dict(capacity=8), {}, (0, None)),
    "pack_of_capacity": (None, dict(capacity=32), {}, (0, None)),
    "pack_of_multiple": (None, dict(pad_to="multiple", pack_multiple=32), {}, (0, None)),
    "pack_cp_aligned": (None, dict(cp_size=16), {}, (0, None)),
    "sequence_cp_aligned": (None, dict(cp_size=16), {}, (0, 0)),
    "sequence_not_empty": (_set("seq_lens", 2, 0), {}, {}, (1, 0)),
    "padded_covers_sequence": (_set("seq_lens", 1, 9), {}, {}, (0, 1)),
    "micro_batch_holds_its_rows": (None, BATCH, dict(batch_shape=([8, 8], [2, 1])), (1, None)),
    "micro_batch_fits_its_sequences": (None, BATCH, dict(batch_shape=([16, 16], [1, 1])), (0, None)),
    "sequence_padded_to_row": (None, BATCH, dict(batch_shape=([4, 16], [4, 1])), (0, 0)),
    "sequence_aligned": (None, dict(align=2), {}, (0, 0)),
    "num_tokens_sum": (_set("num_tokens", 1, 5), {}, {}, (1, None)),
    "sample_ids_in_range": (None, {}, dict(sequences_in=5), (0, 0)),
    "tree_parents_precede": (lambda r: setattr(r, "parent_segments", np.array([-1, 1, -1])), {}, {}, (0, 1)),
    "tree_prefix_no_sample": (lambda r: setattr(r, "parent_segments", np.array([-1, 0, -1])), {}, {}, (0, 0)),
    "cu_one_longer": (_drop_cu_entry, {}, {}, (1, None)),
    "cu_seqlens_cumsum": (_set("cu_seqlens", 1, 6), {}, {}, (0, 0)),
    "cu_seqlens_padded_cumsum": (_set("cu_seqlens_padded", 2, 17), {}, {}, (0, 1)),
    "cu_seqlens_padded_ends_the_pack": (_short_padded, {}, {}, (1, None)),
    "padded_lengths_tile": (_short_padded, {}, {}, (1, None)),
    "positions_restart": (_set("position_ids", 17, 5), {}, {}, (1, 0)),
    "padding_is_pad_token": (_set("input_ids", 6, 9), {}, {}, (0, 0)),
    "padding_is_ignored": (_set("labels", 6, 9), {}, {}, (0, 0)),
    "first_label_ignored": (_set("labels", 8, 21), {}, {}, (0, 1)),
    "token_ids_in_range": (_set("input_ids", 9, -3), {}, {}, (0, 1)),
    "labels_in_range": (_set("labels", 9, -3), {}, {}, (0, 1)),
}


def test_the_example_breaks_no_rule():
    assert check_pack_rows(_rows(), LAYOUT, sequences_in=8) == []
    batch = dataclasses.replace(LAYOUT, pad_to="batch")
    assert check_pack_rows(_rows(), batch, batch_shape=(np.array([8, 16]), np.array([2, 1]))) == []


@pytest.mark.parametrize("rule", PACK_RULES, ids=lambda r: r.check.__name__)
def test_each_rule_fires_at_the_place_its_level_names(rule):
    assert set(CASES) == {r.check.__name__ for r in PACK_RULES}
    change, layout_changes, arguments, (row, sequence) = CASES[rule.check.__name__]
    rows = _rows()
    if change:
        change(rows)
    layout = dataclasses.replace(LAYOUT, **layout_changes)
    arguments = {k: tuple(np.array(a) for a in v) if k == "batch_shape" else v for k, v in arguments.items()}
    found = check_pack_rows(rows, layout, shard="s", **arguments)
    # the violation of this row of the table: its rule id, with the message its function writes
    packs = Packs(rows, layout, **arguments)
    assert all(need.holds(packs) for need in rule.needs)
    bad, describe = rule.check(packs)
    assert bad.any()
    (mine,) = [v for v in found if v.rule == rule.rule and v.message == describe(int(np.argmax(bad)))]
    assert (mine.shard, mine.row, mine.sequence) == ("s", row, sequence)
    assert mine.count == int(np.count_nonzero(bad))


def test_reports_follow_the_table_and_token_rules_wait_for_tiling():
    rows = _rows()
    _set("labels", 8, 21)(rows)  # labels-boundary
    _set("num_tokens", 0, 3)(rows)  # num-tokens, before it in the table
    assert [v.rule for v in check_pack_rows(rows, LAYOUT)] == ["num-tokens", "labels-boundary"]
    _short_padded(rows)  # the sequences no longer tile pack 1: no token can be placed
    assert [v.rule for v in check_pack_rows(rows, LAYOUT)] == ["num-tokens", "cu_seqlens_padded", "tiling"]


def _documented_rules() -> set[str]:
    """The rule ids of the structure table of docs/verify.md."""
    section = (DOCS / "verify.md").read_text().split("## structure", 1)[1].split("A failure reads", 1)[0]
    ids = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            ids |= set(re.findall(r"`([a-z_-]+)`", line.split("|")[1]))
    return ids


def test_docs_verify_lists_every_structure_rule():
    assert _documented_rules() == set(structure_rules())


def test_docs_verify_shows_the_per_pack_table_as_the_code_has_it():
    expected = [f"| `{r.rule}` | {r.level} | {' and '.join(n.text for n in r.needs) or 'always'} | {r.doc} |"
                for r in PACK_RULES]
    text = (DOCS / "verify.md").read_text()
    table = text.split("| rule | located at | when | checks |\n|---|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    assert table.splitlines() == expected, "docs/verify.md: paste the rows above"


@pytest.mark.parametrize("rule", [*PACK_RULES, *SHARD_RULES], ids=lambda r: r.check.__name__)
def test_every_rule_says_in_one_line_what_it_checks(rule):
    assert rule.doc.endswith(".") and len(rule.doc) < 110, rule.doc

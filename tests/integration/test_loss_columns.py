"""Loss-normalization columns: num_loss_tokens, seq_loss_tokens and sum_sq_seqlen per pack, and with
--dp-size step_loss_tokens and step_loss_sequences per step. Their values against the source
labels (read by sample id, not from the packs), the step sums against the packs of each step, the
same bytes for any rank count, and verify's rules on tampered copies and on outputs without them."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from support.contract import check_contract
from support.runs import pack_to
from packctl import PackConfig, pack
from packctl.contract.schema import IGNORE_INDEX
from packctl.verify import VerifyOptions, verify
from test_verify import _edit_list, _rewrite
from support.threadcomm import run_ranks

BALANCED = dict(capacity=1024, too_long="split", dp_size=2, micro_batches=2, window=700)


@pytest.fixture(scope="module")
def balanced(tmp_path_factory, sample_data):
    return pack_to(tmp_path_factory.mktemp("balanced"), [sample_data], **BALANCED)[1]


def _source_labels(sample_data) -> list[np.ndarray]:
    labels = []
    for path in sorted(sample_data.rglob("*.parquet")):
        labels += [np.asarray(x) for x in pq.read_table(path, columns=["labels"]).column("labels").to_pylist()]
    return labels


def test_columns_count_the_source_targets_of_every_piece(balanced, sample_data):
    """seq_loss_tokens of a piece = source labels != -100 after the piece's first token (pieces of a
    split sample follow each other in output order); the pack and step columns are their sums."""
    labels = _source_labels(sample_data)
    table = pq.read_table(balanced / "data").to_pydict()
    consumed: dict[int, int] = {}
    per_step: dict[int, list[int]] = {}
    split_pieces = masked = 0
    for r, (gids, lens) in enumerate(zip(table["sample_ids"], table["seq_lens"])):
        expected = []
        for gid, n in zip(gids, lens):
            start = consumed.get(gid, 0)
            consumed[gid] = start + n
            split_pieces += start > 0
            piece = labels[gid][start + 1:start + n]
            masked += bool((piece == IGNORE_INDEX).any())
            expected.append(int((piece != IGNORE_INDEX).sum()))
        assert table["seq_loss_tokens"][r] == expected
        assert table["num_loss_tokens"][r] == sum(expected)
        assert table["sum_sq_seqlen"][r] == sum(int(n) ** 2 for n in lens)
        per_step.setdefault(table["step"][r], []).extend(expected)
    assert split_pieces > 0 and masked > 0  # later pieces of split samples and masked prompts are covered
    for r, step in enumerate(table["step"]):
        assert table["step_loss_tokens"][r] == sum(per_step[step])
        assert table["step_loss_sequences"][r] == sum(c > 0 for c in per_step[step])
    assert len(per_step) > 1


def test_steps_sums_are_the_same_bytes_for_any_rank_count(tmp_path, sample_data, contract):
    """Steps whose packs are planned on one rank and written by others: every rank count writes the
    single-process bytes (step sums come from the plan), and the contract checker accepts the columns."""
    options = dict(inputs=[str(sample_data)], order="shuffle", token_transfer="exchange", overwrite=True,
                   **BALANCED)
    pack(PackConfig(output=str(tmp_path / "one"), **options))
    run_ranks(3, lambda comm: pack(PackConfig(output=str(tmp_path / "many"), **options), comm=comm))
    one = json.loads((tmp_path / "one/_manifest.json").read_text())["shards"]
    many = json.loads((tmp_path / "many/_manifest.json").read_text())["shards"]
    assert [s["sha256"] for s in one] == [s["sha256"] for s in many]
    assert check_contract(contract, tmp_path / "many", [sample_data]) == []
    assert verify(tmp_path / "many", VerifyOptions(attention=False)).ok


def test_unbalanced_outputs_have_the_pack_columns_only(tmp_path, sample_data):
    _, out = pack_to(tmp_path, [sample_data], capacity=4096, too_long="split")
    names = pq.read_schema(next(out.glob("data/*.parquet"))).names
    assert {"num_loss_tokens", "seq_loss_tokens", "sum_sq_seqlen"} <= set(names)
    assert not {"step_loss_tokens", "step_loss_sequences"} & set(names)


def _plus_one(column, row=0, k=0):
    def change(values, offsets):
        values[offsets[row] + k] += 1
    return lambda t: _edit_list(t, column, change)


def _scalar_plus_one(column, row=0):
    def edit(table):
        import pyarrow as pa

        values = table.column(column).to_numpy().copy()
        values[row] += 1
        i = table.schema.get_field_index(column)
        return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
    return edit


@pytest.mark.parametrize("edit, rule", [
    (_scalar_plus_one("num_loss_tokens"), "loss-tokens"),
    (_plus_one("seq_loss_tokens"), "loss-tokens"),
    (_scalar_plus_one("sum_sq_seqlen"), "attn-cost"),
    (_scalar_plus_one("step_loss_tokens"), "step-loss"),
    (_scalar_plus_one("step_loss_sequences"), "step-loss"),
])
def test_verify_recounts_each_column(balanced, tmp_path, edit, rule):
    broken = tmp_path / "broken"
    shutil.copytree(balanced, broken)
    _rewrite(broken, edit, recount_loss=False)
    report = verify(broken, VerifyOptions(attention=False))
    assert [v.rule for v in report.violations] == [rule], [str(v) for v in report.violations]
    assert report.violations[0].row == 0


def test_outputs_written_before_the_columns_still_verify(balanced, tmp_path):
    """Format version 2 outputs from before these columns: nothing to recount, nothing reported."""
    old = tmp_path / "old"
    shutil.copytree(balanced, old)
    dropped = ["num_loss_tokens", "seq_loss_tokens", "sum_sq_seqlen", "step_loss_tokens", "step_loss_sequences"]
    for shard in range(len(json.loads((old / "_manifest.json").read_text())["shards"])):
        _rewrite(old, lambda t: t.drop_columns(dropped), shard=shard, recount_loss=False)
    report = verify(old, VerifyOptions(attention=False))
    assert report.ok, [str(v) for v in report.violations]

"""packctl verify: structure and conservation pass on real outputs and fail, with the right message,
on deliberately broken copies (each corruption rewritten with pyarrow); exit codes and JSON."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from typer.testing import CliRunner

from support.contract import check_contract
from support.adversary import packctl
from support.runs import pack_to
from support.data import write_table
from packctl import PackConfig, PackctlError
from packctl.cli import app
from packctl.config import FIELDS
from packctl.contract.schema import IGNORE_INDEX
from packctl.pipeline.manifest import layout_of
from packctl.contract.manifest import sha256_file
from packctl.verify import VerifyOptions, check_pack_rows, verify
from packctl.contract.thd import loss_columns
from packctl.contract.layout import Layout
from packctl.verify.pack_rules import tiled_starts
from packctl.verify.shard_rules import rows_from_table

NO_ATTENTION = dict(attention=False)

LAYOUTS = {  # name -> pack options (sample_data has 7 sequences longer than 4096)
    "bfd-split": dict(too_long="split"),
    "ffd-cp2-split": dict(algorithm="ffd", cp_size=2, too_long="split", window=700),
    "concat-tp2-multiple-drop": dict(algorithm="concat", tp_size=2, pad_to="multiple", too_long="drop",
                                     order="shuffle", seed=3),
    "split-cp2-tp2-truncate": dict(algorithm="split", capacity=2048, cp_size=2, tp_size=2, too_long="truncate"),
    "mffd-cp4-truncate": dict(algorithm="mffd", cp_size=4, pad_to="multiple", too_long="truncate", shard_rows=50,
                              order="curriculum"),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, sample_data):
    """One packed output per layout, built once for the module."""
    built = {}
    for name, options in LAYOUTS.items():
        _, out = pack_to(tmp_path_factory.mktemp(name), [sample_data], **options)
        built[name] = out
    return built


@pytest.fixture()
def out(outputs):
    return outputs["bfd-split"]


def _copy(out: Path, tmp_path: Path) -> Path:
    target = tmp_path / "broken"
    shutil.copytree(out, target)
    return target


def _manifest(out: Path) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def _rewrite(out: Path, edit, *, shard: int = 0, consistent: bool = True, recount_loss: bool = True) -> None:
    """Apply `edit(table) -> table` to a shard; with `consistent`, also update the manifest (and the
    counts of _metrics.json) the way a buggy packer would have written it (checksum, rows, tokens
    and counts), so only the corruption itself is left to find. With `recount_loss`, the per-pack loss columns are counted again from
    the edited labels, as that packer would have counted them."""
    manifest = _manifest(out)
    entry = manifest["shards"][shard]
    path = out / entry["path"]
    table = edit(pq.read_table(path))
    if recount_loss and "num_loss_tokens" in table.column_names:
        table = _recount_loss(table)
    pq.write_table(table, path)
    if consistent:
        rows_before, tokens_before = entry["rows"], entry["tokens"]
        tokens = int(np.asarray(table.column("num_tokens")).sum())
        pieces = sum(len(x) for x in table.column("seq_lens").to_pylist())
        pieces_before = manifest["counts"]["pieces"] - sum(
            len(x) for s in manifest["shards"] if s is not entry
            for x in pq.read_table(out / s["path"], columns=["seq_lens"]).column("seq_lens").to_pylist())
        entry.update(sha256=sha256_file(path), rows=table.num_rows, tokens=tokens)
        counts = manifest["counts"]
        counts["packs"] += table.num_rows - rows_before
        counts["tokens_packed"] += tokens - tokens_before
        counts["pieces"] += pieces - pieces_before
        (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))
        metrics = json.loads((out / "_metrics.json").read_text())
        metrics["counts"] = counts
        (out / "_metrics.json").write_text(json.dumps(metrics, indent=2))


def _recount_loss(table: pa.Table) -> pa.Table:
    rows, _ = rows_from_table(table)
    if rows is None or tiled_starts(rows) is None:
        return table
    counted = loss_columns(rows)
    for name, values in (("num_loss_tokens", counted.num_loss_tokens), ("sum_sq_seqlen", counted.sum_sq_seqlen)):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))

    def per_sequence(values, offsets):
        if len(values) == len(counted.seq_loss_tokens):
            values[:] = counted.seq_loss_tokens

    return _edit_list(table, "seq_loss_tokens", per_sequence)


def _edit_list(table: pa.Table, column: str, change) -> pa.Table:
    """`change(values, offsets)` edits a copy of the flat values of a list column in place."""
    arr = table.column(column).combine_chunks()
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.values.to_numpy(zero_copy_only=False).copy()
    change(values, offsets)
    new = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, arr.type.value_type))
    index = table.schema.get_field_index(column)
    return table.set_column(index, table.schema.field(index), new)


def _row(table: pa.Table, min_sequences: int = 2) -> int:
    """The first row holding at least `min_sequences` sequences."""
    return next(i for i, s in enumerate(table.column("seq_lens").to_pylist()) if len(s) >= min_sequences)


def _rules(report) -> list[str]:
    return [v.rule for v in report.violations]


# ------------------------------------------------------------------------------------------ passing


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_verifies(outputs, sample_data, contract, name):
    out = outputs[name]
    assert check_contract(contract, out, [sample_data]) == []  # the outside referee agrees
    report = verify(out, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    assert report.ok, [str(v) for v in report.violations]
    assert report.exit_code == 0
    checks = report.checks
    assert checks["structure"].status == checks["conservation"].status == "ok"
    assert checks["conservation"].details["samples"] == 2000
    manifest = _manifest(out)
    assert checks["conservation"].details["split"] == manifest["counts"]["sequences_split"]
    assert checks["conservation"].details["dropped"] == manifest["counts"]["sequences_dropped"]
    assert checks["conservation"].details["truncated"] == manifest["counts"]["sequences_truncated"]
    assert checks["cp"].status == ("ok" if manifest["layout"]["cp_size"] > 1 else "skipped")


def test_synthetic_table_without_labels_and_odd_pad_id(tmp_path):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, size=300)
    tokens = [rng.integers(0, 50, n).astype(np.int64).tolist() for n in lengths]
    write_table(tmp_path / "in/b.parquet", {"input_ids": pa.array(tokens[150:], pa.list_(pa.int64()))})
    write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array(tokens[:150], pa.list_(pa.int64()))})
    _, out = pack_to(tmp_path, [tmp_path / "in"], capacity=64, algorithm="ffs", order="shuffle", pad_token_id=7,
                     seq_multiple=8, pad_to="multiple", shard_rows=20)
    report = verify(out, VerifyOptions(source=[str(tmp_path / "in")], **NO_ATTENTION))
    assert report.ok, [str(v) for v in report.violations]
    assert len(_manifest(out)["shards"]) > 1


@pytest.mark.skipif("skip_empty" not in FIELDS, reason="this packctl has no --skip-empty")
def test_empty_rows_left_out_by_skip_empty_are_accounted_for(tmp_path):
    rows = [[1, 2, 3], [], [4, 5], [6]]
    write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array(rows, pa.list_(pa.int32()))})
    _, out = pack_to(tmp_path, [tmp_path / "in"], capacity=8, skip_empty=True)
    report = verify(out, VerifyOptions(source=[str(tmp_path / "in")], **NO_ATTENTION))
    assert report.ok, [str(v) for v in report.violations]
    assert report.checks["conservation"].details["dropped"] == 1


def test_check_pack_rows_runs_on_what_the_writer_builds():
    from packctl.contract.thd import build_pack_rows

    tokens = np.array([11, 12, 13, 14, 15, 21, 22, 23, 24, 25, 26], np.int32)
    rows = build_pack_rows(np.array([0, 2]), np.array([5, 6]), np.array([8, 8]), np.array([7, 3]), tokens, tokens,
                           np.array([16]), pad_token_id=0)
    layout = Layout.from_dict(layout_of(PackConfig(inputs=["x"], output="y", capacity=16, cp_size=2)))
    assert check_pack_rows(rows, layout) == []
    rows.labels[8] = 21  # the first token of sequence 1 keeps its label
    (violation,) = check_pack_rows(rows, layout, shard="part-x")
    assert (violation.rule, violation.row, violation.sequence) == ("labels-boundary", 0, 1)


# ------------------------------------------------------------------------------------------ structure


def test_boundary_label_left_in(out, tmp_path):
    broken = _copy(out, tmp_path)
    table = pq.read_table(broken / "data/train-00000.parquet")
    row = _row(table)
    second_start = table.column("cu_seqlens_padded")[row].as_py()[1]

    def leave_label(values, offsets):
        values[offsets[row] + second_start] = 5

    _rewrite(broken, lambda t: _edit_list(t, "labels", leave_label))
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    assert report.exit_code == 1
    (v,) = report.violations
    assert (v.rule, v.shard, v.row, v.sequence) == ("labels-boundary", "data/train-00000.parquet", row, 1)
    assert "first token of the sequence has label 5" in str(v)
    assert f"data/train-00000.parquet row {row} sequence 1" in str(v)


@pytest.mark.parametrize("column", ["cu_seqlens", "cu_seqlens_padded"])
def test_cu_seqlens_off_by_one(out, tmp_path, column):
    broken = _copy(out, tmp_path)
    row = _row(pq.read_table(out / "data/train-00000.parquet"))

    def shift(values, offsets):
        values[offsets[row] + 1] += 1

    _rewrite(broken, lambda t: _edit_list(t, column, shift))
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    (v,) = report.violations
    assert (v.rule, v.row, v.sequence) == (column, row, 0)
    assert f"{column}[1] is" in v.message and "must be [0, cumsum(" in v.message


def test_position_ids_not_reset(out, tmp_path):
    broken = _copy(out, tmp_path)
    row = _row(pq.read_table(out / "data/train-00000.parquet"))

    def count_on(values, offsets):
        values[offsets[row]:offsets[row + 1]] = np.arange(offsets[row + 1] - offsets[row])

    _rewrite(broken, lambda t: _edit_list(t, "position_ids", count_on))
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    (v,) = report.violations
    assert (v.rule, v.row, v.sequence) == ("position-ids", row, 1)
    assert "restart at 0" in v.message


def test_trl_lengths_that_differ_from_seq_lens_padded(out, tmp_path):
    broken = _copy(out, tmp_path)
    row = _row(pq.read_table(out / "data/train-00000.parquet"))

    def merge_first_two(values, offsets):  # TRL would see one sequence where packctl wrote two
        values[offsets[row]] += values[offsets[row] + 1]
        values[offsets[row] + 1] = 0

    _rewrite(broken, lambda t: _edit_list(t, "seq_lengths", merge_first_two))
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    (v,) = report.violations
    assert (v.rule, v.row, v.count) == ("trl-lengths", row, 1)
    assert "seq_lengths differs from seq_lens_padded" in str(v)


def test_shard_altered_after_the_manifest(out, tmp_path, sample_data):
    broken = _copy(out, tmp_path)

    def bump(values, offsets):
        values[1] += 1

    _rewrite(broken, lambda t: _edit_list(t, "input_ids", bump), consistent=False)
    report = verify(broken, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    rules = _rules(report)
    assert "checksum" in rules and "tokens" in rules
    checksum = report.violations[rules.index("checksum")]
    assert checksum.shard == "data/train-00000.parquet" and "sha256 differs from the manifest" in checksum.message
    tokens = report.violations[rules.index("tokens")]
    assert (tokens.row, tokens.sequence) == (0, 0) and "token 1 of the sequence is" in tokens.message


def test_unlisted_and_missing_shards(out, tmp_path):
    broken = _copy(out, tmp_path)
    shutil.copy(broken / "data/train-00000.parquet", broken / "data/train-00001.parquet")
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    assert _rules(report) == ["shard-unlisted"] and report.violations[0].shard == "data/train-00001.parquet"
    (broken / "data/train-00000.parquet").unlink()
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    assert "shard-missing" in _rules(report)


def test_no_manifest_is_unusable_input(out, tmp_path):
    broken = _copy(out, tmp_path)
    (broken / "_manifest.json").unlink()
    with pytest.raises(PackctlError) as err:
        verify(broken, VerifyOptions(**NO_ATTENTION))
    assert "no _manifest.json" in str(err.value) and err.value.exit_code == 2


# ------------------------------------------------------------------------------------------ conservation


def test_two_tokens_swapped_across_sequences(out, tmp_path, sample_data):
    broken = _copy(out, tmp_path)
    table = pq.read_table(out / "data/train-00000.parquet")
    row = _row(table)
    ids = table.column("input_ids")[row].as_py()
    cu = table.column("cu_seqlens_padded")[row].as_py()
    a, b = cu[0] + 2, cu[1] + 2
    assert ids[a] != ids[b]

    def swap(values, offsets):
        base = offsets[row]
        values[base + a], values[base + b] = values[base + b], values[base + a]

    _rewrite(broken, lambda t: _edit_list(t, "input_ids", swap))
    assert verify(broken, VerifyOptions(**NO_ATTENTION)).ok  # the layout is intact: only the source can tell
    report = verify(broken, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    assert _rules(report) == ["tokens", "tokens"]
    first, second = report.violations
    assert (first.row, first.sequence, second.row, second.sequence) == (row, 0, row, 1)
    assert f"token 2 of the sequence is {ids[b]}, the source has {ids[a]}" in first.message


def test_sample_missing(out, tmp_path, sample_data):
    broken = _copy(out, tmp_path)
    lost = pq.read_table(out / "data/train-00000.parquet").column("sample_ids")[7].as_py()
    _rewrite(broken, lambda t: pa.concat_tables([t.slice(0, 7), t.slice(8)]))
    report = verify(broken, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    structure = [v for v in report.violations if v.check == "structure"]
    assert structure and all(v.rule == "manifest-counts" for v in structure)  # sample ids vs sequences_packed
    missing = [v for v in report.violations if v.rule == "sample-missing"]
    assert len(missing) == 1 and missing[0].count == len(lost)
    assert f"sample {min(lost)} (" in missing[0].message and "is not in the output; it fits the capacity" in \
        missing[0].message


def test_sample_duplicated(out, tmp_path, sample_data):
    broken = _copy(out, tmp_path)
    table = pq.read_table(out / "data/train-00000.parquet")
    twice = table.column("sample_ids")[0].as_py()
    _rewrite(broken, lambda t: pa.concat_tables([t, t.slice(0, 1)]))
    report = verify(broken, VerifyOptions(**NO_ATTENTION))
    assert set(_rules(report)) == {"manifest-counts"}  # tokens_packed now exceeds tokens_in, ids repeat
    assert any("appear in more than one sequence" in v.message for v in report.violations)
    report = verify(broken, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    dup = next(v for v in report.violations if v.rule == "sample-duplicated")
    seq = twice.index(min(twice))
    assert f"sample {min(twice)} (" in dup.message and "appears 2 times" in dup.message
    assert f"data/train-00000.parquet row 0 sequence {seq}; data/train-00000.parquet row {table.num_rows} sequence {seq}" in \
        dup.message
    assert (dup.shard, dup.row, dup.sequence) == ("data/train-00000.parquet", table.num_rows, seq)


def test_source_label_changed(out, tmp_path, sample_data):
    broken = _copy(out, tmp_path)
    table = pq.read_table(out / "data/train-00000.parquet")
    row = 3
    labels = table.column("labels")[row].as_py()
    k = next(i for i, x in enumerate(labels) if i > 0 and x != IGNORE_INDEX)

    def mask(values, offsets):
        values[offsets[row] + k] = IGNORE_INDEX

    _rewrite(broken, lambda t: _edit_list(t, "labels", mask))
    report = verify(broken, VerifyOptions(source=[str(sample_data)], **NO_ATTENTION))
    (v,) = report.violations
    assert v.rule == "labels" and v.row == row and f"is {IGNORE_INDEX}, expected {labels[k]}" in v.message


def test_source_that_is_not_the_input(out, tmp_path, sample_data):
    with pytest.raises(PackctlError) as err:
        verify(out, VerifyOptions(source=[str(sample_data / "shard-00000.parquet")], **NO_ATTENTION))
    assert "pass the INPUT given to packctl pack" in str(err.value)
    other = write_table(tmp_path / "other.parquet", {"input_ids": pa.array([[1]], pa.list_(pa.int32()))})
    with pytest.raises(PackctlError) as err:
        verify(out, VerifyOptions(source=[str(sample_data), str(other)], **NO_ATTENTION))
    assert "other.parquet is not an input of this output" in str(err.value)


def test_source_found_from_another_directory(out, tmp_path, sample_data):
    moved = tmp_path / "elsewhere" / "sample_data"
    shutil.copytree(sample_data, moved)
    assert verify(out, VerifyOptions(source=[str(moved)], **NO_ATTENTION)).ok


def test_rows_from_table_refuses_ragged_columns(out):
    table = pq.read_table(out / "data/train-00000.parquet")
    labels = table.column("labels").to_pylist()
    labels[2] = labels[2][:-1]
    table = table.set_column(1, table.schema.field(1), pa.array(labels, pa.list_(pa.int32())))
    rows, (v,) = rows_from_table(table, shard="s")
    assert rows is None and (v.rule, v.row) == ("column-lengths", 2)


# ------------------------------------------------------------------------------------------ CLI


def _invoke(*args: str):
    """The CLI in this process (typer's runner): exit code, stdout and stderr without a new interpreter."""
    return CliRunner().invoke(app, list(args))


def test_cli_exit_codes_and_json(out, tmp_path, sample_data):
    proc = packctl("verify", str(out), "--source", str(sample_data), "--no-attention", "--json")
    assert proc.code == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["exit_code"] == 0 and report["violations"] == []
    assert set(report["checks"]) == {"structure", "conservation", "attention", "contamination", "cp", "bench"}
    assert report["checks"]["attention"] == {"status": "skipped", "reason": "--no-attention"}

    broken = _copy(out, tmp_path)
    _rewrite(broken, lambda t: _edit_list(t, "labels", lambda v, o: v.__setitem__(o[0], 9)))
    result = _invoke("verify", str(broken), "--no-attention")
    assert result.exit_code == 1
    assert "FAIL data/train-00000.parquet row 0 sequence 0: the first token of the sequence has label 9" in \
        " ".join(result.stdout.split())

    result = _invoke("verify", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "no such output directory" in result.stderr


def test_without_torch_structure_and_conservation_still_run(out, sample_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as without the torch extra
    result = _invoke("verify", str(out), "--source", str(sample_data), "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["checks"]["conservation"]["status"] == "ok"
    reason = report["checks"]["attention"]["reason"]
    assert reason.startswith("torch is missing") and "pip install 'packctl[torch]'" in reason
    result = _invoke("verify", str(out), "--backend", "sdpa")
    assert result.exit_code == 2 and "pip install 'packctl[torch]'" in result.stderr


@pytest.mark.parametrize("options, fragment", [
    (dict(sample=-1), "--sample -1"), (dict(head_dim=12), "--head-dim 12"), (dict(cp_size=0), "--cp-size 0"),
])
def test_bad_options_are_unusable_input(out, options, fragment):
    with pytest.raises(PackctlError) as err:
        verify(out, VerifyOptions(**options))
    assert fragment in str(err.value) and err.value.exit_code == 2

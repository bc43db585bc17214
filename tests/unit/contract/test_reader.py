"""The one reader of a packed output (packctl/contract/reader.py) and the manifest validation it
relies on (packctl/contract/manifest.py), on tiny outputs written by hand: pack k holds one
sequence of 4 tokens [k, k, k, k], capacity 4, two packs per shard."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackctlError
from packctl.contract.manifest import (ManifestProblem, epoch_outputs, manifest_problems, read_manifest,
                                       relative_path_problem, sha256_file)
from packctl.contract.reader import check_shard_bytes, open_output
from support.outputs import LAYOUT, tiny_packs as _table


def _write_output(out: Path, shards: int = 3, rows: int = 2, version: int = 2) -> Path:
    """A complete output of `shards` shards of `rows` packs, its manifest as pack writes it."""
    entries = []
    for k in range(shards):
        name = f"data/train-{k:05d}.parquet" if version == 2 else f"part-{k:05d}.parquet"
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(k * rows, rows, version=version), out / name)
        entries.append({"path": name, "rows": rows, "tokens": 4 * rows, "sha256": sha256_file(out / name)})
    packs = shards * rows
    counts = {"sequences_in": packs, "sequences_packed": packs, "sequences_dropped": 0, "sequences_truncated": 0,
              "sequences_split": 0, "tokens_in": 4 * packs, "tokens_packed": 4 * packs, "tokens_dropped": 0,
              "tokens_truncated": 0, "packs": packs, "pieces": packs}
    manifest = {"format_version": version, "config": {"algorithm": "bfd", "tokens_column": "input_ids",
                                                      "labels_column": None}, "layout": LAYOUT,
                "inputs": [{"path": "in/a.parquet", "rows": packs, "bytes": 100}], "shards": entries,
                "counts": counts}
    _save(out, manifest, version)
    return out


def _save(out: Path, manifest: dict, version: int = 2) -> None:
    (out / ("_manifest.json" if version == 2 else "manifest.json")).write_text(json.dumps(manifest))


def _manifest(out: Path) -> dict:
    return json.loads((out / "_manifest.json").read_text())


@pytest.fixture()
def out(tmp_path) -> Path:
    return _write_output(tmp_path / "out")


def _problems(out: Path, edit) -> list[tuple[str, str]]:
    manifest = copy.deepcopy(_manifest(out))
    edit(manifest)
    return [(p.rule, p.field) for p in manifest_problems(out, manifest)]


# ---- manifest_problems -----------------------------------------------------------------------------


def test_a_manifest_as_pack_writes_it_has_no_problem(out, tmp_path):
    assert manifest_problems(out, _manifest(out)) == []
    old = _write_output(tmp_path / "v1", version=1)  # part-0000k.parquet at OUT's root
    assert manifest_problems(old, json.loads((old / "manifest.json").read_text())) == []


def _set(path: str, value):
    """An edit of the manifest: set the field at `path` ('shards.0.rows') to `value`, or delete it."""
    def edit(manifest):
        *parents, last = path.split(".")
        node = manifest
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        key = int(last) if isinstance(node, list) else last
        if value is DELETE:
            del node[key]
        else:
            node[key] = value
    return edit


DELETE = object()

FIELD_CASES = {  # edit -> (rule, field) of the first problem
    "layout null": (_set("layout", None), "layout"),
    "capacity null": (_set("layout.capacity", None), "layout.capacity"),
    "capacity a string": (_set("layout.capacity", "4"), "layout.capacity"),
    "capacity 0": (_set("layout.capacity", 0), "layout.capacity"),
    "align a float": (_set("layout.align", 1.0), "layout.align"),
    "align missing": (_set("layout.align", DELETE), "layout.align"),
    "pad_to unknown": (_set("layout.pad_to", "full"), "layout.pad_to"),
    "pad_token_id negative": (_set("layout.pad_token_id", -1), "layout.pad_token_id"),
    "cp_size a bool": (_set("layout.cp_size", True), "layout.cp_size"),
    "sequence_parallel a string": (_set("layout.sequence_parallel", "yes"), "layout.sequence_parallel"),
    "shards a dict": (_set("shards", {"0": "data/train-00000.parquet"}), "shards"),
    "shards empty": (_set("shards", []), "shards"),
    "an entry a string": (_set("shards.1", "data/train-00001.parquet"), "shards[1]"),
    "rows a string": (_set("shards.0.rows", "2"), "shards[0].rows"),
    "rows negative": (_set("shards.0.rows", -2), "shards[0].rows"),
    "rows a bool": (_set("shards.0.rows", True), "shards[0].rows"),
    "tokens null": (_set("shards.2.tokens", None), "shards[2].tokens"),
    "sha256 upper case": (lambda m: m["shards"][0].update(sha256=m["shards"][0]["sha256"].upper()),
                          "shards[0].sha256"),
    "sha256 short": (lambda m: m["shards"][0].update(sha256=m["shards"][0]["sha256"][:63]), "shards[0].sha256"),
    "sha256 missing": (_set("shards.0.sha256", DELETE), "shards[0].sha256"),
    "path a number": (_set("shards.0.path", 0), "shards[0].path"),
    "counts a list": (_set("counts", [6]), "counts"),
    "counts.packs a string": (_set("counts.packs", "6"), "counts.packs"),
    "counts.tokens_in missing": (_set("counts.tokens_in", DELETE), "counts.tokens_in"),
    "inputs an object": (_set("inputs", {"path": "a"}), "inputs"),
    "inputs rows a float": (_set("inputs.0.rows", 6.0), "inputs[0].rows"),
    "config a list": (_set("config", ["bfd"]), "config"),
    "config.attn_coeff a string": (_set("config.attn_coeff", "1"), "config.attn_coeff"),
    "config.labels_column a number": (_set("config.labels_column", 3), "config.labels_column"),
    "lr_scale strings": (_set("lr_scale", ["1.0"]), "lr_scale"),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_each_field_of_the_wrong_type_or_range_is_named(out, case):
    edit, field = FIELD_CASES[case]
    problems = _problems(out, edit)
    assert problems and problems[0] == ("manifest-fields", field), problems


PATH_CASES = {
    "../x.parquet": "leads out of OUT",
    "data/../../x.parquet": "leads out of OUT",
    "/tmp/x.parquet": "is absolute",
    "./data/train-00000.parquet": "is not normalized",
    "data//train-00000.parquet": "is not normalized",
    "data/./train-00000.parquet": "is not normalized",
    "data/train-00000.parquet/": "is not normalized",
    "data\\train-00000.parquet": "backslash",
    "data/train\x00.parquet": "NUL",
    "": "is empty",
}


@pytest.mark.parametrize("path", list(PATH_CASES))
def test_paths_must_be_relative_normalized_and_inside(out, path):
    assert PATH_CASES[path] in relative_path_problem(path)
    problems = _problems(out, _set("shards.0.path", path))
    assert problems[0] == ("manifest-paths", "shards[0].path"), problems


def test_well_formed_paths_pass():
    for path in ("data/train-00000.parquet", "part-00000.parquet", "epoch-00001/data/train-00002.parquet"):
        assert relative_path_problem(path) is None


def test_a_link_inside_out_to_elsewhere_is_refused_and_out_itself_a_link_is_fine(out, tmp_path):
    elsewhere = tmp_path / "elsewhere.parquet"
    (out / "data/train-00001.parquet").rename(elsewhere)
    (out / "data/train-00001.parquet").symlink_to(elsewhere)  # same bytes: only the path tells
    problems = manifest_problems(out, _manifest(out))
    assert [(p.rule, p.field, p.unreadable) for p in problems] == [("manifest-paths", "shards[1].path", True)]
    assert "through a symbolic link" in problems[0].message
    (out / "data/train-00001.parquet").unlink()
    elsewhere.rename(out / "data/train-00001.parquet")

    link = tmp_path / "link-to-out"
    link.symlink_to(out)
    assert manifest_problems(link, _manifest(out)) == []
    assert open_output(link).read_shard(2).num_rows == 2

    inner = out / "data-real"
    (out / "data").rename(inner)
    (out / "data").symlink_to(inner)  # a link that stays inside OUT is fine
    assert manifest_problems(out, _manifest(out)) == []


def test_shards_in_the_order_pack_writes_them(out):
    swapped = lambda m: m["shards"].insert(0, m["shards"].pop(1))  # noqa: E731
    assert _problems(out, swapped) == [("manifest-order", "shards[0].path"), ("manifest-order", "shards[1].path")]
    dropped_middle = lambda m: m["shards"].pop(1)  # noqa: E731
    assert _problems(out, dropped_middle)[0] == ("manifest-order", "shards[1].path")
    duplicated = lambda m: m["shards"].append(dict(m["shards"][0]))  # noqa: E731
    assert _problems(out, duplicated)[0] == ("manifest-paths", "shards[3].path")
    dropped_last = lambda m: m["shards"].pop()  # noqa: E731
    assert _problems(out, dropped_last) == [("manifest-counts", "counts.packs"),
                                            ("manifest-counts", "counts.tokens_packed")]


def test_epoch_outputs_number_their_shards_from_zero(out):
    manifest = _manifest(out)
    manifest["epoch"] = {"index": 1, "of": 2, "seed": 5}  # an epoch's folder lists data/train-00000 first
    assert manifest_problems(out, manifest) == []


def test_read_manifest_raises_one_line_naming_the_file_and_the_field(out):
    manifest = _manifest(out)
    manifest["shards"][1]["rows"] = "2"
    _save(out, manifest)
    with pytest.raises(PackctlError) as err:
        read_manifest(out)
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    assert message.startswith(f"{out / '_manifest.json'}: shards[1].rows is \"2\", an integer >= 0")
    assert message.endswith("pack again (docs/format.md says what it holds)")


@pytest.mark.parametrize("text, said", [("{", "not readable JSON"), ("[1, 2]", "not a JSON object"),
                                        ('{"format_version": "2"}', 'format_version "2"'),
                                        ('{"format_version": true}', "format_version true")])
def test_what_is_no_manifest_at_all(out, text, said):
    (out / "_manifest.json").write_text(text)
    with pytest.raises(PackctlError, match=said):
        read_manifest(out)


def test_problem_lines_say_what_to_do(out):
    line = ManifestProblem("manifest-paths", "shards[0].path", '"../x.parquet" leads out of OUT (..)').line("m.json")
    assert line == ('m.json: shards[0].path "../x.parquet" leads out of OUT (..); packctl reads only the files inside '
                    "OUT that pack wrote: pack again")


# ---- check_shard_bytes -------------------------------------------------------------------------------


def _entry(out: Path, k: int = 0) -> dict:
    return _manifest(out)["shards"][k]


def test_good_bytes_parse_into_the_columns_asked_for(out):
    data = (out / "data/train-00000.parquet").read_bytes()
    checked = check_shard_bytes(data, _entry(out), _manifest(out), ["input_ids"])
    assert checked.findings == [] and checked.table.column_names == ["input_ids"]
    assert checked.table.column("input_ids").to_pylist() == [[0] * 4, [1] * 4]


def test_changed_bytes_are_found(out):
    manifest, entry = _manifest(out), _entry(out)
    data = bytearray((out / "data/train-00000.parquet").read_bytes())
    data[len(data) // 2] ^= 0x10
    checked = check_shard_bytes(bytes(data), entry, manifest)
    assert checked.findings[0].rule == "checksum"
    assert "sha256 differs from the manifest's" in checked.findings[0].message

    truncated = bytes(data[: len(data) // 2])
    rules = [f.rule for f in check_shard_bytes(truncated, entry, manifest).findings]
    assert rules == ["checksum", "readable"]


def test_rows_tokens_and_layout_are_compared(out, tmp_path):
    manifest, entry = _manifest(out), _entry(out)
    data = (out / "data/train-00000.parquet").read_bytes()
    findings = check_shard_bytes(data, dict(entry, rows=3, tokens=9), manifest).findings
    assert [(f.rule, f.message) for f in findings] == [
        ("manifest-shard", "2 packs, the manifest says 3"),
        ("manifest-shard", "8 tokens (sum of num_tokens), the manifest says 9")]

    other = tmp_path / "other.parquet"  # the same packs from a packing of another capacity
    pq.write_table(_table(0, 2, layout=dict(LAYOUT, capacity=8)), other)
    findings = check_shard_bytes(other.read_bytes(), dict(entry, sha256=sha256_file(other)), manifest).findings
    assert [f.rule for f in findings] == ["metadata"] and "another packing" in findings[0].message

    pq.write_table(_table(0, 2).replace_schema_metadata(None), other)
    findings = check_shard_bytes(other.read_bytes(), dict(entry, sha256=sha256_file(other)), manifest).findings
    assert [f.message for f in findings] == ["no 'packctl' key in the Parquet metadata"]


def test_a_column_asked_for_that_is_not_there_is_a_finding(out):
    data = (out / "data/train-00000.parquet").read_bytes()
    checked = check_shard_bytes(data, _entry(out), _manifest(out), ["input_ids", "step"])
    assert checked.table is None and [f.rule for f in checked.findings] == ["schema"]


# ---- open_output, read_shard -------------------------------------------------------------------------


def test_read_shard_checks_what_it_returns(out):
    output = open_output(out)
    assert [output.read_shard(k, ["sample_ids"]).column(0).to_pylist() for k in range(3)] == [
        [[0], [1]], [[2], [3]], [[4], [5]]]
    table = _table(2, 2).set_column(0, "input_ids", pa.array([[9] * 4, [3] * 4], pa.list_(pa.int32())))
    pq.write_table(table, out / "data/train-00001.parquet")  # parseable, not the bytes packed
    with pytest.raises(PackctlError) as err:
        output.read_shard(1)
    assert str(err.value) == (
        f"{out / 'data/train-00001.parquet'}: sha256 differs from the manifest's: the shard was changed or damaged "
        "after packctl pack wrote it (checked against _manifest.json); pack again, or pass verify=False "
        "(--no-verify-checksums) to read it unchecked")
    unchecked = open_output(out, verify=False)
    assert unchecked.read_shard(1, ["input_ids"]).column(0).to_pylist()[0] == [9] * 4


def test_unchecked_reads_still_compare_the_row_count(out):
    pq.write_table(_table(2, 3), out / "data/train-00001.parquet")  # a pack more than the manifest lists
    with pytest.raises(PackctlError, match=r"train-00001.parquet: 3 packs, _manifest.json says 2; pack again"):
        open_output(out, verify=False).read_shard(1)


def test_a_missing_shard_and_a_link_made_after_opening(out, tmp_path):
    output = open_output(out)
    (out / "data/train-00002.parquet").rename(tmp_path / "moved.parquet")
    with pytest.raises(PackctlError, match=r"train-00002.parquet: listed in .*_manifest.json but missing"):
        output.read_shard(2)
    (out / "data/train-00002.parquet").symlink_to(tmp_path / "moved.parquet")
    for verify in (True, False):
        output.verify = verify
        with pytest.raises(PackctlError, match="train-00002.parquet: leads out of .* through a symbolic link"):
            output.read_shard(2)


def test_an_unlisted_parquet_file_in_out_is_refused_unless_unchecked(out):
    (out / "data/train-00003.parquet").write_bytes((out / "data/train-00000.parquet").read_bytes())
    with pytest.raises(PackctlError) as err:
        open_output(out)
    assert str(err.value).startswith(f"{out / 'data/train-00003.parquet'}: a Parquet file that _manifest.json does "
                                     "not list")
    assert len(open_output(out, verify=False).shards) == 3


def test_an_unreadable_metrics_report_is_none(out):
    output = open_output(out)
    assert output.recorded_metrics() is None
    (out / "_metrics.json").write_text("[1]")
    assert output.recorded_metrics() is None
    (out / "_metrics.json").write_text('{"packs": 6}')
    assert output.recorded_metrics() == {"packs": 6}


# ---- _epochs.json -----------------------------------------------------------------------------------


def _epochs(tmp_path: Path, index: dict | str) -> Path:
    root = tmp_path / "epochs"
    for e in range(2):
        _write_output(root / f"epoch-{e:05d}")
    (root / "_epochs.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return root


GOOD_EPOCHS = {"format_version": 2, "epochs": 2, "seed": 0,
               "outputs": [{"path": "epoch-00000", "epoch": 0}, {"path": "epoch-00001", "epoch": 1}]}


def test_epoch_outputs_are_validated(tmp_path):
    root = _epochs(tmp_path, GOOD_EPOCHS)
    assert epoch_outputs(root) == [root / "epoch-00000", root / "epoch-00001"]
    assert open_output(root, epoch=1).read_shard(0).num_rows == 2
    cases = {
        "not json": ("{", "not readable JSON"),
        "a list": ("[2]", "not a JSON object"),
        "epochs a string": (dict(GOOD_EPOCHS, epochs="2"), 'epochs is "2", an integer >= 1'),
        "outputs short": (dict(GOOD_EPOCHS, outputs=GOOD_EPOCHS["outputs"][:1]), "outputs is"),
        "outputs outside": (dict(GOOD_EPOCHS, outputs=[{"path": "../elsewhere"}, GOOD_EPOCHS["outputs"][1]]),
                            'outputs[0].path is "../elsewhere", where pack writes epoch 0 to \'epoch-00000\''),
    }
    for name, (index, said) in cases.items():
        (root / "_epochs.json").write_text(index if isinstance(index, str) else json.dumps(index))
        with pytest.raises(PackctlError, match=said.replace("[", r"\[").replace("]", r"\]")) as err:
            open_output(root, epoch=0)
        assert str(err.value).startswith(f"{root / '_epochs.json'}: "), name


def test_an_epoch_folder_linked_elsewhere_is_refused(tmp_path):
    root = _epochs(tmp_path, GOOD_EPOCHS)
    (root / "epoch-00001").rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "epoch-00001")
    with pytest.raises(PackctlError, match=r"outputs\[1\].path 'epoch-00001' leads out of OUT through a symbolic"):
        epoch_outputs(root)

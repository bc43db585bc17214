"""Bad input: exit code 2, one line naming file/row/column and the fix, nothing written to OUT.

Each test is one entry of docs/errors.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from support.adversary import packctl
from support.data import write_table
from support.paths import FAULTY_PACK

GOOD = {"input_ids": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32()))}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`packctl ARGS...` in this process (packctl.cli.app.run): the messages and exit codes of the
    executable, without an interpreter start per case (tests/cli/test_cli.py runs the executable)."""
    result = packctl(*args)
    return subprocess.CompletedProcess(["packctl", *args], result.code, result.stdout, result.stderr)


def expect_bad_input(tmp_path, args, *fragments):
    out = tmp_path / "out"
    proc = run_cli("pack", *[str(a) for a in args], "-o", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert "Traceback" not in proc.stderr
    text = " ".join(proc.stderr.split())
    for fragment in fragments:
        assert fragment in text, proc.stderr
    assert not out.exists()
    assert not list(tmp_path.glob(".out.packctl-*"))  # no partial directory, no lock left behind
    return lines


def test_missing_tokens_column(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"tokens": GOOD["input_ids"]})
    lines = expect_bad_input(tmp_path, [f], "a.parquet: no column 'input_ids'", "--tokens-column")
    assert len(lines) == 1


@pytest.mark.parametrize("values, typename", [
    (pa.array([["a", "b"], ["c"]]), "list<string>"),
    (pa.array([[1.5, 2.0], [3.0]]), "list<double>"),
    (pa.array([[[1, 2]], [[3]]]), "list<list<int64>>"),
    (pa.array(["abc", "d"]), "string"),
])
def test_tokens_not_a_list_of_integers(tmp_path, values, typename):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": values})
    expect_bad_input(tmp_path, [f], f"column 'input_ids' is {typename}", "list of integers")


def test_no_input_files(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_bad_input(tmp_path, [tmp_path / "empty"], "holds no *.parquet file")
    expect_bad_input(tmp_path, [tmp_path / "nothing-*.parquet"], "matches no file")
    expect_bad_input(tmp_path, [tmp_path / "missing.parquet"], "no such file or directory")


def test_input_without_rows(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [f], "holds no rows")


def test_no_input_given(tmp_path):
    expect_bad_input(tmp_path, [], "no INPUT given")


def test_over_long_with_error_policy(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1] * 10, [2] * 40], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [f, "--capacity", 32], "a.parquet row 1 column 'input_ids': sequence of 40 tokens",
                     "--too-long drop|truncate|split")


def test_null_row_and_null_token(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [f], "a.parquet row 1 column 'input_ids': null instead of a list")
    g = write_table(tmp_path / "in2/b.parquet", {"input_ids": pa.array([[1, 2], [3, None, 4]], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [g], "b.parquet row 1 column 'input_ids': null value at position 1")


def test_empty_sequence(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2], [], [3]], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [f], "a.parquet row 1 column 'input_ids': empty sequence")


@pytest.mark.parametrize("value", [-1, 2**31, 2**40])
def test_token_out_of_int32(tmp_path, value):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2], [3, 4, value]], pa.list_(pa.int64()))})
    expect_bad_input(tmp_path, [f], f"a.parquet row 1 column 'input_ids': value {value} at position 2 is outside")


def test_ragged_labels(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {
        "input_ids": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32())),
        "labels": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [f], "a.parquet row 1 column 'labels': 3 labels for 2 tokens")


def test_mixed_label_schemas(tmp_path):
    write_table(tmp_path / "in/a.parquet", {**GOOD, "labels": GOOD["input_ids"]})
    write_table(tmp_path / "in/b.parquet", GOOD)
    expect_bad_input(tmp_path, [tmp_path / "in"], "b.parquet: has no 'labels' column but")


def test_corrupt_parquet(tmp_path):
    f = tmp_path / "in/a.parquet"
    f.parent.mkdir()
    f.write_bytes(b"PAR1 this is not parquet")
    expect_bad_input(tmp_path, [f], "a.parquet: not a readable Parquet file")


def test_truncated_parquet(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    expect_bad_input(tmp_path, [f], "a.parquet: not a readable Parquet file")


def test_duplicate_input(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    expect_bad_input(tmp_path, [f, tmp_path / "in"], "given twice")


def test_capacity_not_multiple_of_alignment(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    expect_bad_input(tmp_path, [f, "--capacity", 100, "--cp-size", 2, "--tp-size", 4],
                     "--capacity 100 is not a multiple of the alignment 8", "use --capacity 96 or 104")
    expect_bad_input(tmp_path, [f, "--capacity", 4, "--cp-size", 4], "smaller than the alignment 8")


def test_bad_option_values(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    expect_bad_input(tmp_path, [f, "--max-seqs-per-bin", 0], "--max-seqs-per-bin 0: must be a whole number >= 1")
    expect_bad_input(tmp_path, [f, "--algorithm", "magic"], "--algorithm 'magic': choose one of concat, ffd")


def test_config_file_errors(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    bad = tmp_path / "bad.toml"
    bad.write_text("capacity = [")
    expect_bad_input(tmp_path, [f, "--config", bad], "bad.toml: not valid TOML")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("capacity = 64\ncapacty = 32\n")
    expect_bad_input(tmp_path, [f, "--config", unknown], "unknown key 'capacty'")


def test_output_exists(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    (tmp_path / "out").mkdir()
    proc = run_cli("pack", str(f), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2 and "already exists; pass --overwrite" in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_output_equal_to_input(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    proc = run_cli("pack", str(f), "-o", str(f), "--overwrite")
    assert proc.returncode == 2 and "would replace the input" in proc.stderr
    assert f.is_file()


def test_unknown_option_is_a_usage_error(tmp_path):
    proc = run_cli("pack", "x", "-o", str(tmp_path / "out"), "--no-such-flag")
    assert proc.returncode == 2 and "No such option" in proc.stderr


def test_labels_of_the_wrong_type(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {**GOOD, "labels": pa.array([["a", "b", "c"], ["d", "e"]])})
    expect_bad_input(tmp_path, [f], "a.parquet: column 'labels' is list<string>; labels must be a list of integers")
    g = write_table(tmp_path / "in2/b.parquet", {**GOOD, "lab": pa.array([1.5, 2.5])})
    expect_bad_input(tmp_path, [g, "--labels-column", "lab"], "b.parquet: column 'lab' is double")


def test_label_values_out_of_range(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {**GOOD, "labels": pa.array([[1, 2, 3], [4, -7]], pa.list_(pa.int64()))})
    expect_bad_input(tmp_path, [f], "a.parquet row 1 column 'labels': value -7 at position 1 is outside",
                     "or -100")


def test_mixed_token_types_across_files(tmp_path):
    write_table(tmp_path / "in/a.parquet", GOOD)
    write_table(tmp_path / "in/b.parquet", {"input_ids": pa.array([["x"], ["y", "z"]])})
    expect_bad_input(tmp_path, [tmp_path / "in"], "b.parquet: column 'input_ids' is list<string>")


def test_mixed_integer_types_across_files_are_fine(tmp_path):
    write_table(tmp_path / "in/a.parquet", GOOD)
    write_table(tmp_path / "in/b.parquet", {"input_ids": pa.array([[7, 8]], pa.list_(pa.uint16()))})
    proc = run_cli("pack", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--capacity", "8", "-q")
    assert proc.returncode == 0, proc.stderr


def test_tokens_missing_in_one_file_only(tmp_path):
    write_table(tmp_path / "in/a.parquet", GOOD)
    write_table(tmp_path / "in/b.parquet", {"ids": GOOD["input_ids"]})
    expect_bad_input(tmp_path, [tmp_path / "in"], "b.parquet: no column 'input_ids' (columns: ids)")


def test_not_parquet_at_all(tmp_path):
    f = tmp_path / "in/a.parquet"
    f.parent.mkdir()
    f.write_text("input_ids\n1 2 3\n")
    expect_bad_input(tmp_path, [f], "a.parquet: not a readable Parquet file")


def test_empty_sequences_skipped_when_asked(tmp_path, contract):
    from support.contract import check_contract

    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2], [], [3], []], pa.list_(pa.int32()))})
    out = tmp_path / "out"
    proc = run_cli("pack", str(f), "-o", str(out), "--capacity", "4", "--skip-empty", "-q")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads((out / "_manifest.json").read_text())["counts"]
    assert counts["sequences_skipped_empty"] == 2
    assert counts["sequences_dropped"] == 2 and counts["sequences_packed"] == 2
    assert check_contract(contract, out, [f]) == []


def test_every_sequence_left_out(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[], []], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [f, "--skip-empty"], "nothing to pack: of 2 sequences", "2 are empty")
    g = write_table(tmp_path / "in2/b.parquet", {"input_ids": pa.array([[1] * 9], pa.list_(pa.int32()))})
    expect_bad_input(tmp_path, [g, "--capacity", 8, "--too-long", "drop"], "nothing to pack", "1 are longer than")


def test_tokens_equal_to_pad_id_are_allowed_and_counted(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[0, 5, 0], [5]], pa.list_(pa.int32()))})
    out = tmp_path / "out"
    proc = run_cli("pack", str(f), "-o", str(out), "--capacity", "4")
    assert proc.returncode == 0, proc.stderr
    assert "note: 2 input tokens equal --pad-token-id 0" in " ".join(proc.stderr.split())
    assert json.loads((out / "_metrics.json").read_text())["throughput"]["tokens_equal_to_pad_id"] == 2


def test_output_inside_an_input_directory(tmp_path):
    write_table(tmp_path / "in/a.parquet", GOOD)
    out = tmp_path / "in" / "packed"
    proc = run_cli("pack", str(tmp_path / "in"), "-o", str(out))
    assert proc.returncode == 2 and "inside the input directory" in proc.stderr, proc.stderr
    assert not out.exists() and not list((tmp_path / "in").glob(".packed.packctl-*"))


def test_output_under_a_regular_file(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    (tmp_path / "file.txt").write_text("x")
    proc = run_cli("pack", str(f), "-o", str(tmp_path / "file.txt" / "out"))
    assert proc.returncode == 2 and "is not a directory; choose another -o" in proc.stderr, proc.stderr
    assert (tmp_path / "file.txt").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; "
                                              "test_output_under_a_regular_file covers an unwritable OUT")
def test_output_in_a_read_only_directory(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        proc = run_cli("pack", str(f), "-o", str(ro / "out"))
    finally:
        ro.chmod(0o700)
    assert proc.returncode == 2 and "no write permission" in proc.stderr, proc.stderr
    assert not (ro / "out").exists()


def test_disk_full_while_writing(tmp_path):
    f = write_table(tmp_path / "in/a.parquet", {"input_ids": pa.array([[1, 2, 3]] * 20, pa.list_(pa.int32()))})
    out = tmp_path / "out"
    faulty = FAULTY_PACK
    proc = subprocess.run([sys.executable, str(faulty), "--fail-write-after", "0", "pack", str(f), "-o", str(out),
                           "--capacity", "4", "--shard-rows", "5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "train-0000" in proc.stderr and "write failed (No space left on device, on the filesystem mounted at" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.packctl-*"))


@pytest.mark.parametrize("value", ["seed = 'x'", "skip-empty = 3", "inputs = 7", "tokens-column = 5"])
def test_config_values_of_the_wrong_type(tmp_path, value):
    f = write_table(tmp_path / "in/a.parquet", GOOD)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(value + "\n")
    key = value.split(" ")[0]
    inputs = [] if key == "inputs" else [f]  # INPUT on the command line would win over the file's
    lines = expect_bad_input(tmp_path, [*inputs, "--config", cfg], key)
    assert len(lines) == 1

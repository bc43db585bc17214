"""`packctl tokenize` end to end: raw records of every format -> tokenized Parquet -> pack -> verify,
the same bytes for any number of workers, a kill at every step then --resume, and bad input named
by file, row and field."""
from __future__ import annotations

import gzip
import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl.output.commit import COMMIT_STEPS, OPEN_STEPS, SHARD_STEPS
from packctl.output.outdir import Faults
from support.adversary import assert_clean_error, assert_complete, assert_every_sample_once, leftovers, packctl
from support.faulty_pack import run_forked
from support.tokenizers import CHATML, tokenizer_dir

RECORDS = 60


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("tok") / "chatml", template=CHATML)


def _chat(i: int) -> list[dict]:
    turns = [{"role": "user", "content": f"question {i}: what is {i} plus {i}?"},
             {"role": "assistant", "content": f"It is {2 * i}."}]
    if i % 3 == 0:
        turns += [{"role": "user", "content": "and twice that?"}, {"role": "assistant", "content": f"{4 * i}"}]
    return turns


def _write_jsonl(path: Path, records: list[dict], *, blank_every: int = 0) -> Path:
    lines = []
    for k, r in enumerate(records):
        lines.append(json.dumps(r))
        if blank_every and k % blank_every == 0:
            lines.append("")  # blank lines are not records
    data = ("\n".join(lines) + "\n").encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif path.name.endswith(".zst"):
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as stream:
            stream.write(data)
        data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return path


def _corpus(kind: str, folder: Path) -> tuple[list[Path], list[str]]:
    """Input files of one format, and the extra options of pack."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "messages":
        files = [_write_jsonl(folder / "a.jsonl.gz", [{"messages": _chat(i)} for i in range(RECORDS // 2)]),
                 _write_jsonl(folder / "b.jsonl", [{"messages": _chat(i)} for i in range(RECORDS // 2, RECORDS)],
                              blank_every=7)]
        return files, []
    if kind == "text":
        (folder / "book.txt").write_text("".join(f"line {i} of a book about packing\n\n" for i in range(RECORDS)))
        _write_jsonl(folder / "web.jsonl.zst", [{"text": f"web page {i}", "url": f"u{i}"} for i in range(RECORDS)])
        return [folder / "book.txt", folder / "web.jsonl.zst"], []
    if kind == "prompt-completion":
        table = pa.table({"prompt": [f"{i} + {i} =" for i in range(RECORDS)],
                          "completion": [f" {2 * i}" for i in range(RECORDS)]})
        pq.write_table(table, folder / "train.parquet", row_group_size=16)
        return [folder / "train.parquet"], []
    if kind == "preference":
        records = [{"prompt": [{"role": "user", "content": f"is {i} even?"}],
                    "chosen": [{"role": "assistant", "content": "yes" if i % 2 == 0 else "no"}],
                    "rejected": [{"role": "assistant", "content": "no" if i % 2 == 0 else "yes"}]}
                   for i in range(RECORDS)]
        (folder / "pairs.json").write_text(json.dumps(records))
        return [folder / "pairs.json"], ["--group-column", "record_id"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["messages", "text", "prompt-completion", "preference"])
def test_every_format_tokenizes_packs_and_verifies(tmp_path, tok, kind):
    files, pack_options = _corpus(kind, tmp_path / "raw")
    out = tmp_path / "tok"
    result = packctl("tokenize", tmp_path / "raw", "-o", out, "--tokenizer", tok, "--shard-records", "25",
                     "--workers", "1", "--json")
    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert_complete(out)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["kind"] == "tokenized"
    assert manifest["tokenizer"]["fingerprint"] and manifest["tokenize"]["format"] == kind
    records = sum(e["records"] for e in manifest["inputs"])
    assert summary["counts"]["records"] == records == (2 * RECORDS if kind == "text" else RECORDS)
    table = pq.read_table(out / "data")
    rows_per_record = 2 if kind == "preference" else 1
    assert table.num_rows == summary["counts"]["rows"] == rows_per_record * records
    # every record once, in input order; a preference record as two adjacent rows, chosen first
    assert table.column("record_id").to_pylist() == [r for r in range(records) for _ in range(rows_per_record)]
    if kind == "preference":
        assert table.column("chosen").to_pylist() == [True, False] * records
    labels = table.column("labels").to_pylist()
    ids = table.column("input_ids").to_pylist()
    for row_ids, row_labels in zip(ids, labels):
        trained = [label for label in row_labels if label != -100]
        assert trained, "a row with no loss token"
        assert all(label in (-100, t) for label, t in zip(row_labels, row_ids))
    if kind in ("prompt-completion", "preference"):
        prompt = table.column("prompt_length").to_pylist()
        assert all(all(label == -100 for label in row[:p]) and row[p] != -100 for row, p in zip(labels, prompt))

    packed = tmp_path / "packed"
    assert packctl("pack", out, "-o", packed, "--capacity", "256", "--too-long", "split", "-q",
                   *pack_options).code == 0
    assert_every_sample_once(packed, [out])
    recorded = json.loads((packed / "_manifest.json").read_text())["tokenization"]
    assert recorded == [{"source": str(out), "tokenizer": manifest["tokenizer"], "tokenize": manifest["tokenize"]}]
    assert recorded[0]["tokenizer"]["template_hash"] and recorded[0]["tokenize"]["loss_on"] == {
        "messages": "assistant", "text": "all"}.get(kind, "completion")
    verified = packctl("verify", packed, "--source", out, "--no-attention")
    assert verified.code == 0, verified.stdout + verified.stderr


def test_workers_and_shard_boundaries_give_the_same_rows(tmp_path, tok):
    _corpus("messages", tmp_path / "raw")
    one, two = tmp_path / "one", tmp_path / "two"
    assert packctl("tokenize", tmp_path / "raw", "-o", one, "--tokenizer", tok, "--shard-records", "7",
                   "--workers", "1", "-q").code == 0
    assert packctl("tokenize", tmp_path / "raw", "-o", two, "--tokenizer", tok, "--shard-records", "7",
                   "--workers", "2", "-q").code == 0
    names = sorted(p.name for p in (one / "data").iterdir())
    assert names == sorted(p.name for p in (two / "data").iterdir()) and len(names) == 10  # 30 + 30 records by 7
    for name in names:
        assert (one / "data" / name).read_bytes() == (two / "data" / name).read_bytes()
    other = tmp_path / "other"
    assert packctl("tokenize", tmp_path / "raw", "-o", other, "--tokenizer", tok, "--shard-records", "1000",
                   "-q").code == 0
    for column in ("input_ids", "labels", "record_id"):
        assert pq.read_table(one / "data").column(column) == pq.read_table(other / "data").column(column)


@pytest.mark.parametrize("step", OPEN_STEPS + SHARD_STEPS + COMMIT_STEPS)
def test_a_kill_at_every_step_then_resume_gives_the_bytes_of_an_uninterrupted_run(tmp_path, tok, step):
    _corpus("messages", tmp_path / "raw")
    argv = ["tokenize", str(tmp_path / "raw"), "--tokenizer", str(tok), "--shard-records", "10", "--workers", "1",
            "-q"]
    reference = tmp_path / "reference"
    assert packctl(*argv, "-o", reference).code == 0
    out = tmp_path / "out"
    code, _, err = run_forked([*argv, "-o", str(out)], Faults(kill_at=step, kill_count=2 if "shard" in step else 1))
    assert code == -signal.SIGKILL, f"not killed at {step} (exit {code}): {err}"
    resumed = packctl(*argv, "-o", out, "--resume")
    assert resumed.code == 0, resumed.stderr
    assert_complete(out)
    assert _snapshot(out) == _snapshot(reference)


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted((out / "data").iterdir())}


def test_resume_of_a_complete_output_changes_nothing_and_a_changed_input_is_refused(tmp_path, tok):
    files, _ = _corpus("messages", tmp_path / "raw")
    out = tmp_path / "out"
    argv = ["tokenize", tmp_path / "raw", "-o", out, "--tokenizer", tok, "-q"]
    assert packctl(*argv).code == 0
    before = _snapshot(out)
    again = packctl(*argv, "--resume")
    assert again.code == 0 and "already complete" in again.stderr
    assert _snapshot(out) == before
    data = files[1].read_bytes()
    files[1].write_bytes(data.replace(b"question", b"Question", 1))
    line = assert_clean_error(packctl(*argv, "--resume", "-q"), 2, str(out))
    assert "differs" in line or "changed" in line
    assert _snapshot(out) == before


def test_bad_records_are_named_by_file_row_line_and_field(tmp_path, tok):
    raw = tmp_path / "raw"
    raw.mkdir()
    path = raw / "chat.jsonl"
    path.write_text(json.dumps({"messages": _chat(0)}) + "\n\n" + json.dumps({"messages": "not a list"}) + "\n")
    line = assert_clean_error(packctl("tokenize", raw, "-o", tmp_path / "out", "--tokenizer", tok, "-q"), 2,
                              f"{path} row 1 (line 3)", "'messages'", "--on-bad-row drop")
    assert "list of messages" in line
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []

    path.write_text(json.dumps({"messages": _chat(0)}) + "\n{not json\n")
    assert_clean_error(packctl("tokenize", raw, "-o", tmp_path / "out", "--tokenizer", tok, "-q"), 2,
                       f"{path} row 1 (line 2)", "not a JSON object")


def test_drop_counts_every_dropped_record_by_reason(tmp_path, tok):
    raw = tmp_path / "raw"
    raw.mkdir()
    records = [{"messages": _chat(i)} for i in range(10)]
    records[3] = {"messages": None}
    records[7] = {"messages": [{"role": "user", "content": "no answer"}]}  # nothing to train on
    _write_jsonl(raw / "chat.jsonl", records)
    result = packctl("tokenize", raw, "-o", tmp_path / "out", "--tokenizer", tok, "--on-bad-row", "drop", "--json")
    assert result.code == 0, result.stderr
    counts = json.loads(result.stdout)["counts"]
    assert counts["records"] == 10 and counts["rows"] == 8 and counts["dropped"] == 2
    assert sum(counts["dropped_by_reason"].values()) == 2
    assert [e["record_id"] for e in counts["dropped_examples"]] == [3, 7]
    kept = pq.read_table(tmp_path / "out" / "data").column("record_id").to_pylist()
    assert kept == [0, 1, 2, 4, 5, 6, 8, 9]


def test_a_hub_name_is_refused_without_a_network_call(tmp_path):
    _corpus("messages", tmp_path / "raw")
    assert_clean_error(packctl("tokenize", tmp_path / "raw", "-o", tmp_path / "out", "--tokenizer",
                               "Qwen/Qwen3-8B", "-q"), 2, "Qwen/Qwen3-8B", "never downloads")


def test_options_are_checked_in_one_line(tmp_path, tok):
    _corpus("messages", tmp_path / "raw")
    base = ["tokenize", tmp_path / "raw", "-o", tmp_path / "out", "--tokenizer", tok, "-q"]
    assert_clean_error(packctl(*base, "--format", "chat"), 2, "--format", "messages")
    assert_clean_error(packctl(*base, "--loss-on", "completion"), 2, "--loss-on completion", "messages")
    assert_clean_error(packctl(*base, "--format", "preference"), 2, "chosen")
    assert_clean_error(packctl(*base, "--shard-records", "0"), 2, "--shard-records")


def test_a_packctl_output_inside_input_is_not_read_as_raw_input(tmp_path, tok):
    _corpus("messages", tmp_path / "raw")
    assert_clean_error(packctl("tokenize", tmp_path / "raw", "-o", tmp_path / "raw" / "tok", "--tokenizer", tok,
                               "-q"), 2, "inside")
    assert packctl("tokenize", tmp_path / "raw", "-o", tmp_path / "tok", "--tokenizer", tok, "-q").code == 0
    (tmp_path / "tok").rename(tmp_path / "raw" / "tok")  # moved there afterwards
    assert_clean_error(packctl("tokenize", tmp_path / "raw", "-o", tmp_path / "again", "--tokenizer", tok, "-q"), 2,
                       str(tmp_path / "raw" / "tok"), "never read")


def test_group_column_is_carried_for_grpo_rollouts(tmp_path, tok):
    raw = tmp_path / "raw"
    raw.mkdir()
    records = [{"prompt": f"task {g}", "completion": f" try {k}", "prompt_id": f"p{g}"}
               for g in range(6) for k in range(4)]
    _write_jsonl(raw / "rollouts.jsonl", records)
    out = tmp_path / "tok"
    assert packctl("tokenize", raw, "-o", out, "--tokenizer", tok, "--group-column", "prompt_id", "-q").code == 0
    assert pq.read_table(out / "data").column("prompt_id").to_pylist() == [r["prompt_id"] for r in records]
    packed = tmp_path / "packed"
    assert packctl("pack", out, "-o", packed, "--capacity", "128", "--group-column", "prompt_id", "-q").code == 0
    table = pq.read_table(packed / "data", columns=["sample_ids"])
    pack_of = {int(s): k for k, ids in enumerate(table.column("sample_ids").to_pylist()) for s in ids}
    for g in range(6):
        assert len({pack_of[4 * g + k] for k in range(4)}) == 1  # a group's rollouts share one pack
    assert np.array_equal(sorted(pack_of), np.arange(24))


def test_a_tokenize_worker_loads_neither_pandas_nor_the_stages_of_pack(tmp_path, tok):
    """A worker process imports packctl.tokenize.run and tokenizes its shards: pandas (imported by
    pa.array to inspect a numpy array) and packctl.pipeline (pack's stages, numba) would cost it
    0.25 s and 0.3 s at start-up, and it needs neither. A preference shard writes every column."""
    records = [{"prompt": [{"role": "user", "content": f"q{i}"}], "chosen": [{"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "assistant", "content": "no"}]} for i in range(4)]
    path = _write_jsonl(tmp_path / "pref.jsonl", records)
    code = f"""
import sys
from packctl.tokenize.options import build_spec
from packctl.tokenize.rawfiles import index_file
from packctl.tokenize.run import TokenizeConfig, Unit, tokenize_unit
from packctl.tokenize.tokenizer import LocalTokenizer
config = TokenizeConfig(inputs=[{str(path)!r}], output="unused", tokenizer={str(tok)!r})
raw = index_file({str(path)!r}, stride=config.shard_records)
shard = tokenize_unit(Unit(0, 0, 0, raw.records, 0), raw, build_spec(config, [raw]), LocalTokenizer.load(config.tokenizer), config, {{}})
loaded = sorted(m for m in ("pandas", "numba", "packctl.pipeline", "pyarrow.compute") if m in sys.modules)
import pyarrow as pa, pyarrow.parquet as pq
table = pq.read_table(pa.BufferReader(shard.data))
assert table["chosen"].to_pylist() == [True, False] * 4, table["chosen"]
print(loaded)
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[]"

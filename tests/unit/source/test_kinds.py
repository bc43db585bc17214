"""The input seam (packctl.source.kinds): which kind reads a path, the JSONL kind's checks, and
the same rows packed from Parquet and from JSONL giving the same data."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, pack
from packctl.errors import PackctlError
from packctl.source import megatron
from packctl.source.kinds import (INPUT_KINDS, JSONL, MEGATRON, PARQUET, RAW, InputOptions, check_options, kind_of,
                                  kind_of_paths)
from packctl.source.kinds import jsonl as jsonl_kind
from packctl.source.resolve import resolve
from packctl.stats.whatif import read_lengths
from support.megatron import write_pair


def jsonl_file(path: Path, records: list, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    return path


def rows_of(path: Path) -> list[list[int]]:
    kind = kind_of(str(path))
    _, blocks, _ = kind.read_file(str(path), 0)
    out = []
    for block in blocks:
        decoded = kind.decode(str(path), block, InputOptions())
        out += [decoded.tokens[a:b].tolist() for a, b in zip(decoded.offsets[:-1], decoded.offsets[1:])]
    return out


def test_each_path_has_one_kind_and_a_run_one_kind():
    assert [kind_of(p) for p in ("a.parquet", "c.idx", "c.bin", "t.jsonl", "t.jsonl.gz")] == [
        PARQUET, MEGATRON, MEGATRON, JSONL, JSONL]
    assert set(INPUT_KINDS) == {RAW, PARQUET, MEGATRON, JSONL}
    tokenizing = InputOptions(tokenizer="tok")  # a tokenizer makes record files raw records, and only them
    assert [kind_of(p, tokenizing) for p in ("a.parquet", "c.idx", "t.jsonl", "t.json", "b.txt", "t.jsonl.zst")] == [
        RAW, MEGATRON, RAW, RAW, RAW, RAW]
    assert kind_of("t.json") is PARQUET  # without one, a name no kind claims is read (and refused) as Parquet
    with pytest.raises(PackctlError, match=r"^a.parquet: a Parquet input beside the JSONL input t.jsonl; one run"):
        kind_of_paths(["t.jsonl", "a.parquet"])


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_blocks_start_at_recorded_byte_offsets(tmp_path, monkeypatch, gz):
    monkeypatch.setattr(jsonl_kind, "BLOCK_LINES", 2)
    records = [{"input_ids": [r] * (r % 3 + 1)} for r in range(5)]
    path = jsonl_file(tmp_path / ("t.jsonl.gz" if gz else "t.jsonl"), records, gz)
    _, blocks, rows = JSONL.read_file(str(path), 0)
    assert rows == 5
    assert [(b.first_row, b.rows) for b in blocks] == ([(0, 5)] if gz else [(0, 2), (2, 2), (4, 1)])
    assert rows_of(path) == [r["input_ids"] for r in records]


@pytest.mark.parametrize("record, message", [
    ({"input_ids": [1, -2]}, r"t.jsonl row 1 column 'input_ids': value -2 at position 1 is outside \[0, 2147483647\]"),
    ({"input_ids": [1, "2"]}, r"t.jsonl row 1 column 'input_ids': \"2\" at position 1 is not an integer"),
    ({"input_ids": [1, True]}, r"t.jsonl row 1 column 'input_ids': true at position 1 is not an integer"),
    ({"input_ids": 7}, r"t.jsonl row 1 column 'input_ids': a JSON int, not a list of token ids"),
    ({"input_ids": None}, r"t.jsonl row 1 column 'input_ids': null instead of a list"),
    ({"input_ids": []}, r"t.jsonl row 1 column 'input_ids': empty sequence; remove empty rows or pass --skip-empty"),
    ({"tokens": [1]}, r"t.jsonl row 1: no 'input_ids' key \(keys: tokens\); pass --tokens-column"),
    ({"messages": [{"role": "user", "content": "hi"}]},
     r"t.jsonl row 1: a record of text \(messages\), not token ids; tokenize it first: packctl tokenize"),
    ({"input_ids": [1, 2], "labels": [1]}, r"t.jsonl row 1 column 'labels': 1 labels for 2 tokens"),
    ({"input_ids": [1], "labels": [-5]}, r"t.jsonl row 1 column 'labels': value -5 at position 0 is outside"),
    ({"input_ids": [1 << 70]}, r"t.jsonl row 1 column 'input_ids': value 1180591620717411303424 at position 0"),
])
def test_a_bad_jsonl_row_is_refused_naming_file_row_and_column(tmp_path, monkeypatch, record, message):
    monkeypatch.chdir(tmp_path)
    labels = "labels" in record  # then the first row has labels too, and they are read
    jsonl_file(tmp_path / "t.jsonl", [{"input_ids": [1], **({"labels": [1]} if labels else {})}, record])
    with pytest.raises(PackctlError, match=message):
        pack(PackConfig(inputs=["t.jsonl"], output="out", capacity=8))


def test_a_line_that_is_not_json_is_refused_naming_the_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"input_ids": [1]}\n{"input_ids": [2\n')
    with pytest.raises(PackctlError, match=r"^t.jsonl row 1: not a JSON object"):
        pack(PackConfig(inputs=["t.jsonl"], output="out", capacity=8))


def data_columns(out: Path) -> dict[str, list]:
    table = pa.concat_tables([pq.read_table(p) for p in sorted((out / "data").glob("*.parquet"))])
    return {c: table.column(c).to_pylist() for c in ("sample_ids", "input_ids", "labels")}


@pytest.mark.parametrize("labels", [False, True])
def test_the_same_rows_as_parquet_and_as_jsonl_pack_to_the_same_data(tmp_path, monkeypatch, labels):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(3)
    records = []
    for r in range(60):
        ids = rng.integers(0, 70000, rng.integers(1, 40)).tolist()
        records.append({"input_ids": ids, **({"labels": [-100] * (len(ids) // 2) + ids[len(ids) // 2:]}
                                              if labels else {})})
    for k in range(2):
        part = records[k * 30:(k + 1) * 30]
        jsonl_file(tmp_path / f"j/part-{k}.jsonl", part)
        (tmp_path / "p").mkdir(exist_ok=True)
        columns = {"input_ids": pa.array([r["input_ids"] for r in part], pa.list_(pa.int32()))}
        if labels:
            columns["labels"] = pa.array([r["labels"] for r in part], pa.list_(pa.int32()))
        pq.write_table(pa.table(columns), tmp_path / f"p/part-{k}.parquet", row_group_size=7)
    options = dict(capacity=64, too_long="split", order="shuffle", seed=5)
    pack(PackConfig(inputs=["p"], output="out-p", **options))
    pack(PackConfig(inputs=["j"], output="out-j", **options))
    assert data_columns(tmp_path / "out-j") == data_columns(tmp_path / "out-p")
    lengths = [len(r["input_ids"]) for r in records]
    assert read_lengths(["j"]).lengths.tolist() == read_lengths(["p"]).lengths.tolist() == lengths


def test_an_over_long_megatron_document_is_refused_before_a_token_is_decoded(tmp_path, monkeypatch):
    """--too-long error refuses from the .idx lengths: a 300M-token document is never read whole."""
    monkeypatch.chdir(tmp_path)
    write_pair(tmp_path / "data/c", [[[1, 2]], [list(range(1, 40))], [[3]]])

    def no_decode(*args, **kwargs):
        raise AssertionError("a token was decoded")
    monkeypatch.setattr(megatron, "decode_documents", no_decode)
    with pytest.raises(PackctlError, match=r"^data/c.idx document 1: sequence of 39 tokens \(padded to 39\) is "
                                           r"longer than the capacity 16"):
        pack(PackConfig(inputs=["data/c.idx"], output="out", capacity=16, too_long="error"))


def test_resolve_takes_jsonl_files_from_a_directory(tmp_path):
    jsonl_file(tmp_path / "d/a.jsonl", [{"input_ids": [1]}])
    jsonl_file(tmp_path / "d/sub/b.jsonl.gz", [{"input_ids": [2]}], gz=True)
    (tmp_path / "d/notes.json").write_text("{}")
    assert [Path(p).name for p in resolve([tmp_path / "d"]).paths] == ["a.jsonl", "b.jsonl.gz"]


def test_jsonl_verifies_plans_materializes_and_resumes_as_parquet_does(tmp_path, monkeypatch):
    from packctl.output.outdir import Faults
    from packctl.verify import VerifyOptions, verify
    from support.adversary import packctl
    from support.faulty_pack import run_forked
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(7)
    jsonl_file(tmp_path / "j/a.jsonl", [{"input_ids": rng.integers(0, 900, rng.integers(1, 30)).tolist()}
                                        for _ in range(80)])
    options = ["--capacity", "32", "--too-long", "split", "-q", "--shard-rows", "8"]
    assert packctl("pack", "j", "-o", "out", *options).code == 0
    assert verify(tmp_path / "out", VerifyOptions(source=["j"], attention=False)).ok
    assert packctl("pack", "j", "-o", "plan", *options, "--plan-only").code == 0
    assert packctl("materialize", "plan", "-o", "mat", "-q").code == 0
    code, _, err = run_forked(["pack", "j", "-o", "res", *options], Faults(kill_at="shard:journaled", kill_count=2))
    assert code == -9, err
    assert packctl("pack", "j", "-o", "res", *options, "--resume").code == 0
    shards = {d: [p.read_bytes() for p in sorted((tmp_path / d / "data").glob("*.parquet"))] for d in ("out", "mat",
                                                                                                      "res")}
    assert len(shards["out"]) > 2 and shards["mat"] == shards["out"] == shards["res"]


@pytest.mark.parametrize("carried, flag", [
    (dict(keep_columns=["doc"]), "--keep-columns"), (dict(weight_column="w"), "--weight-column"),
    (dict(group_column="g"), "--group-column"), (dict(limits={"images": 4}), "--limit"),
    (dict(share_prefix=True, prefix_column="prompt_length"), "--prefix-column")])
def test_every_carried_column_is_refused_by_a_kind_without_columns(tmp_path, monkeypatch, carried, flag):
    """specs.py `CarriedColumns` declares the carried columns once: a kind that cannot read one
    (JSONL, a Megatron pair) refuses each by its flag in one line, before a token is read."""
    monkeypatch.chdir(tmp_path)
    jsonl_file(tmp_path / "j/a.jsonl", [{"input_ids": [1, 2, 3]}] * 4)
    write_pair(tmp_path / "m/a", [[np.arange(1, 9, dtype=np.int32)]] * 4)
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]] * 4}), tmp_path / "a.parquet")
    config = PackConfig(inputs=["j"], output="out", capacity=16, **carried)
    for inputs, words in ((["j"], "not read from JSONL input"), (["m"], "names a Parquet column")):
        with pytest.raises(PackctlError, match=rf"^{flag}: {words}"):
            check_options(resolve(inputs), carried=config.carried())
    check_options(resolve(["a.parquet"]), carried=config.carried())  # Parquet reads every carried column
    if "prefix_column" not in carried:  # --share-prefix needs a group column: refused for that first
        with pytest.raises(PackctlError, match=rf"^{flag}: not read from JSONL input"):
            pack(config)
        assert not (tmp_path / "out").exists()

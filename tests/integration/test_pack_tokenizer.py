"""`packctl pack --tokenizer DIR`: raw chat records tokenized as they are read give the packs of
`packctl tokenize` then `pack`; stats, verify --source, --resume and plans read them the same way."""
from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from packctl import PackConfig
from packctl.output.commit import SHARD_STEPS
from packctl.output.outdir import Faults
from packctl.source.kinds import raw as raw_kind
from packctl.stats import input_stats
from support.adversary import assert_clean_error, packctl
from support.faulty_pack import run_forked
from support.tokenizers import CHATML, tokenizer_dir

DATA_COLUMNS = ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids")
PACK = ("--capacity", "256", "--too-long", "split", "--shard-rows", "4", "-q")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("tok") / "chatml", template=CHATML)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(raw_kind, "BLOCK_RECORDS", 7)  # several blocks a file, a short last one


def _chat(i: int) -> dict:
    turns = [{"role": "user", "content": f"question {i}: what is {i} plus {i}?"},
             {"role": "assistant", "content": f"It is {2 * i}."}]
    if i % 3 == 0:
        turns += [{"role": "user", "content": "and twice that? " * (i % 7)},
                  {"role": "assistant", "content": f"{4 * i}"}]
    return {"messages": turns}


def _chats(folder: Path, records: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(records // 2)))
    (folder / "b.jsonl").write_text("".join(json.dumps(_chat(i)) + "\n" for i in range(records // 2, records)))
    return folder


def _data(out: Path) -> dict[str, list]:
    table = pq.read_table(out / "data")
    return {column: table.column(column).to_pylist() for column in DATA_COLUMNS}


def _refused(result, pattern: str) -> None:
    """One line on stderr (`assert_clean_error`, exit 2) matching `pattern`."""
    line = assert_clean_error(result)
    assert re.search(pattern, line), line


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "data").iterdir())}


def test_pack_tokenizer_gives_the_packs_of_tokenize_then_pack(tmp_path, tok):
    raw = _chats(tmp_path / "raw")
    assert packctl("tokenize", raw, "-o", tmp_path / "tokenized", "--tokenizer", tok, "-q").code == 0
    assert packctl("pack", tmp_path / "tokenized", "-o", tmp_path / "two-steps", *PACK).code == 0
    result = packctl("pack", raw, "--tokenizer", tok, "-o", tmp_path / "one-step", *PACK)
    assert result.code == 0, result.stderr
    assert _data(tmp_path / "one-step") == _data(tmp_path / "two-steps")
    manifest = json.loads((tmp_path / "one-step" / "_manifest.json").read_text())
    tokenized = json.loads((tmp_path / "tokenized" / "_manifest.json").read_text())
    assert manifest["tokenization"] == [{"source": "pack --tokenizer", "tokenizer": tokenized["tokenizer"],
                                         "tokenize": tokenized["tokenize"]}]
    assert manifest["config"]["tokenizer"] == str(tok) and manifest["config"]["labels_column"] == "labels"


@pytest.mark.parametrize("special", [("--add-eos", "always"), ("--add-bos", "always"), ("--add-eos", "never")])
def test_pack_takes_tokenizes_bos_and_eos_options(tmp_path, tok, special):
    """--add-bos/--add-eos mean in pack what they mean in tokenize, and are recorded: the packs of
    pack --tokenizer with the flag equal tokenize with it then pack, and differ from the default."""
    raw = _chats(tmp_path / "raw", records=14)
    assert packctl("tokenize", raw, "-o", tmp_path / "tokenized", "--tokenizer", tok, *special, "-q").code == 0
    assert packctl("pack", tmp_path / "tokenized", "-o", tmp_path / "two-steps", *PACK).code == 0
    result = packctl("pack", raw, "--tokenizer", tok, *special, "-o", tmp_path / "one-step", *PACK)
    assert result.code == 0, result.stderr
    assert _data(tmp_path / "one-step") == _data(tmp_path / "two-steps")
    manifest = json.loads((tmp_path / "one-step" / "_manifest.json").read_text())
    assert manifest["config"][special[0][2:].replace("-", "_")] == special[1]
    assert manifest["tokenization"][0]["tokenize"][special[0][2:].replace("-", "_")] == special[1]
    if special[1] == "always":  # the chat template writes no EOS/BOS of its own: the flag changes the tokens
        assert packctl("pack", raw, "--tokenizer", tok, "-o", tmp_path / "default", *PACK).code == 0
        assert _data(tmp_path / "default")["input_ids"] != _data(tmp_path / "one-step")["input_ids"]


def test_how_to_tokenize_without_a_tokenizer_is_refused(tmp_path):
    for flag, value in (("--add-eos", "always"), ("--format", "text"), ("--loss-on", "all")):
        _refused(packctl("pack", ROOT / "sample_data", "-o", tmp_path / "out", flag, value),
                 rf"{flag} tells how to tokenize raw records: it needs --tokenizer DIR")


def test_stats_what_if_on_raw_records_is_the_what_if_on_their_tokens(tmp_path, tok):
    raw = _chats(tmp_path / "raw")
    assert packctl("tokenize", raw, "-o", tmp_path / "tokenized", "--tokenizer", tok, "-q").code == 0
    tokenized = input_stats([str(tmp_path / "tokenized")], [128, 256], PackConfig(too_long="split"))
    on_raw = input_stats([str(raw)], [128, 256], PackConfig(too_long="split", tokenizer=str(tok)))
    drop = ("plan_seconds",)  # timings
    for key in ("sequences", "tokens", "what_if", "capacities"):
        strip = (lambda v: [{k: x for k, x in row.items() if k not in drop} for row in v] if isinstance(v, list) else v)
        assert strip(on_raw[key]) == strip(tokenized[key]), key


def test_verify_source_reads_raw_records_with_the_recorded_tokenizer_and_finds_a_tampered_shard(tmp_path, tok):
    raw = _chats(tmp_path / "raw")
    out = tmp_path / "out"
    assert packctl("pack", raw, "--tokenizer", tok, "-o", out, *PACK).code == 0
    checked = packctl("verify", out, "--source", raw, "--no-attention", "--json")
    assert checked.code == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["checks"]["conservation"]["status"] == "ok"
    shard = sorted((out / "data").iterdir())[0]
    table = pq.read_table(shard)
    ids = table.column("input_ids").to_pylist()
    ids[0][1] = (ids[0][1] + 1) % 300  # one token of the first pack changed, the layout intact
    import pyarrow as pa

    table = table.set_column(table.schema.get_field_index("input_ids"), "input_ids",
                             pa.array(ids, type=table.schema.field("input_ids").type))
    pq.write_table(table, shard)
    tampered = packctl("verify", out, "--source", raw, "--no-attention", "--json")
    assert tampered.code == 1
    assert json.loads(tampered.stdout)["checks"]["conservation"]["status"] == "failed"


def test_verify_takes_the_tokenizer_from_its_flag_when_the_recorded_directory_moved(tmp_path, tok):
    raw = _chats(tmp_path / "raw", records=10)
    moved = tmp_path / "moved-tok"
    shutil.copytree(tok, tmp_path / "tok")
    out = tmp_path / "out"
    assert packctl("pack", raw, "--tokenizer", tmp_path / "tok", "-o", out, *PACK).code == 0
    (tmp_path / "tok").rename(moved)
    _refused(packctl("verify", out, "--source", raw, "--no-attention"), rf"{tmp_path / 'tok'}")
    checked = packctl("verify", out, "--source", raw, "--tokenizer", moved, "--no-attention", "--json")
    assert checked.code == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["checks"]["conservation"]["status"] == "ok"


@pytest.mark.parametrize("step", SHARD_STEPS[:2])
def test_a_kill_then_resume_gives_the_bytes_of_an_uninterrupted_run(tmp_path, tok, step):
    raw = _chats(tmp_path / "raw")
    argv = ["pack", str(raw), "--tokenizer", str(tok), *PACK]
    assert packctl(*argv, "-o", tmp_path / "reference").code == 0
    out = tmp_path / "out"
    code, _, err = run_forked([*argv, "-o", str(out)], Faults(kill_at=step, kill_count=2))
    assert code == -signal.SIGKILL, f"not killed at {step} (exit {code}): {err}"
    resumed = packctl(*argv, "-o", out, "--resume")
    assert resumed.code == 0, resumed.stderr
    assert _shards(out) == _shards(tmp_path / "reference")


def test_a_changed_tokenizer_is_refused_by_resume(tmp_path, tok):
    raw = _chats(tmp_path / "raw")
    other = tmp_path / "other-tok"
    shutil.copytree(tok, other)
    out = tmp_path / "out"
    assert packctl("pack", raw, "--tokenizer", other, "-o", out, *PACK).code == 0
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    again = packctl("pack", raw, "--tokenizer", other, "-o", out, *PACK, "--resume")
    assert again.code == 2
    assert "tokenization" in again.stderr


def test_plan_then_materialize_tokenizes_again_and_refuses_a_changed_record_file(tmp_path, tok):
    raw = _chats(tmp_path / "raw")
    plan, out = tmp_path / "plan", tmp_path / "out"
    assert packctl("pack", raw, "--tokenizer", tok, "-o", plan, "--plan-only", *PACK).code == 0
    assert packctl("pack", raw, "--tokenizer", tok, "-o", tmp_path / "direct", *PACK).code == 0
    written = packctl("materialize", plan, "-o", out, "-q")
    assert written.code == 0, written.stderr
    assert _data(out) == _data(tmp_path / "direct")
    text = (raw / "b.jsonl").read_text()
    (raw / "b.jsonl").write_text(text.replace("question 25", "question 52"))  # same size, other record
    refused = packctl("materialize", plan, "-o", tmp_path / "again", "-q")
    _refused(refused, rf"{raw / 'b.jsonl'}: not the source the plan")


@pytest.mark.parametrize("record, message", [
    ({"messages": "hello"}, r"b.jsonl row 3 \(line 4\) field 'messages': "),
    ({"messages": [{"role": "user"}]}, r"b.jsonl row 3 \(line 4\) field 'messages': message 0 has no 'content'"),
    ({"text": "a"}, r"b.jsonl row 3 \(line 4\) field 'messages': is missing or null; fix the row"),
])
def test_a_bad_record_is_refused_in_one_line_naming_file_row_and_field(tmp_path, tok, record, message):
    raw = _chats(tmp_path / "raw", records=20)
    lines = (raw / "b.jsonl").read_text().splitlines()
    lines[3] = json.dumps(record)
    (raw / "b.jsonl").write_text("\n".join(lines) + "\n")
    _refused(packctl("pack", raw, "--tokenizer", tok, "-o", tmp_path / "out", *PACK), message)


def test_preference_records_and_columns_of_parquet_are_refused_naming_the_way(tmp_path, tok):
    raw = tmp_path / "pref.jsonl"
    raw.write_text(json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "5"}) + "\n")
    _refused(packctl("pack", raw, "--tokenizer", tok, "-o", tmp_path / "out", *PACK),
             r"preference records .* run|tokenize them first: packctl tokenize")
    chats = _chats(tmp_path / "raw", records=4)
    _refused(packctl("pack", chats, "--tokenizer", tok, "-o", tmp_path / "o2", "--weight-column", "w", *PACK),
             r"--weight-column: not read from raw records")


def test_the_sample_chat_corpus_packs_with_its_tokenizer_its_directory_walked_without_the_tokenizer(tmp_path):
    sample = tmp_path / "sample_chat"
    shutil.copytree(ROOT / "sample_chat", sample)
    result = packctl("pack", sample, "--tokenizer", sample / "tokenizer", "-o", tmp_path / "out", "--capacity", "2048",
                     "--too-long", "split", "-q")
    assert result.code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [entry["path"] for entry in manifest["inputs"]] == [str(sample / "chat.jsonl")]
    assert manifest["counts"]["sequences_in"] == 167

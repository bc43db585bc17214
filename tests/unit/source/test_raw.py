"""The raw-records kind (packctl.source.kinds.raw): which names it claims, its blocks at the
offsets indexing kept, each block's tokens and labels those `packctl tokenize` writes, and a
fingerprint that changes with the tokenizer's options."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from packctl.errors import PackctlError
from packctl.source.kinds import RAW, InputOptions, options_of
from packctl.source.kinds import raw as raw_kind
from packctl.tokenize.encode import TokenizeSpec, tokenize_records
from packctl.tokenize.formats import Columns, LossOn, RecordFormat
from packctl.tokenize.tokenizer import LocalTokenizer
from support.tokenizers import CHATML, tokenizer_dir


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("tok") / "chatml", template=CHATML)


def _records(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                          {"role": "assistant", "content": f"{2 * i}" + " and more" * (i % 3)}]} for i in range(n)]


def _write(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text, mtime=0) if path.name.endswith(".gz") else text)
    return path


def test_raw_records_are_claimed_only_with_a_tokenizer():
    assert not RAW.claims("chat.jsonl") and not RAW.claims("chat.jsonl", InputOptions())
    assert RAW.claims("chat.jsonl", InputOptions(tokenizer="tok")) and RAW.claims("t.txt", InputOptions(tokenizer="t"))
    assert not RAW.claims("c.idx", InputOptions(tokenizer="tok"))
    assert options_of({"tokenizer": "tok", "loss_on": "all", "messages_column": "conv"}) == InputOptions(
        tokenizer="tok", loss_on="all", columns=Columns(messages="conv"))


@pytest.mark.parametrize("name", ["chat.jsonl", "chat.jsonl.gz"])
def test_blocks_are_runs_of_records_each_tokenized_as_tokenize_does(tmp_path, tok, monkeypatch, name):
    monkeypatch.setattr(raw_kind, "BLOCK_RECORDS", 2)
    records = _records(5)
    path = str(_write(tmp_path / name, records))
    options = InputOptions(tokenizer=str(tok))
    _, blocks, rows = RAW.read_file(path, 0, options=options)
    assert rows == 5
    assert [(b.first_row, b.rows) for b in blocks] == ([(0, 5)] if name.endswith(".gz") else [(0, 2), (2, 2), (4, 1)])
    decoded = [RAW.decode(path, block, options) for block in blocks]
    want = tokenize_records(records, TokenizeSpec(format=RecordFormat.MESSAGES, loss_on=LossOn.ASSISTANT),
                            LocalTokenizer.load(str(tok)))
    assert np.concatenate([d.tokens for d in decoded]).tolist() == want.input_ids.tolist()
    assert np.concatenate([d.labels for d in decoded]).tolist() == want.labels.tolist()
    assert [len(d.offsets) - 1 for d in decoded] == [b.rows for b in blocks]


def test_the_fingerprint_is_of_the_bytes_and_of_the_tokenization(tmp_path, tok):
    path = str(_write(tmp_path / "chat.jsonl", _records(3)))
    assistant = RAW.read_file(path, 0, options=InputOptions(tokenizer=str(tok)))[0]
    everything = RAW.read_file(path, 0, options=InputOptions(tokenizer=str(tok), loss_on="all"))[0]
    assert assistant.size == everything.size and assistant.footer != everything.footer
    with pytest.raises(PackctlError, match=r"chat.jsonl: changed while packctl was reading it"):
        RAW.read_file(path, 0, assistant, options=InputOptions(tokenizer=str(tok), loss_on="all"))

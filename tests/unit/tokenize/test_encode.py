"""tokenize_records: formats and their detection, column names, loss rules, BOS/EOS, bad rows."""
from __future__ import annotations

import json

import numpy as np
import pytest

from packctl.errors import PackctlError
from packctl.tokenize.encode import (
    AddSpecial, OnBadRow, RowError, RowOptionError, TokenizeSpec, implicit_prompt, tokenize_records,
)
from packctl.tokenize.formats import Columns, LossOn, RecordFormat, detect_format, resolve_loss_on
from packctl.tokenize.tokenizer import LocalTokenizer
from support.tokenizers import tokenizer_dir

USER = {"role": "user", "content": "What color is the sky?"}
BLUE = {"role": "assistant", "content": "It is blue."}
GREEN = {"role": "assistant", "content": "It is green."}


def rows(batch):
    """Each row's (ids, labels) as lists."""
    bounds = zip(batch.offsets[:-1], batch.offsets[1:])
    return [(batch.input_ids[a:b].tolist(), batch.labels[a:b].tolist()) for a, b in bounds]


def trained_text(tok, batch, row=0):
    ids, labels = rows(batch)[row]
    return tok.backend.decode([t for t, label in zip(ids, labels) if label != -100], skip_special_tokens=False)


def test_detect_format_in_order_and_refusal():
    assert detect_format(["prompt", "chosen", "rejected", "completion"]) is RecordFormat.PREFERENCE
    assert detect_format(["prompt", "completion", "messages"]) is RecordFormat.PROMPT_COMPLETION
    assert detect_format(["messages", "text"]) is RecordFormat.MESSAGES
    assert detect_format(["text", "id"]) is RecordFormat.TEXT
    assert detect_format(["conv"], Columns(messages="conv")) is RecordFormat.MESSAGES
    with pytest.raises(PackctlError) as err:
        detect_format(["id", "body"])
    assert str(err.value) == (
        "cannot tell the record format from the columns found (body, id); expected preference: chosen + rejected; "
        "prompt-completion: prompt + completion; messages: messages; text: text; name the columns with the "
        "--column-* options or pass --format"
    )


def test_loss_on_defaults_and_refusals():
    assert [resolve_loss_on(f, None) for f in (RecordFormat.TEXT, RecordFormat.MESSAGES,
            RecordFormat.PROMPT_COMPLETION, RecordFormat.PREFERENCE)] == [
        LossOn.ALL, LossOn.ASSISTANT, LossOn.COMPLETION, LossOn.COMPLETION]
    with pytest.raises(PackctlError, match=r"^--loss-on assistant does not apply to the text format; use one of: all$"):
        resolve_loss_on(RecordFormat.TEXT, LossOn.ASSISTANT)
    with pytest.raises(PackctlError, match="--loss-on completion does not apply to the messages format"):
        resolve_loss_on(RecordFormat.MESSAGES, LossOn.COMPLETION)


def test_auto_detects_from_the_records_and_columns_are_overridable(chatml):
    spec = TokenizeSpec(columns=Columns(messages="conversation"))
    batch = tokenize_records([{"conversation": [USER, BLUE], "id": 3}], spec, chatml)
    assert trained_text(chatml, batch) == "It is blue.<|im_end|>"


def test_text_trains_every_token_and_follows_the_tokenizer_for_bos_eos(tmp_path):
    plain = LocalTokenizer.load(str(tokenizer_dir(tmp_path / "a")))
    with_bos = LocalTokenizer.load(str(tokenizer_dir(tmp_path / "b", bos_post_processor=True)))
    assert (plain.adds_bos, plain.adds_eos, with_bos.adds_bos) == (False, False, True)
    spec = TokenizeSpec(format=RecordFormat.TEXT)
    expected = plain.backend.encode("the sky is blue", add_special_tokens=False).ids
    (ids, labels), = rows(tokenize_records([{"text": "the sky is blue"}], spec, plain))
    assert ids == labels == expected
    (ids, labels), = rows(tokenize_records([{"text": "the sky is blue"}], spec, with_bos))
    assert ids == labels == [with_bos.bos_token_id] + expected
    assert ids == with_bos.backend.encode("the sky is blue").ids


def test_tokenizer_config_add_bos_eos_decide_auto(tmp_path):
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, bos_post_processor=True,
                                                config={"add_bos_token": False, "add_eos_token": True})))
    (ids, _), = rows(tokenize_records([{"text": "sky"}], TokenizeSpec(format=RecordFormat.TEXT), tok))
    assert ids[0] != tok.bos_token_id and ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("add_bos, add_eos", [(AddSpecial.ALWAYS, AddSpecial.ALWAYS),
                                              (AddSpecial.NEVER, AddSpecial.NEVER)])
def test_always_never_doubles_and_never_adds_none(chatml, add_bos, add_eos):
    spec = TokenizeSpec(format=RecordFormat.TEXT, add_bos=add_bos, add_eos=add_eos)
    bos, eos = chatml.bos_token_id, chatml.eos_token_id
    batch = tokenize_records([{"text": "sky"}, {"text": "<s>sky</s>"}], spec, chatml)
    (first, _), (second, _) = rows(batch)
    if add_bos is AddSpecial.ALWAYS:
        assert first[0] == bos and first[-1] == eos and first[1] != bos
        assert second == first  # the text's own <s> and </s> are not doubled
    else:
        assert bos not in first and eos not in first
        assert second[0] == bos and second[-1] == eos  # the text's own stay


def test_chat_gets_only_its_template_tokens_unless_always(chatml):
    record = {"messages": [USER, BLUE]}
    (auto, _), = rows(tokenize_records([record], TokenizeSpec(), chatml))
    assert chatml.bos_token_id not in auto and chatml.eos_token_id not in auto
    spec = TokenizeSpec(add_bos=AddSpecial.ALWAYS, add_eos=AddSpecial.ALWAYS)
    (always, labels), = rows(tokenize_records([record], spec, chatml))
    assert always == [chatml.bos_token_id] + auto + [chatml.eos_token_id]
    assert labels[0] == -100 and labels[-1] == -100  # the newline after <|im_end|> is not trained, nor what follows


def test_plain_prompt_completion_trains_the_completion_and_appends_eos_as_trl(chatml):
    spec = TokenizeSpec()
    batch = tokenize_records([{"prompt": "the sky is", "completion": " blue"}], spec, chatml)
    (ids, labels), = rows(batch)
    assert ids[-1] == chatml.eos_token_id and labels[-1] == chatml.eos_token_id
    assert trained_text(chatml, batch) == " blue</s>"
    assert batch.prompt_length.tolist() == [len(chatml.backend.encode("the sky is", add_special_tokens=False).ids)]
    assert labels[:batch.prompt_length[0]] == [-100] * int(batch.prompt_length[0])
    never = tokenize_records([{"prompt": "the sky is", "completion": " blue</s>"}], spec, chatml)
    assert rows(never)[0][0] == ids  # a completion that ends with EOS gets no second one


def test_conversational_prompt_completion(chatml):
    record = {"prompt": [USER], "completion": [BLUE]}
    batch = tokenize_records([record], TokenizeSpec(), chatml)
    assert trained_text(chatml, batch) == "It is blue.<|im_end|>"
    whole = tokenize_records([{"messages": [USER, BLUE]}], TokenizeSpec(), chatml)
    assert rows(batch) == rows(whole)
    assert batch.prompt_length.tolist() == whole.prompt_length.tolist()
    everything = tokenize_records([record], TokenizeSpec(loss_on=LossOn.ALL), chatml)
    assert rows(everything)[0][0] == rows(everything)[0][1]
    assert everything.prompt_length.tolist() == batch.prompt_length.tolist()


def test_plain_records_refuse_assistant_rules_even_when_dropping(chatml):
    spec = TokenizeSpec(loss_on=LossOn.ASSISTANT, on_bad_row=OnBadRow.DROP)
    with pytest.raises(RowOptionError, match="--loss-on assistant needs conversational records"):
        tokenize_records([{"prompt": "a", "completion": "b"}], spec, chatml)


def test_preference_explicit_prompt_two_rows(chatml):
    batch = tokenize_records([{"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]}], TokenizeSpec(), chatml)
    assert batch.record.tolist() == [0, 0] and batch.branch.tolist() == [0, 1]
    assert trained_text(chatml, batch, 0) == "It is blue.<|im_end|>"
    assert trained_text(chatml, batch, 1) == "It is green.<|im_end|>"
    assert batch.prompt_length[0] == batch.prompt_length[1] > 0


def test_preference_implicit_prompt(chatml):
    implicit = tokenize_records([{"chosen": [USER, BLUE], "rejected": [USER, GREEN]}], TokenizeSpec(), chatml)
    explicit = tokenize_records([{"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]}], TokenizeSpec(), chatml)
    assert rows(implicit) == rows(explicit)
    assert implicit_prompt("Sky? Blue.", "Sky? Green.") == ("Sky?", " Blue.", " Green.")
    assert implicit_prompt([USER, BLUE], [USER, GREEN]) == ([USER], [BLUE], [GREEN])
    plain = tokenize_records([{"chosen": "Sky? Blue.", "rejected": "Sky? Green."}], TokenizeSpec(), chatml)
    assert trained_text(chatml, plain, 0) == " Blue.</s>" and trained_text(chatml, plain, 1) == " Green.</s>"


def test_preference_without_a_shared_prompt_is_a_bad_row(chatml):
    with pytest.raises(RowError, match=r"^record 0 field 'chosen': chosen and rejected share no leading message"):
        tokenize_records([{"chosen": [BLUE], "rejected": [GREEN]}], TokenizeSpec(), chatml)
    with pytest.raises(RowError, match=r"^record 0 field 'prompt': is an empty list of messages$"):
        tokenize_records([{"prompt": [], "chosen": [BLUE], "rejected": [GREEN]}], TokenizeSpec(), chatml)


def test_tools_column_reaches_the_template(tmp_path):
    from support.tokenizers import TOOLS

    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=TOOLS)))
    tools = [{"type": "function", "function": {"name": "weather"}}]
    with_tools = tokenize_records([{"messages": [USER, BLUE], "functions": tools}],
                                  TokenizeSpec(columns=Columns(tools="functions")), tok)
    as_json = tokenize_records([{"messages": [USER, BLUE], "tools": json.dumps(tools)}], TokenizeSpec(), tok)
    assert rows(with_tools) == rows(as_json)
    assert "weather" in tok.backend.decode(with_tools.input_ids.tolist(), skip_special_tokens=False)


BAD = [
    ({"messages": None}, "messages", "is missing or null"),
    ({"other": 1, "messages": "hi"}, "messages", "expected a non-empty list of messages, found str"),
    ({"messages": []}, "messages", "expected a non-empty list of messages"),
    ({"messages": [{"content": "x"}]}, "messages", "message 0 is not a dict with a string 'role'"),
    ({"messages": [{"role": "user"}]}, "messages", "message 0 has no 'content'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "'content' is a int"),
    ({"messages": [USER]}, "messages", "no token carries a loss under --loss-on assistant"),
    ({"messages": [USER, BLUE], "tools": "{oops"}, "tools", "is a string that is not JSON"),
]


@pytest.mark.parametrize("record, field, reason", BAD)
def test_bad_rows_raise_one_line_naming_record_and_field(chatml, record, field, reason):
    good = {"messages": [USER, BLUE]}
    with pytest.raises(RowError) as err:
        tokenize_records([good, record], TokenizeSpec(format=RecordFormat.MESSAGES), chatml)
    assert (err.value.record, err.value.field) == (1, field)
    assert str(err.value).startswith(f"record 1 field '{field}': ") and reason in str(err.value)
    assert "\n" not in str(err.value) and isinstance(err.value, PackctlError)


def test_bad_text_rows(chatml):
    spec = TokenizeSpec(format=RecordFormat.TEXT)
    for record, reason in (({"text": ""}, "empty text"), ({"text": 5}, "expected a string, found int"),
                           ({}, "missing")):
        with pytest.raises(RowError, match=reason):
            tokenize_records([record], spec, chatml)


def test_template_refusal_is_a_bad_row(tmp_path):
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
                "{{ m.content }}{% endfor %}")
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=template)))
    with pytest.raises(RowError, match="the chat template refuses it: no tools here"):
        tokenize_records([{"messages": [{"role": "tool", "content": "x"}]}], TokenizeSpec(), tok)


def test_drop_counts_bad_records_and_keeps_the_others(chatml):
    records = [
        {"prompt": [USER], "chosen": [BLUE], "rejected": [GREEN]},
        {"prompt": [USER], "chosen": [BLUE], "rejected": None},
        {"prompt": [USER], "chosen": [BLUE], "rejected": [{"role": "user", "content": "no assistant"}]},
        {"prompt": [USER], "chosen": [GREEN], "rejected": [BLUE]},
    ]
    batch = tokenize_records(records, TokenizeSpec(on_bad_row=OnBadRow.DROP), chatml)
    assert batch.record.tolist() == [0, 0, 3, 3] and batch.branch.tolist() == [0, 1, 0, 1]
    assert [(r, f) for r, f, _ in batch.dropped] == [(1, "rejected"), (2, "rejected")]
    assert "the completion must start with an assistant turn" in batch.dropped[1][2]
    assert batch.rows == 4 and batch.offsets[-1] == len(batch.input_ids) == len(batch.labels)
    assert batch.offsets.dtype == np.int64 and batch.input_ids.dtype == np.int32 and batch.labels.dtype == np.int32
    assert batch.record.dtype == np.int64 and batch.branch.dtype == np.int8 and batch.prompt_length.dtype == np.int32


def test_everything_dropped_gives_an_empty_batch(chatml):
    batch = tokenize_records([{"text": ""}], TokenizeSpec(format=RecordFormat.TEXT, on_bad_row=OnBadRow.DROP), chatml)
    assert batch.rows == 0 and batch.offsets.tolist() == [0] and batch.dropped == [(0, "text", "empty text")]


def test_describe():
    spec = TokenizeSpec(format=RecordFormat.MESSAGES, loss_on=LossOn.LAST_ASSISTANT, columns=Columns(messages="conv"))
    assert spec.describe() == {
        "format": "messages", "loss_on": "last-assistant",
        "columns": {"text": "text", "messages": "conv", "prompt": "prompt", "completion": "completion",
                    "chosen": "chosen", "rejected": "rejected", "tools": "tools"},
        "add_bos": "auto", "add_eos": "auto", "on_bad_row": "error",
    }
    resolved = TokenizeSpec().describe(["prompt", "completion"])
    assert (resolved["format"], resolved["loss_on"]) == ("prompt-completion", "completion")


def test_error_names_the_first_bad_record(chatml):
    records = [{"messages": [USER, BLUE]}, {"messages": [USER]}, {"messages": None}]
    with pytest.raises(RowError, match=r"^record 1 field 'messages': no token carries a loss"):
        tokenize_records(records, TokenizeSpec(), chatml)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunks_do_not_change_the_batch(chatml, monkeypatch, chunk):
    import packctl.tokenize.encode as encode

    pairs = (([BLUE], [GREEN]), (None, [GREEN]), ([GREEN], [USER]), ([GREEN], [BLUE]))
    records = [{"prompt": [USER], "chosen": chosen, "rejected": rejected} for chosen, rejected in pairs]
    records.append({"prompt": [BLUE], "chosen": [GREEN], "rejected": [BLUE]})
    spec = TokenizeSpec(on_bad_row=OnBadRow.DROP)
    whole = tokenize_records(records, spec, chatml)
    monkeypatch.setattr(encode, "_CHUNK", chunk)
    chunked = tokenize_records(records, spec, chatml)
    assert rows(chunked) == rows(whole) and chunked.dropped == whole.dropped
    assert chunked.record.tolist() == whole.record.tolist() == [0, 0, 3, 3, 4, 4]
    assert [r for r, _, _ in whole.dropped] == [1, 2]


def test_batch_does_not_depend_on_the_encoder_threads(chatml, monkeypatch):
    records = [{"messages": [USER, {"role": "assistant", "content": "It is blue. " * k}]} for k in range(1, 40)]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the Rust encoder on the calling thread only
    one = tokenize_records(records, TokenizeSpec(), chatml)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    many = tokenize_records(records, TokenizeSpec(), chatml)
    assert rows(one) == rows(many) and one.prompt_length.tolist() == many.prompt_length.tolist()

"""The loss masks packctl computes, against transformers' own `return_assistant_tokens_mask` on
templates that have `{% generation %}`, and the prefix rule against the generation blocks on the
same templates without them."""
from __future__ import annotations

import numpy as np
import pytest

from packctl.tokenize.encode import PREFIX_RULE_MESSAGE, RowError, TokenizeSpec, tokenize_records
from packctl.tokenize.formats import LossOn, RecordFormat
from packctl.tokenize.tokenizer import LocalTokenizer
from support.tokenizers import CHATML, LLAMA3, REASONING, TOOLS, tokenizer_dir, without_generation

transformers = pytest.importorskip("transformers")

TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather in a city <today>",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]

CONVERSATIONS = {
    "plain": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": "The sky is blue."},
        {"role": "user", "content": "And the sea?"},
        {"role": "assistant", "content": "  green, mostly \n\n"},
    ],
    "unicode": [
        {"role": "user", "content": "héllo wörld ✓\n\n"},
        {"role": "assistant", "content": "\n  naïve café — 東京\n"},
        {"role": "user", "content": "再见"},
        {"role": "assistant", "content": "bye 👋"},
    ],
    "ends_on_user": [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ],
}

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"sky\": \"sunny\"}"},
    {"role": "assistant", "content": "It is sunny in Paris."},
]


def _reference(directory, conversation, tools=None):
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    out = hf.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    text = hf.apply_chat_template(conversation, tools=tools, tokenize=False)
    return list(out["input_ids"]), list(out["assistant_masks"]), text


def _packctl(directory, conversation, tools=None, loss_on=None):
    tok = LocalTokenizer.load(str(directory))
    record = {"messages": conversation, **({"tools": tools} if tools is not None else {})}
    batch = tokenize_records([record], TokenizeSpec(format=RecordFormat.MESSAGES, loss_on=loss_on), tok)
    return batch.input_ids.tolist(), (batch.labels != -100).astype(int).tolist(), batch


CASES = [(name, template, conv, None) for name, conv in CONVERSATIONS.items()
         for template in (CHATML, LLAMA3) if name != "ends_on_user"]
CASES += [("tools", TOOLS, TOOL_CONVERSATION, TOOL_SCHEMAS), ("tools_plain", TOOLS, CONVERSATIONS["plain"], None)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    made = {}
    for name, template in (("chatml", CHATML), ("llama3", LLAMA3), ("tools", TOOLS), ("reasoning", REASONING)):
        made[template] = tokenizer_dir(tmp_path_factory.mktemp(name), template=template, bos_token="<|begin_of_text|>")
        made[without_generation(template)] = tokenizer_dir(
            tmp_path_factory.mktemp(name + "_nogen"), template=without_generation(template),
            bos_token="<|begin_of_text|>",
        )
    return made


@pytest.mark.parametrize("name, template, conversation, tools", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_render_ids_and_masks_equal_transformers(dirs, name, template, conversation, tools):
    ids, mask, text = _reference(dirs[template], conversation, tools)
    assert sum(mask) > 0
    tok = LocalTokenizer.load(str(dirs[template]))
    assert tok.render(conversation, tools=tools).text == text
    got_ids, got_mask, batch = _packctl(dirs[template], conversation, tools)
    assert got_ids == ids
    assert got_mask == mask
    assert batch.prompt_length.tolist() == [mask.index(1)]


@pytest.mark.parametrize("name, template, conversation, tools", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_prefix_rule_equals_generation_blocks(dirs, name, template, conversation, tools):
    _, with_blocks, batch = _packctl(dirs[template], conversation, tools)
    ids, by_prefix, _ = _packctl(dirs[without_generation(template)], conversation, tools)
    assert LocalTokenizer.load(str(dirs[without_generation(template)])).has_generation_block is False
    assert ids == batch.input_ids.tolist()
    assert by_prefix == with_blocks


@pytest.mark.parametrize("generation", [True, False])
def test_last_assistant_trains_the_last_turn_only(dirs, generation):
    template = CHATML if generation else without_generation(CHATML)
    conversation = CONVERSATIONS["plain"]
    _, every, _ = _packctl(dirs[template], conversation)
    _, last, batch = _packctl(dirs[template], conversation, loss_on=LossOn.LAST_ASSISTANT)
    every, last = np.array(every), np.array(last)
    turns = np.flatnonzero(np.diff(np.r_[0, every]) == 1)  # where each trained run starts
    assert len(turns) == 2
    assert last[turns[1]:].tolist() == every[turns[1]:].tolist() and not last[:turns[1]].any()


def test_loss_on_all_trains_every_token(dirs):
    ids, mask, batch = _packctl(dirs[CHATML], CONVERSATIONS["plain"], loss_on=LossOn.ALL)
    assert all(mask) and batch.labels.tolist() == ids and batch.prompt_length.tolist() == [0]


REASONING_CONVERSATION = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "three and three"},
]


def test_history_rewriting_template_is_refused_by_the_prefix_rule(dirs):
    with pytest.raises(RowError) as err:
        _packctl(dirs[without_generation(REASONING)], REASONING_CONVERSATION)
    assert str(err.value) == f"record 0 field 'messages': {PREFIX_RULE_MESSAGE}"
    assert "\n" not in str(err.value)


def test_history_rewriting_template_works_with_generation_blocks(dirs):
    ids, mask, text = _reference(dirs[REASONING], REASONING_CONVERSATION)
    assert "<think>\nthree and three" in text and "two and two" not in text
    got_ids, got_mask, _ = _packctl(dirs[REASONING], REASONING_CONVERSATION)
    assert (got_ids, got_mask) == (ids, mask)


def test_history_rewriting_template_works_under_loss_on_all(dirs):
    ids, mask, _ = _packctl(dirs[without_generation(REASONING)], REASONING_CONVERSATION, loss_on=LossOn.ALL)
    assert all(mask)

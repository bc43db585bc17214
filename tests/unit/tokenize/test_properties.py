"""Invariants of the loss mask over random conversations: a token carries a loss exactly when it
holds a character of an assistant turn, and its label is its id."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.tokenize.encode import RowError, TokenizeSpec, tokenize_records
from packctl.tokenize.formats import RecordFormat
from packctl.tokenize.tokenizer import LocalTokenizer
from support.profiles import examples
from support.tokenizers import CHATML, LLAMA3, tokenizer_dir, without_generation

PIECES = ["the", " sky", "blue", "é", "東京", "👋", " ", "  ", "\n", "\n\n", "\t", ".", "?", "0", "ab", "<b>",
          "{}"]
CONTENT = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
MESSAGE = st.builds(lambda role, content: {"role": role, "content": content},
                    st.sampled_from(["system", "user", "assistant"]), CONTENT)
CONVERSATION = st.lists(MESSAGE, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """For each template: the tokenizer with its generation blocks (the truth of where assistant
    turns are) and the one without them (the prefix rule)."""
    made = {}
    for name, template in (("chatml", CHATML), ("llama3", LLAMA3)):
        made[name] = (
            LocalTokenizer.load(str(tokenizer_dir(tmp_path_factory.mktemp(name), template=template))),
            LocalTokenizer.load(str(tokenizer_dir(tmp_path_factory.mktemp(name + "n"),
                                                  template=without_generation(template)))),
        )
    return made


@settings(max_examples=examples(300, default=40), deadline=None)
@given(conversation=CONVERSATION, name=st.sampled_from(["chatml", "llama3"]), by_prefix=st.booleans())
def test_loss_tokens_are_exactly_the_assistant_turns(pairs, conversation, name, by_prefix):
    truth, prefix = pairs[name]
    tok = prefix if by_prefix else truth
    rendered = truth.render(conversation)
    spans = rendered.generation_spans
    try:
        batch = tokenize_records([{"messages": conversation}], TokenizeSpec(format=RecordFormat.MESSAGES), tok)
    except RowError as exc:
        # Only a conversation whose assistant turns hold no token may be refused.
        assert "no token carries a loss" in str(exc)
        assert all(start == end for start, end in spans)
        return
    ids, labels = batch.input_ids, batch.labels
    assert batch.rows == 1 and (labels != -100).any()
    assert (labels[labels != -100] == ids[labels != -100]).all()
    encoding = tok.backend.encode(rendered.text, add_special_tokens=False)
    assert encoding.ids == ids.tolist()
    text = rendered.text
    for token, (start, end) in enumerate(encoding.offsets):
        inside = any(start < b and end > a for a, b in spans)
        assert (labels[token] != -100) == inside, (token, text[start:end])
        if not inside:
            # a token outside the loss is template or user text: no assistant character in it
            assert not any(a <= c < b for c in range(start, end) for a, b in spans)
    trained = tok.backend.decode(ids[labels != -100].tolist(), skip_special_tokens=False)
    assert trained == "".join(text[a:b] for a, b in spans)
    assert batch.prompt_length[0] == int((labels != -100).argmax())


WORDS = st.lists(st.sampled_from(["the", " sky", "is", " blue", "n't", "é", " ", "\n", "0", "ab", "c"]),
                 max_size=6).map("".join)


@settings(max_examples=examples(300, default=40), deadline=None)
@given(prompt=WORDS, completion=WORDS.filter(bool))
def test_plain_completion_starts_where_trl_finds_it_or_at_its_first_character(pairs, prompt, completion):
    """TRL starts the completion where the ids of prompt and prompt + completion first differ.
    packctl starts it at the token holding the completion's first character: the same token, or a
    later one where BPE splits the prompt's last word differently once the completion follows
    (TRL then trains a piece of the prompt)."""
    tok = pairs["chatml"][0]
    batch = tokenize_records([{"prompt": prompt, "completion": completion}], TokenizeSpec(), tok)
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    prompt_ids = tok.backend.encode(prompt, add_special_tokens=False).ids
    whole = tok.backend.encode(prompt + completion, add_special_tokens=False)
    assert ids == whole.ids + [tok.eos_token_id] or (completion.endswith("</s>") and ids == whole.ids)
    same = [a == b for a, b in zip(prompt_ids, whole.ids)]
    common = same.index(False) if False in same else len(same)  # TRL's common_prefix_length
    start = int(batch.prompt_length[0])
    assert common <= start
    assert all(label == -100 for label in labels[:start]) and all(label != -100 for label in labels[start:])
    assert whole.offsets[start][1] > len(prompt)  # the first trained token holds a completion character
    if start > 0:
        assert whole.offsets[start - 1][1] <= len(prompt)  # and the one before it none

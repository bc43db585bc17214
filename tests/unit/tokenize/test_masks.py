"""Character spans to token ranges: against a reference of a few lines over the offsets, and the
span that ends on whitespace the tokenizer drops."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packctl.tokenize.encode import TokenizeSpec, tokenize_records
from packctl.tokenize.formats import RecordFormat
from packctl.tokenize.masks import SpanError, labels_from_ranges, token_spans
from packctl.tokenize.tokenizer import LocalTokenizer
from support.profiles import examples
from support.tokenizers import tokenizer_dir, train_tokenizer

BYTE_LEVEL = train_tokenizer()
WHITESPACE = train_tokenizer(whitespace=True)


def reference_range(offsets, start, end):
    """The tokens whose characters overlap [start, end): the first and one past the last."""
    hit = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
    return (hit[0], hit[-1] + 1) if hit else None


@settings(max_examples=examples(300, default=60), deadline=None)
@given(text=st.lists(st.sampled_from(["the", " sky", "  ", "\n", "\n\n", "é", "東京", "<|im_end|>", "blue", ".",
                                      " "]), min_size=1, max_size=20).map("".join),
       data=st.data(), whitespace=st.booleans())
def test_token_spans_equal_the_overlap_of_offsets(text, data, whitespace):
    tokenizer = WHITESPACE if whitespace else BYTE_LEVEL
    encoding = tokenizer.encode(text, add_special_tokens=False)
    start = data.draw(st.integers(0, len(text) - 1))
    end = data.draw(st.integers(start + 1, len(text)))
    expected = reference_range(encoding.offsets, start, end)
    if expected is None:
        with pytest.raises(SpanError, match="cannot be located"):
            token_spans(encoding, [(start, end)])
    else:
        assert token_spans(encoding, [(start, end)]) == [expected]


def test_span_ending_on_dropped_whitespace_stops_at_its_last_token():
    text = "hello world \n\n the sky is blue"
    encoding = WHITESPACE.encode(text, add_special_tokens=False)
    assert encoding.char_to_token(13) is None  # the span's last character maps to no token
    (first, last), = token_spans(encoding, [(0, 14)])
    assert WHITESPACE.decode(encoding.ids[first:last]) == "hello world"
    assert last < len(encoding.ids)


def test_span_of_only_dropped_whitespace_cannot_be_located():
    encoding = WHITESPACE.encode("hello \n\n world", add_special_tokens=False)
    with pytest.raises(SpanError, match="cannot be located"):
        token_spans(encoding, [(5, 9)])


def test_empty_span_gives_an_empty_range():
    encoding = BYTE_LEVEL.encode("hello", add_special_tokens=False)
    assert token_spans(encoding, [(2, 2)]) == [(0, 0)]


def test_labels_from_ranges():
    assert labels_from_ranges(np.array([5, 6, 7, 8]), [(1, 3)]).tolist() == [-100, 6, 7, -100]


# A generation block that ends on a newline: with a tokenizer that drops whitespace, the newline
# maps to no token, and a mask that looks up char_to_token(end - 1) and takes the length of the
# sequence when it is None runs to the end of the conversation.
TRAILING_NEWLINE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
)


def test_generation_span_ending_on_dropped_whitespace_does_not_run_to_the_end(tmp_path):
    tok = LocalTokenizer.load(str(tokenizer_dir(tmp_path, template=TRAILING_NEWLINE, whitespace=True)))
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the sky"},
                {"role": "user", "content": "what color"}]
    batch = tokenize_records([{"messages": messages}], TokenizeSpec(format=RecordFormat.MESSAGES), tok)
    trained = batch.input_ids[batch.labels != -100].tolist()
    assert tok.backend.decode(trained, skip_special_tokens=False) == "the sky <|im_end|>"
    assert batch.labels[-1] == -100

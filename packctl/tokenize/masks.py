"""Character spans of a text mapped to token ranges of its encoding, and the labels they give.

A span is [start, end) in characters; its token range is [first token of the first character,
last token of the last character + 1). With "Hello world" encoded as ["Hello", " world"]:

    token_spans(encoding, [(6, 11)])  ->  [(1, 2)]        "world" is inside the token " world"

A boundary character that maps to no token (whitespace the tokenizer strips, or a space the
pre-tokenizer folds away) is replaced by the nearest mapped character inside the span, so a span
never grows past its own characters, and never runs to the end of the sequence.
"""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


class SpanError(ValueError):
    """A character span with no character that maps to a token."""


def _first_token(encoding, start: int, end: int) -> int | None:
    for char in range(start, end):
        token = encoding.char_to_token(char)
        if token is not None:
            return token
    return None


def _last_token(encoding, start: int, end: int) -> int | None:
    for char in range(end - 1, start - 1, -1):
        token = encoding.char_to_token(char)
        if token is not None:
            # char_to_token gives the first token of a character; a character split over several
            # tokens (the two bytes of "é" in a byte-level BPE) ends at the last of them.
            count = len(encoding)
            while token + 1 < count:
                chars = encoding.token_to_chars(token + 1)
                if chars is None or not chars[0] <= char < chars[1]:
                    break
                token += 1
            return token
    return None


def token_spans(encoding, char_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [first, last + 1) token range of each character span of the encoded text.

    Only the characters at the span boundaries are looked up (`Encoding.char_to_token`), moving
    inward where one maps to no token; a token is in the range when it holds a character of the
    span (the rule of transformers' `return_assistant_tokens_mask`). An empty span gives an empty
    range; a non-empty span none of whose characters maps to a token raises `SpanError`.
    """
    ranges = []
    for start, end in char_spans:
        if start >= end:
            ranges.append((0, 0))
            continue
        first = _first_token(encoding, start, end)
        if first is None:
            raise SpanError("a loss span cannot be located in the tokens: none of its characters maps to a token")
        last = _last_token(encoding, start, end)
        ranges.append((first, last + 1))
    return ranges


def labels_from_ranges(ids: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """`ids` inside the token ranges, IGNORE_INDEX elsewhere.

    >>> labels_from_ranges(np.array([5, 6, 7, 8]), [(1, 3)])
    array([-100,    6,    7, -100], dtype=int32)
    """
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
    for first, last in ranges:
        labels[first:last] = ids[first:last]
    return labels

"""Tokenizer directories built once per module: training a small BPE takes milliseconds, loading
it into transformers a little longer."""
from __future__ import annotations

import pytest

from packctl.tokenize.tokenizer import LocalTokenizer
from support.tokenizers import CHATML, tokenizer_dir


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("chatml"), template=CHATML)


@pytest.fixture(scope="module")
def chatml(chatml_dir):
    return LocalTokenizer.load(str(chatml_dir))

"""Tokenization for `packctl tokenize`: a local Hugging Face tokenizer and its chat template
(`tokenizer.py`), the record formats and loss rules (`formats.py`), character spans to token
ranges (`masks.py`), and records to token rows with labels (`encode.py`)."""

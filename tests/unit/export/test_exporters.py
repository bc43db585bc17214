"""export/ without a packed output: the options each format takes, the dtypes the trainers read
token files in, where OLMo-core ends documents, and a shard's packs as flat arrays."""
from __future__ import annotations

import numpy as np
import pytest

from packctl.errors import PackctlError
from packctl.export import EXPORTERS, FORMATS, ShardPacks, check_options
from packctl.export import megatron, olmo


def test_options_are_checked_as_python_ints():
    options = check_options("olmo", eos_token_id=np.int64(2), bos_token_id=1, vocab_size=32_000)
    assert (options.eos_token_id, options.bos_token_id, options.vocab_size) == (2, 1, 32_000)
    assert type(options.eos_token_id) is int


@pytest.mark.parametrize("fmt, options, said", [
    ("parquet", {}, "--format 'parquet': choose one of nemo, nemo-npy, olmo, megatron"),
    ("nemo", {"overwrite": "yes"}, "--overwrite 'yes': must be true or false"),
    ("nemo", {"eos_token_id": 2.5}, "--eos-token-id 2.5: must be a whole number"),
    ("nemo", {"eos_token_id": True}, "--eos-token-id True: must be a whole number"),
    ("nemo", {"eos_token_id": -1}, "--eos-token-id -1: must be in [0, 2,147,483,647] (token ids are int32)"),
    ("olmo", {"vocab_size": 0}, "--vocab-size 0: must be in [1, 2,147,483,648] (token ids are int32)"),
    ("megatron", {"eos_token_id": 2}, "--eos-token-id: applies to --format nemo, nemo-npy and olmo only; "
                                      "megatron does not use it"),
    ("nemo-npy", {"bos_token_id": 1}, "--bos-token-id: applies to --format olmo only; nemo-npy does not use it"),
    ("nemo", {"vocab_size": 9}, "--vocab-size: applies to --format olmo and megatron only; nemo does not use it"),
])
def test_an_option_a_format_does_not_take_is_refused_in_one_line(fmt, options, said):
    with pytest.raises(PackctlError) as raised:
        check_options(fmt, **options)
    assert str(raised.value) == said


def test_token_dtypes_are_the_trainers_own():
    assert [olmo.token_dtype(v).__name__ for v in (256, 257, 65_536, 65_537)] == ["uint8", "uint16", "uint16",
                                                                                 "uint32"]
    assert [megatron.token_dtype(v).name for v in (32_000, 65_499, 65_500)] == ["uint16", "uint16", "int32"]


@pytest.mark.parametrize("tokens, bos, ends", [
    ([7, 2, 5, 2, 0, 2], None, [2, 4, 6]),
    ([1, 7, 2, 1, 0, 2], 1, [3, 6]),        # with a BOS id: an EOS ends a document where a BOS follows
    ([7, 2, 5], None, [2, 3]),              # the file's end ends the last document
    ([], None, []),
])
def test_where_olmo_core_ends_documents(tokens, bos, ends):
    assert olmo.document_ends(np.array(tokens, np.int64), eos=2, bos=bos).tolist() == ends


def test_flat_starts_are_each_sequences_offset_in_the_shards_tokens():
    # pack 0: sequences at 0 and 3 of its 6 tokens; pack 1: one sequence at 0 of its 4
    shard = ShardPacks("data/train-00000.parquet", token_offsets=np.array([0, 6, 10]),
                       input_ids=np.arange(10, dtype=np.int32), labels=np.arange(10, dtype=np.int32),
                       seq_offsets=np.array([0, 2, 3]), seq_lens=np.array([3, 2, 4]), seq_starts=np.array([0, 3, 0]))
    assert shard.num_packs == 2 and shard.flat_starts().tolist() == [0, 3, 6]


def test_every_exporter_module_checks_a_layout_and_writes():
    """The table names real functions: the layout check and the writer of each row."""
    import importlib

    for exporter in EXPORTERS.values():
        module = importlib.import_module(f"packctl.export.{exporter.module}")
        assert callable(module.check_layout) and callable(getattr(module, exporter.writer)), exporter.name
        assert set(exporter.uses) <= {"eos_token_id", "bos_token_id", "vocab_size"}
    assert FORMATS == tuple(EXPORTERS) == ("nemo", "nemo-npy", "olmo", "megatron")


def test_export_help_lists_every_format_of_the_table():
    from typer.testing import CliRunner

    from packctl.cli.app import app

    result = CliRunner().invoke(app, ["export", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for exporter in EXPORTERS.values():
        assert f"{exporter.name} ({' '.join(exporter.summary.split())})" in text
    assert f"[{'|'.join(FORMATS)}]" in text

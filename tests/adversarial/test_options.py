"""Bad options and API types (docs/errors.md "Bad options and API types").

Every value of the wrong type or outside its range is refused before any work: exit 2, one line
naming the option (the flag, or the key as a --config file spells it) and the fix, nothing left
beside OUT. Paths given as os.PathLike and numpy scalars are taken as they are meant, and such a
run holds every sample once. Input columns of the same name are refused naming file and column;
tokens in any of Arrow's list layouts are read.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.adversary import (
    assert_clean_error,
    assert_every_sample_once,
    assert_nothing_left,
    packctl,
)
from support.data import write_table
from support.paths import MPIEXEC

from packctl import PackConfig, PackctlError, pack
from packctl.export import export
from packctl.sample import SampleSpec, write_sample
from packctl.verify import VerifyOptions, verify

BIG = str(10**30)
LENGTHS = [1, 2, 3, 5, 8, 13, 4, 7, 2, 6, 9, 3]


def _lists(lengths: list[int], start: int = 1) -> list[list[int]]:
    out, value = [], start
    for n in lengths:
        out.append(list(range(value, value + n)))
        value += n
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """12 sequences of 1..13 tokens with labels, in one file."""
    path = tmp_path_factory.mktemp("corpus") / "a.parquet"
    tokens = pa.array(_lists(LENGTHS), pa.list_(pa.int32()))
    return write_table(path, {"input_ids": tokens, "labels": tokens})


@pytest.fixture(scope="module")
def packed(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "out"
    assert packctl("pack", corpus, "-o", out, "--capacity", "16", "-q").code == 0
    return out


# ---------------------------------------------------------------------------------------------
# packctl pack: every option's bad values

PACK_BAD = [
    # wrong type: the words a --config file and the API get (test_a_number_is_checked_alike_...)
    (["--capacity", "abc"], "--capacity 'abc': must be a whole number of tokens"),
    (["--capacity", "4096.5"], "--capacity '4096.5': must be a whole number of tokens"),
    (["--capacity", "4096.0"], "--capacity '4096.0': must be a whole number of tokens"),
    (["--capacity"], "--capacity"),  # no value
    (["--seed", "1e3"], "--seed '1e3': must be a whole number"),
    (["--attn-coeff", "x", "--dp-size", "2", "--micro-batches", "1"], "--attn-coeff 'x': must be a number"),
    (["--no-such-flag"], "No such option"),
    # zero and negative
    (["--capacity", "0"], "--capacity 0: must be a whole number >= 1"),
    (["--capacity", "-16"], "--capacity -16: must be a whole number >= 1"),
    (["--window", "0"], "--window 0: must be a whole number >= 1"),
    (["--shard-rows", "0"], "--shard-rows 0: must be a whole number >= 1"),
    (["--pool-size", "-1"], "--pool-size -1: must be a whole number >= 1"),
    (["--cp-size", "0"], "--cp-size 0: must be a whole number >= 1"),
    (["--tp-size", "-2"], "--tp-size -2: must be a whole number >= 1"),
    (["--seq-multiple", "0"], "--seq-multiple 0: must be a whole number >= 1"),
    (["--max-seqs-per-bin", "0"], "--max-seqs-per-bin 0: must be a whole number >= 1"),
    (["--epochs", "0"], "--epochs 0: must be a whole number >= 1"),
    (["--seed", "-1"], "--seed -1: must be a whole number >= 0"),
    (["--pad-token-id", "-1"], "--pad-token-id -1: must be a whole number >= 0"),
    (["--pad-to", "multiple", "--pack-multiple", "0"], "--pack-multiple 0: must be a whole number >= 1"),
    (["--mode", "batch", "--max-tokens", "0"], "--max-tokens 0: must be a whole number >= 1"),
    (["--mode", "batch", "--seq-round", "0"], "--seq-round 0: must be a whole number >= 1"),
    (["--pad-to", "multiple", "--shape-buckets", "0"], "--shape-buckets 0: must be a whole number >= 1"),
    (["--dp-size", "0", "--micro-batches", "1"], "--dp-size 0: must be a whole number >= 1"),
    (["--dp-size", "2", "--micro-batches", "0"], "--micro-batches 0: must be a whole number >= 1"),
    (["--dp-size", "2", "--step-tokens", "0"], "--step-tokens 0: must be a whole number >= 1"),
    (["--dp-size", "2", "--micro-batches", "1", "--attn-coeff", "-1"], "--attn-coeff -1.0: must be a number >= 0"),
    (["--dp-size", "2", "--micro-batches", "1", "--lr-scaling", "sqrt", "--ref-batch-size", "0"],
     "--ref-batch-size 0.0: must be a number > 0"),
    # huge
    (["--capacity", "2147483648"], "--capacity 2147483648: must be at most 2,147,483,647"),
    (["--capacity", BIG], "must be at most 2,147,483,647"),
    (["--window", BIG], "--window 1000000000000000000000000000000: must be at most 9,223,372,036,854,775,807"),
    (["--pool-size", BIG, "--algorithm", "pool"], "--pool-size"),
    (["--max-seqs-per-bin", BIG], "--max-seqs-per-bin"),
    (["--epochs", "100000", "--order", "shuffle"], "--epochs 100000: must be at most 99,999"),
    (["--seed", str(2**63)], "--seed 9223372036854775808: must be at most"),
    (["--pad-token-id", str(2**31)], "--pad-token-id 2147483648: must be at most 2,147,483,647"),
    (["--cp-size", BIG], "--cp-size"),
    (["--cp-size", "2147483647", "--tp-size", "2147483646"], "make the alignment 4611686011984936962"),
    (["--shard-rows", BIG], "--shard-rows"),
    (["--capacity", "2147483647"], "--memory-budget"),  # one pack of 24 GiB: more than the budget
    (["--capacity", "2097152", "--memory-budget", "16M"],
     "--capacity 2097152: one pack holds input_ids, labels and position_ids, 3 int32 columns of 2,097,152 tokens"),
    (["--capacity", "4194304", "--memory-budget", "1G"], ("--shard-rows 1024 x --capacity 4194304 exceeds 2^31-1 "
                                                          "tokens per shard (Parquet list offsets are int32): use "
                                                          "--shard-rows 511 or less")),
    (["--mode", "batch", "--max-tokens", "4194304", "--memory-budget", "1G"], "--shard-rows 1024 x --max-tokens"),
    (["--dp-size", str(2**21), "--micro-batches", "1"], "--dp-size 2097152: must be at most 1,048,576"),
    (["--dp-size", "2", "--micro-batches", BIG], "--micro-batches"),
    (["--dp-size", "2", "--micro-batches", "1", "--attn-coeff", "1e400"], "--attn-coeff inf"),
    (["--dp-size", "2", "--micro-batches", "1", "--attn-coeff", "nan"], "--attn-coeff nan"),
    (["--dp-size", "2", "--micro-batches", "1", "--lr-scaling", "sqrt", "--ref-batch-size", "inf"],
     "--ref-batch-size inf"),
    # --memory-budget: a size
    (["--memory-budget", "1e400"], "--memory-budget '1e400': not a finite size"),
    (["--memory-budget", "nan"], "--memory-budget 'nan': not a finite size"),
    (["--memory-budget", "-5G"], "--memory-budget '-5G': must be at least 1 byte"),
    (["--memory-budget", "0"], "--memory-budget '0': must be at least 1 byte"),
    (["--memory-budget", "1e30"], "--memory-budget '1e30': more than 2^63-1 bytes"),
    (["--memory-budget", "lots"], "--memory-budget 'lots': expected a size such as 4GiB"),
    (["--memory-budget", "4XB"], "--memory-budget '4XB': unknown unit 'xb'"),
    # unknown choices
    (["--algorithm", "magic"], "--algorithm 'magic': choose one of"),
    (["--too-long", "sometimes"], "--too-long 'sometimes': choose one of error, drop, truncate, split"),
    (["--order", "random"], "--order 'random': choose one of input, shuffle, curriculum"),
    (["--pack-order", "sideways"], "--pack-order 'sideways': choose one of auto, planner, shuffle, longest, mean"),
    (["--mode", "thd"], "--mode 'thd': choose one of pack, batch"),
    (["--token-transfer", "rsync"], "--token-transfer 'rsync': choose one of auto, exchange, read"),
    # names that cannot be
    (["--keep-columns", "input_ids"], "--keep-columns input_ids: that name is an input or output column"),
    (["--keep-columns", "x", "--keep-columns", "x"], "--keep-columns x, x: a column is named twice"),
    (["--weight-column", "labels"], "--weight-column 'labels'"),
]


@pytest.mark.parametrize("args, mention", PACK_BAD, ids=[" ".join(a)[:60] for a, _ in PACK_BAD])
def test_pack_refuses_a_bad_option_before_any_work(corpus, tmp_path, args, mention):
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", corpus, "-o", out, *args), 2, mention)
    assert_nothing_left(out)


def test_a_number_is_checked_alike_on_the_command_line_in_a_config_file_and_the_api(corpus, tmp_path):
    """`--capacity 4096.0` is refused as `capacity = 4096.0` in a --config file and
    PackConfig(capacity=4096.0) are, in packctl's words: one check (PackConfig.check_types) for
    the three; and `packctl.stats` takes no fractional capacity (it would be cut to 4096)."""
    from packctl.stats import stats

    out = tmp_path / "out"
    command_line = assert_clean_error(packctl("pack", corpus, "-o", out, "--capacity", "4096.0"), 2,
                                      "--capacity '4096.0': must be a whole number of tokens")
    config = tmp_path / "pack.toml"
    config.write_text("capacity = 4096.0\n")
    in_file = assert_clean_error(packctl("pack", corpus, "-o", out, "--config", config), 2,
                                 "capacity = 4096.0: must be a whole number of tokens")
    with pytest.raises(PackctlError, match="^--capacity 4096.0: must be a whole number of tokens$"):
        pack(PackConfig(inputs=[str(corpus)], output=str(out), capacity=4096.0))
    with pytest.raises(PackctlError, match="^--capacity 4096.5: must be a whole number of tokens$"):
        stats([str(corpus)], capacities=[4096.5])
    for line in (command_line, in_file):
        assert "Invalid value" not in line and "Input should be" not in line
    assert_nothing_left(out)


def test_a_refused_capacity_names_a_budget_that_is_enough(corpus, tmp_path):
    """The advice can be followed: the memory budget the message names is enough."""
    out = tmp_path / "out"
    line = assert_clean_error(packctl("pack", corpus, "-o", out, "--capacity", "2097152", "--memory-budget", "16M",
                                      "--shard-rows", "1"), 2, "give --memory-budget")
    budget = line.split("give --memory-budget ")[1].split(" ")[0]
    result = packctl("pack", corpus, "-o", out, "--capacity", "2097152", "--memory-budget", budget, "--shard-rows", "1",
                     "-q")
    assert result.code == 0, result.stderr
    assert_every_sample_once(out, [corpus])


# ---------------------------------------------------------------------------------------------
# --config FILE

CONFIG_BAD = [
    (b"capacity = [", "not valid TOML"),
    (b"\xff\xfecapacity = 64\n", "not UTF-8 text (byte 0)"),
    (b"capacity = 64\ncapacty = 32\n", "unknown key 'capacty'; did you mean 'capacity'?"),
    (b"pack = 3\n", "pack = 3: must be a table of options ([pack])"),
    (b"capacity = 64\n[pack]\nwindow = 10\n", "capacity is outside the [pack] table"),
    (b"too-long = 'split'\ntoo_long = 'drop'\n", "too-long and too_long are the same option; keep one"),
    (b"capacity = '4096'\n", 'capacity = "4096": must be a whole number'),
    (b"capacity = 4096.0\n", "capacity = 4096.0: must be a whole number"),
    (b"capacity = true\n", "capacity = true: must be a whole number"),
    (b"skip-empty = 1\n", "skip-empty = 1: must be true or false"),
    (b"[pack]\nseed = 1979-05-27\n", 'seed = "1979-05-27": must be a whole number'),
    (b"keep-columns = 'meta'\n", 'keep-columns = "meta": must be a list of column names'),
    (b"tokens-column = ['a']\n", 'tokens-column = ["a"]: must be a string'),
    (b"labels_column = 3\n", "labels_column = 3: must be a string"),
    (b"memory-budget = false\n", "memory-budget = false: must be a size such as 4GiB"),
    (b"attn-coeff = 'big'\n", 'attn-coeff = "big": must be a number'),
    (b"[pack.capacity]\nx = 1\n", 'capacity = {"x": 1}: must be a whole number'),
    (b"capacity = 0\n", "--capacity 0: must be a whole number >= 1"),
    (b"memory-budget = 'inf'\n", "--memory-budget 'inf': not a finite size"),
]


@pytest.mark.parametrize("text, mention", CONFIG_BAD, ids=[t.decode("latin-1")[:30] for t, _ in CONFIG_BAD])
def test_config_file_values_are_refused_naming_the_key(corpus, tmp_path, text, mention):
    config = tmp_path / "pack.toml"
    config.write_bytes(text)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", corpus, "-o", out, "--config", config), 2, mention)
    assert_nothing_left(out)


def test_config_inputs_of_the_wrong_type(tmp_path):
    config = tmp_path / "pack.toml"
    config.write_text("inputs = [1, 2]\n")
    assert_clean_error(packctl("pack", "--config", config, "-o", tmp_path / "out"), 2,
                       f"{config}: inputs = [1, 2]: must be a list of paths")


@pytest.mark.parametrize("what", ["directory", "missing", "unreadable"])
def test_a_config_path_that_is_not_a_readable_file(corpus, tmp_path, monkeypatch, what):
    config = tmp_path / "pack.toml"
    mention = {"directory": "is a directory; --config takes a TOML file", "missing": "config file not found",
               "unreadable": "cannot read the config file (Permission denied)"}[what]
    if what == "directory":
        config.mkdir()
    elif what == "unreadable":  # root reads any file: the refusal is simulated where it happens
        config.write_text("capacity = 16\n")

        def refuse(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))

        monkeypatch.setattr(Path, "read_bytes", refuse)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", corpus, "-o", out, "--config", config), 2, str(config), mention)
    assert_clean_error(packctl("stats", corpus, "--config", config), 2, str(config), mention)
    assert_nothing_left(out)


def test_a_config_file_with_a_byte_order_mark_is_read(corpus, tmp_path):
    config = tmp_path / "pack.toml"
    config.write_bytes("\ufeff[pack]\ncapacity = 16\ntoo-long = 'split'\n".encode())
    out = tmp_path / "out"
    assert packctl("pack", corpus, "-o", out, "--config", config, "-q").code == 0
    assert json.loads((out / "_manifest.json").read_text())["config"]["capacity"] == 16
    assert_every_sample_once(out, [corpus])


# ---------------------------------------------------------------------------------------------
# The Python API: what callers have at hand is taken, anything else refused before any work

def test_paths_and_numpy_scalars_are_taken(corpus, tmp_path):
    out = tmp_path / "out"
    result = pack(PackConfig(inputs=(Path(corpus),), output=out, capacity=np.int64(16), seed=np.uint32(3),
                             shard_rows=np.int32(2), skip_empty=np.bool_(False), pad_token_id=np.int16(0),
                             order="shuffle", keep_columns=()))
    assert result.output == out
    config = json.loads((out / "_manifest.json").read_text())["config"]
    assert config["output"] == str(out) and config["inputs"] == [str(corpus)]
    assert (config["capacity"], config["seed"], config["shard_rows"]) == (16, 3, 2)
    assert_every_sample_once(out, [corpus])


def test_numpy_floats_are_taken(corpus, tmp_path):
    out = tmp_path / "out"
    pack(PackConfig(inputs=[corpus], output=str(out), capacity=16, dp_size=np.int64(2), micro_batches=np.int8(1),
                    attn_coeff=np.float32(0.5), ref_batch_size=np.float64(64.0), lr_scaling="sqrt"))
    config = json.loads((out / "_manifest.json").read_text())["config"]
    assert (config["attn_coeff"], config["ref_batch_size"], config["dp_size"]) == (0.5, 64.0, 2)
    assert_every_sample_once(out, [corpus])


API_BAD = [
    ({"inputs": "data"}, "--inputs 'data': must be a list of paths"),
    ({"inputs": Path("data")}, "--inputs PosixPath('data'): must be a list of paths"),
    ({"inputs": [b"a.parquet"]}, "--inputs [b'a.parquet']: must be a list of paths"),
    ({"inputs": None}, "--inputs None: must be a list of paths"),
    ({"output": None}, "--output None: must be a string"),
    ({"output": b"out"}, "--output b'out': must be a string"),
    ({"capacity": "4096"}, "--capacity '4096': must be a whole number"),
    ({"capacity": 4096.0}, "--capacity 4096.0: must be a whole number"),
    ({"capacity": True}, "--capacity True: must be a whole number"),
    ({"capacity": np.float64(16)}, "--capacity 16.0: must be a whole number"),
    ({"capacity": None}, "--capacity None: must be a whole number"),
    ({"seed": [1]}, "--seed [1]: must be a whole number"),
    ({"too_long": None}, "--too-long None: must be a string"),
    ({"tokens_column": Path("input_ids")}, "--tokens-column PosixPath('input_ids'): must be a string"),
    ({"labels_column": 3}, "--labels-column 3: must be a string (or unset)"),
    ({"keep_columns": "meta"}, "--keep-columns 'meta': must be a list of column names"),
    ({"overwrite": 1}, "--overwrite 1: must be true or false"),
    ({"overwrite": "yes"}, "--overwrite 'yes': must be true or false"),
    ({"memory_budget": True}, "--memory-budget True: must be a size such as 4GiB"),
    ({"memory_budget": [1]}, "--memory-budget [1]: must be a size such as 4GiB"),
    ({"memory_budget": float("inf")}, "--memory-budget inf: not a finite size"),
    ({"attn_coeff": "1"}, "--attn-coeff '1': must be a number"),
    ({"max_seqs_per_bin": 2.5}, "--max-seqs-per-bin 2.5: must be a whole number of sequences (or unset)"),
    ({"pad_token_id": np.float32(0)}, "--pad-token-id 0.0: must be a whole number"),
]


@pytest.mark.parametrize("bad, mention", API_BAD, ids=[repr(b)[:40] for b, _ in API_BAD])
def test_api_refuses_a_value_of_the_wrong_type_before_any_work(corpus, tmp_path, monkeypatch, bad, mention):
    from packctl.pipeline import run

    def no_reading(*args, **kwargs):
        raise AssertionError("the inputs were read before the options were checked")

    monkeypatch.setattr(run, "index_inputs", no_reading)
    out = tmp_path / "out"
    options = {"inputs": [str(corpus)], "output": str(out), "capacity": 16, **bad}
    with pytest.raises(PackctlError) as caught:
        pack(PackConfig(**options))
    assert mention in str(caught.value) and "\n" not in str(caught.value)
    assert_nothing_left(out)


def test_every_option_is_checked_to_go_into_the_manifest(corpus, tmp_path, monkeypatch):
    """The last guard: a value that passed the type checks but cannot be written as JSON is refused
    before any work, not after the run (where writing _manifest.json would fail)."""
    from packctl import config

    monkeypatch.setattr(config, "_type_problem", lambda name, value: None)
    with pytest.raises(PackctlError, match=r"--tokens-column 1j: cannot be recorded in the manifest"):
        PackConfig(inputs=[str(corpus)], output=str(tmp_path / "out"), tokens_column=1j).validate()


# ---------------------------------------------------------------------------------------------
# packctl sample

SAMPLE_BAD = [
    (["--sequences", "0"], "--sequences 0: must be in [1, 2,147,483,647]"),
    (["--sequences", "-3"], "--sequences -3: must be in [1,"),
    (["--sequences", BIG], "--sequences"),
    (["--sequences", "abc"], "Invalid value for '--sequences'"),
    (["--shards", "0"], "--shards 0: must be in [1,"),
    (["--shards", "100", "--sequences", "5"], "--shards 100 with --sequences 5: a shard would be empty; use --shards 5"),
    (["--seed", "-1"], "--seed -1: must be in [0,"),
    (["--vocab-size", "1"], "--vocab-size 1: must be in [2, 2,147,483,648]"),
    (["--vocab-size", str(2**31 + 1)], "--vocab-size 2147483649: must be in [2, 2,147,483,648]"),
    (["--max-length", "0"], "--max-length 0: must be in [1, 2,147,483,647]"),
    (["--max-length", BIG], "--max-length"),
    (["--max-length", "1", "--groups", "preference"], "--max-length 1: a grouped row holds a prompt and a response"),
    (["--prompt-fraction", "2"], "--prompt-fraction 2.0: must be a share in [0, 1]"),
    (["--prompt-fraction", "-0.1"], "--prompt-fraction -0.1: must be a share in [0, 1]"),
    (["--prompt-fraction", "nan"], "--prompt-fraction nan: must be a share in [0, 1]"),
    (["--groups", "rollout", "--group-size", "1"], "--group-size 1: a rollout group holds 2 or more responses"),
    (["--groups", "rollout", "--group-size", BIG], "--group-size"),
    (["--distribution", "pareto"], "--distribution 'pareto': choose one of zipf, lognormal, rl-longtail"),
    (["--groups", "triples"], "--groups 'triples': choose one of none, preference, rollout"),
    (["--eos-id", "5"], "--eos-id 5: ids inside sequences are drawn from [1, 32000) (--vocab-size)"),
    (["--bos-id", "31999"], "--bos-id 31999: ids inside sequences are drawn from [1, 32000)"),
    (["--eos-id", "-1"], "--eos-id -1: must be in [0, 2,147,483,647]"),
    (["--bos-id", BIG], "--bos-id"),
    (["--eos-id", "x"], "Invalid value for '--eos-id'"),
    (["--eos-id", "32000", "--bos-id", "32001", "--max-length", "1"],
     "--max-length 1: a row that starts with --bos-id and ends with --eos-id holds 2 tokens or more"),
]


@pytest.mark.parametrize("args, mention", SAMPLE_BAD, ids=[" ".join(a)[:50] for a, _ in SAMPLE_BAD])
def test_sample_refuses_a_bad_option_before_writing(tmp_path, args, mention):
    out = tmp_path / "corpus"
    assert_clean_error(packctl("sample", "-o", out, "--sequences", "20", *args), 2, mention)
    assert not out.exists()


def test_sample_keeps_a_corpus_it_was_refused_to_replace(tmp_path):
    """A bad option with --overwrite leaves the existing corpus as it was."""
    out = tmp_path / "corpus"
    assert packctl("sample", "-o", out, "--sequences", "20").code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert_clean_error(packctl("sample", "-o", out, "--sequences", "0", "--overwrite"), 2, "--sequences 0")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_sample_overwrite_replaces_only_a_corpus(tmp_path):
    """--overwrite replaces a directory of shard files; one holding anything else (a home
    directory, `-o .`) is refused, and left as it was."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert_clean_error(packctl("sample", "-o", out, "--sequences", "20", "--overwrite"), 2,
                       f"{out}: holds notes.txt, which packctl sample did not write")
    assert (out / "notes.txt").read_text() == "keep me"


def test_sample_api_takes_numpy_and_refuses_other_types(tmp_path):
    paths = write_sample(tmp_path / "c", SampleSpec(sequences=np.int64(12), shards=np.int32(2),
                                                    prompt_fraction=np.float32(0.25), seed=np.uint8(1)))
    assert len(paths) == 2 and sum(pq.ParquetFile(p).metadata.num_rows for p in paths) == 12
    for bad, mention in [({"sequences": "10"}, "--sequences '10': must be a whole number"),
                         ({"shards": 2.0}, "--shards 2.0: must be a whole number"),
                         ({"prompt_fraction": "half"}, "--prompt-fraction 'half': must be a number"),
                         ({"groups": None}, "--groups None: must be a string"),
                         ({"seed": True}, "--seed True: must be a whole number")]:
        with pytest.raises(PackctlError) as caught:
            write_sample(tmp_path / "d", SampleSpec(**bad))
        assert mention in str(caught.value)
        assert not (tmp_path / "d").exists()


def test_sample_of_one_token_sequences(tmp_path):
    """--max-length 1 makes a corpus of one-token rows (no prompt to mask), and pack takes it."""
    corpus = tmp_path / "c"
    assert packctl("sample", "-o", corpus, "--sequences", "9", "--shards", "3", "--max-length", "1").code == 0
    lengths = [len(row) for p in sorted(corpus.iterdir()) for row in pq.read_table(p).column("input_ids").to_pylist()]
    assert lengths == [1] * 9
    out = tmp_path / "out"
    assert packctl("pack", corpus, "-o", out, "--capacity", "4", "-q").code == 0
    assert_every_sample_once(out, [corpus])


# ---------------------------------------------------------------------------------------------
# packctl verify, stats, export

VERIFY_BAD = [
    (["--sample", "-1"], "--sample -1: must be in [0,"),
    (["--heads", "0"], "--heads 0: must be in [1, 256]"),
    (["--heads", BIG], "--heads"),
    (["--head-dim", "12"], "--head-dim 12: must be a multiple of 8 in [8, 256]"),
    (["--head-dim", "512"], "--head-dim 512: must be in [8, 256]"),
    (["--seed", "-1"], "--seed -1: must be in [0,"),
    (["--seed", BIG], "--seed"),
    (["--cp-size", "0"], "--cp-size 0: must be in [1,"),
    (["--no-attention", "--backend", "magic"], "--backend 'magic': choose one of auto, flash-attn"),
    (["--no-attention", "--device", "tpu"], "--device 'tpu': choose one of auto, cpu, cuda"),
    (["--no-attention", "--dtype", "fp8"], "--dtype 'fp8': choose from fp32, bf16, fp16"),
    (["--sample", "x"], "Invalid value for '--sample'"),
]


@pytest.mark.parametrize("args, mention", VERIFY_BAD, ids=[" ".join(a)[:40] for a, _ in VERIFY_BAD])
def test_verify_refuses_a_bad_option(packed, args, mention):
    assert_clean_error(packctl("verify", packed, *args), 2, mention)


def test_verify_api_takes_paths_and_numpy(packed, corpus):
    report = verify(packed, VerifyOptions(source=[Path(corpus)], attention=False, sample=np.int64(2),
                                          seed=np.uint16(1)))
    assert report.ok
    with pytest.raises(PackctlError, match="--sample '8': must be a whole number"):
        verify(packed, VerifyOptions(sample="8"))
    with pytest.raises(PackctlError, match="--source 'data': must be a list of paths"):
        verify(packed, VerifyOptions(source="data"))


STATS_BAD = [
    (["--capacity", "0"], "--capacity 0: must be a whole number >= 1"),
    (["--capacity", BIG], "--capacity 1000000000000000000000000000000: must be at most 2,147,483,647"),
    (["--capacity", "64", "--capacity", "-1"], "--capacity -1"),
    (["--window", "0"], "--window 0: must be a whole number >= 1"),
    (["--pool-size", BIG], "--pool-size"),
    (["--seed", "-1"], "--seed -1: must be a whole number >= 0"),
    (["--too-long", "never"], "--too-long 'never': choose one of"),
    (["--capacity", "4096.0"], "--capacity '4096.0': must be a whole number of tokens"),
    (["--capacity", "64", "--capacity", "64.5"], "--capacity '64.5': must be a whole number of tokens"),
    (["--window", "1e5"], "--window '1e5': must be a whole number of sequences"),
]


@pytest.mark.parametrize("args, mention", STATS_BAD, ids=[" ".join(a)[:40] for a, _ in STATS_BAD])
def test_stats_refuses_a_bad_option(corpus, args, mention):
    assert_clean_error(packctl("stats", corpus, *args), 2, mention)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_stats_refuses_a_bad_attention_coefficient(packed, value):
    assert_clean_error(packctl("stats", packed, "--attn-coeff", value), 2, "--attn-coeff", "must be a number >= 0")


EXPORT_BAD = [
    (["--format", "nemo", "--eos-token-id", "-1"], "--eos-token-id -1: must be in [0, 2,147,483,647]"),
    (["--format", "olmo", "--eos-token-id", BIG], "--eos-token-id"),
    (["--format", "magic"], "--format 'magic': choose one of nemo, nemo-npy, olmo"),
    (["--format", "nemo", "--eos-token-id", "two"], "Invalid value for '--eos-token-id'"),
]


@pytest.mark.parametrize("args, mention", EXPORT_BAD, ids=[" ".join(a)[:40] for a, _ in EXPORT_BAD])
def test_export_refuses_a_bad_option_before_writing(packed, tmp_path, args, mention):
    target = tmp_path / "export"
    assert_clean_error(packctl("export", packed, "-o", target, *args), 2, mention)
    assert not target.exists()


def test_export_api_takes_a_numpy_eos_id(tmp_path):
    """OLMo-core's export records the EOS id in olmo.json: a numpy integer is written as a number."""
    corpus = write_table(tmp_path / "eos" / "a.parquet",
                         {"input_ids": pa.array([[5, 6, 2], [7, 2], [8, 9, 4, 2]], pa.list_(pa.int32()))})
    packed = tmp_path / "packed"
    assert packctl("pack", corpus, "-o", packed, "--capacity", "8", "-q").code == 0
    result = export(packed, tmp_path / "olmo", "olmo", eos_token_id=np.int32(2), vocab_size=np.int64(16))
    info = json.loads((tmp_path / "olmo" / "olmo.json").read_text())
    assert info["eos_token_id"] == 2 and info["vocab_size"] == 16
    assert result["format"] == "olmo"
    with pytest.raises(PackctlError, match="--overwrite 'yes': must be true or false"):
        export(packed, tmp_path / "x", "nemo", overwrite="yes")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# Usage: every command without what it needs

@pytest.mark.parametrize("args", [[], ["pack"]])
def test_a_command_alone_prints_its_help_and_exits_2(args):
    result = packctl(*args)
    assert result.code == 2 and "Usage: packctl" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, mention", [
    (["verify"], "Missing argument 'OUT'"),
    (["export"], "Missing argument 'OUT'"),
    (["export", "x"], "Missing option '--output'"),
    (["sample"], "Missing option '--output'"),
    (["stats"], "no PATH given"),
    (["nosuch"], "No such command 'nosuch'"),
    (["pack", "x", "-o"], "Option '-o' requires an argument"),
])
def test_a_command_without_what_it_needs(args, mention):
    assert_clean_error(packctl(*args), 2, mention)


# ---------------------------------------------------------------------------------------------
# Input columns: two of one name, and the list layouts of Arrow

def _table_with_duplicate(name: str, extra: dict | None = None) -> pa.Table:
    tokens = pa.array(_lists([2, 3]), pa.list_(pa.int32()))
    columns = {"input_ids": tokens, **(extra or {})}
    arrays, names = list(columns.values()), list(columns)
    arrays.append(columns[name])
    names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


@pytest.mark.parametrize("name, extra, flags", [
    ("input_ids", None, []),
    ("labels", {"labels": pa.array(_lists([2, 3]), pa.list_(pa.int32()))}, []),
    ("labels", {"labels": pa.array(_lists([2, 3]), pa.list_(pa.int32()))}, ["--labels-column", "labels"]),
    ("meta", {"meta": pa.array([1, 2])}, ["--keep-columns", "meta"]),
    ("w", {"w": pa.array([1.0, 2.0])}, ["--weight-column", "w"]),
    ("g", {"g": pa.array([1, 2])}, ["--group-column", "g"]),
])
def test_two_input_columns_of_one_name(tmp_path, name, extra, flags):
    path = tmp_path / "in" / "a.parquet"
    path.parent.mkdir()
    pq.write_table(_table_with_duplicate(name, extra), path)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", path, "-o", out, "--capacity", "8", *flags), 2,
                       f"{path}: 2 columns are named '{name}'", "a name of its own")
    assert_nothing_left(out)


def test_two_columns_of_one_name_that_packctl_does_not_read(tmp_path):
    """Only the columns packctl reads must have a name of their own. (The checker reads the file
    without the twin column: it cannot read one that has it; the sample ids are the same.)"""
    path = tmp_path / "in" / "a.parquet"
    path.parent.mkdir()
    table = _table_with_duplicate("meta", {"meta": pa.array([1, 2])})
    pq.write_table(table, path)
    plain = write_table(tmp_path / "plain" / "a.parquet", {"input_ids": table.column(0)})
    out = tmp_path / "out"
    assert packctl("pack", path, "-o", out, "--capacity", "8", "-q").code == 0
    assert_every_sample_once(out, [plain])


def _layout(kind: str, rows: list[list[int]], value_type: pa.DataType) -> pa.Array:
    """`rows` in the Arrow list layout `kind` (list views with their rows stored back to front)."""
    flat = pa.array([v for row in rows for v in row], value_type)
    lengths = [len(r) for r in rows]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    if kind == "fixed_size_list":
        return pa.FixedSizeListArray.from_arrays(flat, lengths[0])
    if kind == "large_list":
        return pa.LargeListArray.from_arrays(pa.array([*starts, sum(lengths)], pa.int64()), flat)
    back = [v for row in rows[::-1] for v in row]  # values stored in another order than the rows
    back_starts = [sum(lengths[k + 1:]) for k in range(len(rows))]
    cls, offset_type = {"list_view": (pa.ListViewArray, pa.int32()),
                        "large_list_view": (pa.LargeListViewArray, pa.int64())}[kind]
    return cls.from_arrays(pa.array(back_starts, offset_type), pa.array(lengths, offset_type),
                           pa.array(back, value_type))


@pytest.mark.parametrize("kind, value_type", [
    ("fixed_size_list", pa.int32()), ("fixed_size_list", pa.uint16()), ("list_view", pa.int64()),
    ("list_view", pa.int8()), ("large_list_view", pa.int32()), ("large_list", pa.uint32()),
])
def test_tokens_in_any_list_layout_are_read(tmp_path, kind, value_type):
    """Every sample once: checked against the same rows written as plain lists (the checker reads
    those; the sample ids are the same, one file)."""
    fixed = kind == "fixed_size_list"
    rows = _lists([4] * 6 if fixed else [3, 1, 4, 1, 5, 9], start=1)
    labels = [[-100] + r[1:] for r in rows] if value_type.id in (pa.int64().id, pa.int32().id, pa.int8().id) else rows
    path = tmp_path / "in" / "a.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"input_ids": _layout(kind, rows, value_type),
                             "labels": _layout(kind, labels, value_type)}), path)
    plain = write_table(tmp_path / "plain" / "a.parquet", {"input_ids": pa.array(rows, pa.list_(pa.int64())),
                                                           "labels": pa.array(labels, pa.list_(pa.int64()))})
    out = tmp_path / "out"
    result = packctl("pack", path, "-o", out, "--capacity", "16", "-q")
    assert result.code == 0, result.stderr
    assert_every_sample_once(out, [plain])
    stats = packctl("stats", path, "--capacity", "16", "--json")
    assert stats.code == 0, stats.stderr
    assert json.loads(stats.stdout)["sequences"] == len(rows)


def test_values_are_range_checked_in_every_layout(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"input_ids": _layout("list_view", [[1, 2], [3, 2**31]], pa.int64())}), path)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", path, "-o", out, "--capacity", "8", "-q"), 2,
                       f"{path} row 1 column 'input_ids': value 2147483648 at position 1 is outside [0, 2147483647]")
    assert_nothing_left(out)


def test_a_null_row_in_a_fixed_size_list(tmp_path):
    path = tmp_path / "a.parquet"
    tokens = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4], pa.int32()), 2, mask=pa.array([False, True]))
    pq.write_table(pa.table({"input_ids": tokens}), path)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", path, "-o", out, "--capacity", "8", "-q"), 2,
                       f"{path} row 1 column 'input_ids': null instead of a list")
    assert_nothing_left(out)


@pytest.mark.parametrize("values, name", [
    (pa.FixedSizeListArray.from_arrays(pa.array(["a", "b", "c", "d"]), 2), "fixed_size_list<string>[2]"),
    (pa.ListViewArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array([1, 1], pa.int32()),
                                  pa.array([1.5, 2.5])), "list_view<double>"),
    (pa.LargeListArray.from_arrays(pa.array([0, 1, 2], pa.int64()), pa.array(["x", "y"])), "large_list<string>"),
    (pa.array(["a", "b"]).dictionary_encode(), "dictionary<string>"),
    (pa.array([{"a": 1}, {"a": 2}], pa.struct([("a", pa.int32())])), "struct<a: int32>"),
])
def test_type_names_in_messages_say_what_the_column_is(tmp_path, values, name):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"input_ids": values}), path)
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", path, "-o", out), 2,
                       f"{path}: column 'input_ids' is {name}; tokens must be a list of integers")
    assert_nothing_left(out)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install 'packctl[mpi]')")
@pytest.mark.parametrize("config_text, mention", [("capacity = 'big'\n", 'capacity = "big": must be a whole number'),
                                                  ("capacity = 0\n", "--capacity 0: must be a whole number >= 1")])
def test_under_mpi_a_bad_option_is_printed_once(corpus, tmp_path, config_text, mention):
    """Every rank reads the same file and flags and finds the same error: rank 0 says it, once."""
    config = tmp_path / "pack.toml"
    config.write_text(config_text)
    out = tmp_path / "out"
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out),
                           "--config", str(config)], capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(mention) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert_nothing_left(out)


# ---------------------------------------------------------------------------------------------
# packctl export --format olmo: what OLMo-core would read otherwise is refused, and nothing is left

def _olmo_packed(tmp_path: Path, rows: list[list[int]], *pack_args: str) -> Path:
    corpus = write_table(tmp_path / "in" / "a.parquet", {"input_ids": pa.array(rows, pa.list_(pa.int32()))})
    out = tmp_path / "packed"
    result = packctl("pack", corpus, "-o", out, "-q", *pack_args)
    assert result.code == 0, result.stderr
    return out


OLMO = ["--format", "olmo"]
# EOS 2, BOS 1; capacity 8: packs [1 5 2 | 1 6 6 2 | pad] ...
EOS_ROWS = [[5, 6, 2], [7, 2], [8, 9, 4, 2], [3, 3, 3, 3, 2]]
BOS_ROWS = [[1, 5, 2], [1, 6, 6, 2], [1, 7, 7, 7, 7, 2]]
OLMO_BAD = [
    # (rows, pack args, export args, mentions)
    (EOS_ROWS, [], ["--eos-token-id", "2"], ["--format olmo needs --vocab-size", "vocab_size"]),
    (EOS_ROWS, [], ["--vocab-size", "16"], ["--format olmo needs --eos-token-id"]),
    (EOS_ROWS, [], ["--eos-token-id", "2", "--vocab-size", "0"], ["--vocab-size 0: must be in [1, "]),
    (EOS_ROWS, [], ["--eos-token-id", "2", "--vocab-size", "2147483649"], ["--vocab-size 2147483649"]),
    (EOS_ROWS, [], ["--eos-token-id", "2", "--vocab-size", "8"], ["row 1 (pack 1 of the output), sequence 0",
                                                                 "token id 8 is not below --vocab-size 8"]),
    (EOS_ROWS, [], ["--eos-token-id", "20", "--vocab-size", "16"], ["--eos-token-id 20: not below --vocab-size 16"]),
    (EOS_ROWS, [], ["--eos-token-id", "2", "--bos-token-id", "16", "--vocab-size", "16"], ["--bos-token-id 16"]),
    (EOS_ROWS, ["--pad-token-id", "2"], ["--eos-token-id", "2", "--vocab-size", "16"],
     ["packed with --pad-token-id 2, the EOS id", "pack with another --pad-token-id"]),
    (EOS_ROWS, ["--pad-token-id", "20"], ["--eos-token-id", "2", "--vocab-size", "16"],
     ["the output's --pad-token-id 20: not below --vocab-size 16"]),
    # BOS-less data read with a BOS id would join documents: refused, naming the pack
    (EOS_ROWS, [], ["--eos-token-id", "2", "--bos-token-id", "1", "--vocab-size", "16"],
     ["row 0 (pack 0 of the output), sequence 0 of the pack: does not start with the BOS id 1"]),
    (BOS_ROWS, [], ["--eos-token-id", "2", "--bos-token-id", "3", "--vocab-size", "16"],
     ["sequence 0 of the pack: does not start with the BOS id 3"]),
    (EOS_ROWS, [], ["--eos-token-id", "3", "--vocab-size", "16"], ["does not end with the EOS id 3",
                                                                   "--too-long drop"]),
    (EOS_ROWS + [[6, 2, 6, 2]], [], ["--eos-token-id", "2", "--vocab-size", "16"],
     ["token 1 is the EOS id 2 inside the sequence"]),
    ([[1, 5, 2, 1, 6, 2]], [], ["--eos-token-id", "2", "--bos-token-id", "1", "--vocab-size", "16"],
     ["token 2 is the EOS id 2 followed by the BOS id 1 inside the sequence"]),
    # a 1-token tail is a document only without the BOS id, and the EOS inside needs it
    ([[1, 5, 2, 6, 2], [1, 2]], ["--capacity", "8"], ["--eos-token-id", "2", "--bos-token-id", "1", "--vocab-size",
                                                      "16"],
     ["row 0 (pack 0 of the output): 1 token of padding", "holds the EOS id 2 before its end",
      "no pack ends with exactly 1 token of padding"]),
    (EOS_ROWS, [], ["--eos-token-id", "2", "--vocab-size", "16", "--format", "nemo"], []),
]


@pytest.mark.parametrize("rows, pack_args, args, mentions", OLMO_BAD,
                         ids=[" ".join(a)[:60] + str(i) for i, (_, _, a, _) in enumerate(OLMO_BAD)])
def test_olmo_export_refusals_leave_nothing(tmp_path, rows, pack_args, args, mentions):
    packed = _olmo_packed(tmp_path, rows, *(pack_args or ["--capacity", "8"]))
    target = tmp_path / "deep" / "er" / "olmo"  # missing parents: removed again
    result = packctl("export", packed, "-o", target, *OLMO, *args)
    if "nemo" in args:
        mentions = ["--vocab-size: applies to --format olmo and megatron only"]
    line = assert_clean_error(result, 2, *mentions)
    assert "truncate" not in line  # truncated pieces lose their EOS: never advised
    assert_nothing_left(target)
    assert not (tmp_path / "deep").exists()


def test_olmo_export_of_sequences_without_eos_leaves_no_label_mask(tmp_path):
    """The issue's case: data without EOS (sample_data) and --too-long truncate."""
    rows = [[5, 6, 7], [7, 8], [8, 9, 4, 5, 6, 7, 8, 9, 9, 9]]
    packed = _olmo_packed(tmp_path, rows, "--capacity", "8", "--too-long", "truncate")
    target = tmp_path / "olmo"
    line = assert_clean_error(packctl("export", packed, "-o", target, *OLMO, "--eos-token-id", "2", "--vocab-size",
                                      "16"), 2, "does not end with the EOS id 2", "--too-long drop")
    assert "truncate or" not in line and "--too-long truncate" not in line
    assert_nothing_left(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "packed"]


def test_olmo_export_with_bos_and_a_one_token_tail_reads_by_eos(tmp_path):
    """Sequences BOS ... EOS with no EOS inside and a pack ending with 1 token of padding: written,
    and olmo.json tells readers bos_token_id null (documents by EOS alone)."""
    packed = _olmo_packed(tmp_path, [[1, 5, 6, 2], [1, 7, 2]], "--capacity", "8")
    target = tmp_path / "olmo"
    result = packctl("export", packed, "-o", target, *OLMO, "--eos-token-id", "2", "--bos-token-id", "1",
                     "--vocab-size", "16", "--json")
    assert result.code == 0, result.stderr
    info = json.loads((target / "olmo.json").read_text())
    assert info["bos_token_id"] == 1 and info["tokenizer"]["bos_token_id"] is None
    assert info["token_dtype"] == "uint8"  # 16 ids
    assert np.fromfile(target / "part-00000.npy", np.uint8).tolist() == [1, 5, 6, 2, 1, 7, 2, 2]
    assert info["documents"] == 3 and info["padding_documents"] == 1
    assert json.loads(result.stdout)["tokenizer"] == info["tokenizer"]


def test_olmo_export_overwrite_replaces_a_previous_export(tmp_path):
    packed = _olmo_packed(tmp_path, EOS_ROWS, "--capacity", "8")
    target = tmp_path / "olmo"
    args = ("export", packed, "-o", target, *OLMO, "--eos-token-id", "2", "--vocab-size", "16")
    assert packctl(*args).code == 0
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert Path("label_mask/part-00000.npy") in before
    assert_clean_error(packctl(*args), 2, "exists; choose another -o or pass --overwrite")
    # a refused --overwrite keeps the previous export as it was
    assert_clean_error(packctl(*args[:-1], "8", "--overwrite"), 2, "not below --vocab-size 8")
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert packctl(*args, "--overwrite").code == 0
    assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "olmo", "packed"]
    (target / "label_mask" / "other").mkdir()
    assert_clean_error(packctl(*args, "--overwrite"), 2, "holds the directory label_mask")


def test_megatron_export_into_an_existing_directory(tmp_path):
    """Without --overwrite an existing -o (a previous export, or any directory) is refused and left as
    it was; a refused --overwrite keeps the previous export; --overwrite replaces it when complete."""
    packed = _olmo_packed(tmp_path, EOS_ROWS, "--capacity", "8")
    target = tmp_path / "megatron"
    args = ("export", packed, "-o", target, "--format", "megatron")
    assert packctl(*args).code == 0
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    assert sorted(before) == ["_packctl_export.json", "cu_seqlens.bin", "cu_seqlens.idx", "loss_mask.bin",
                              "loss_mask.idx", "megatron.json", "tokens.bin", "tokens.idx"]
    assert_clean_error(packctl(*args), 2, f"{target}: exists; choose another -o or pass --overwrite")
    assert_clean_error(packctl(*args, "--vocab-size", "8", "--overwrite"), 2,
                       "row 1 (pack 1 of the output)", "token id 8 is not in [0, 8)")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert packctl(*args, "--vocab-size", "100000", "--overwrite").code == 0  # int32 tokens now
    assert json.loads((target / "megatron.json").read_text())["token_dtype"] == "int32"
    assert (target / "tokens.bin").stat().st_size == 2 * len(before["tokens.bin"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "megatron", "packed"]
    other = tmp_path / "other"
    (other / "keep").mkdir(parents=True)
    assert_clean_error(packctl("export", packed, "-o", other, "--format", "megatron"), 2, "exists")
    assert_clean_error(packctl("export", packed, "-o", other, "--format", "megatron", "--overwrite"), 2,
                       "holds the directory keep, which packctl export does not write")
    assert [p.name for p in other.iterdir()] == ["keep"]


def test_olmo_export_vocabulary_sets_the_dtype(tmp_path):
    packed = _olmo_packed(tmp_path, EOS_ROWS, "--capacity", "8")
    written = []
    for vocab, dtype in [(16, "uint8"), (257, "uint16"), (65536, "uint16"), (65537, "uint32")]:
        target = tmp_path / f"olmo-{vocab}"
        assert packctl("export", packed, "-o", target, *OLMO, "--eos-token-id", "2", "--vocab-size", str(vocab)).code == 0
        info = json.loads((target / "olmo.json").read_text())
        assert info["token_dtype"] == dtype and info["vocab_size"] == vocab
        tokens = np.fromfile(target / "part-00000.npy", dtype)
        assert len(tokens) == info["instances"] * 8
        written.append(tokens.tolist())
    assert written[0] == written[1] == written[2] == written[3]


def test_export_directory_takes_the_umask_and_a_link_is_not_replaced(tmp_path):
    packed = _olmo_packed(tmp_path, EOS_ROWS, "--capacity", "8")
    target = tmp_path / "olmo"
    assert packctl("export", packed, "-o", target, *OLMO, "--eos-token-id", "2", "--vocab-size", "16").code == 0
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~mask  # not a private temporary directory's 0700
    link = tmp_path / "link"
    link.symlink_to(target)
    assert_clean_error(packctl("export", packed, "-o", link, *OLMO, "--eos-token-id", "2", "--vocab-size", "16",
                               "--overwrite"), 2, "a symbolic link; --overwrite replaces a directory")
    assert (target / "olmo.json").is_file()


# --balance-cost COL: the sum of a --limit column, balanced with the --dp-size cost. Each case is
# refused before any work: exit 2, one line naming the option and the fix, nothing left.
@pytest.fixture(scope="module")
def vlm_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm") / "in"
    write_sample(root, SampleSpec(sequences=60, shards=1, max_length=2048, modality="image", seed=1))
    return root


@pytest.mark.parametrize("args, mentions", [
    (["--dp-size", "2", "--micro-batches", "1", "--limit", "images=8", "--balance-cost", "image_tokens"],
     ["--balance-cost image_tokens", "not a limited column", "--limit images=8", "add --limit image_tokens=N"]),
    (["--dp-size", "2", "--micro-batches", "1", "--balance-cost", "images"],
     ["--balance-cost images", "no --limit"]),
    (["--limit", "images=8", "--balance-cost", "images"], ["--balance-cost", "need --dp-size"]),
    (["--balance-cost", "images"], ["--balance-cost", "need --dp-size"]),
    (["--dp-size", "2", "--micro-batches", "1", "--limit", "images=8", "--balance-cost", ""],
     ["--balance-cost ", "not a limited column"]),
], ids=["not-limited", "no-limit", "no-dp-size", "nothing-else", "empty-name"])
def test_balance_cost_refused(vlm_corpus, tmp_path, args, mentions):
    out = tmp_path / "out"
    assert_clean_error(packctl("pack", vlm_corpus, "-o", out, "--capacity", "2048", "--too-long", "drop", *args),
                       2, *mentions)
    assert_nothing_left(out)
    # the what-if plans what pack would: the same refusal
    assert_clean_error(packctl("stats", vlm_corpus, "--capacity", "2048", "--too-long", "drop", *args), 2,
                       *mentions)


def test_balance_cost_of_a_column_the_input_lacks(vlm_corpus, tmp_path):
    out = tmp_path / "out"
    args = ["--capacity", "2048", "--too-long", "drop", "--dp-size", "2", "--micro-batches", "1",
            "--limit", "frames=4", "--balance-cost", "frames"]
    assert_clean_error(packctl("pack", vlm_corpus, "-o", out, *args), 2, "frames")
    assert_nothing_left(out)
    assert_clean_error(packctl("stats", vlm_corpus, *args), 2, "no column 'frames'", "--limit frames=N")


def test_balance_cost_in_a_config_file(vlm_corpus, tmp_path):
    config = tmp_path / "pack.toml"
    config.write_text('capacity = 2048\ndp_size = 2\nmicro_batches = 2\nlimit = {images = 8}\nbalance_cost = "images"\n')
    out = tmp_path / "out"
    assert packctl("pack", vlm_corpus, "-o", out, "--config", config, "-q").code == 0
    assert json.loads((out / "_metrics.json").read_text())["balance"]["balance_cost"] == "images"
    assert json.loads((out / "_manifest.json").read_text())["config"]["balance_cost"] == "images"
    assert_every_sample_once(out, [vlm_corpus])
    bad = tmp_path / "bad.toml"
    bad.write_text('capacity = 2048\ndp_size = 2\nmicro_batches = 2\nlimit = {images = 8}\nbalance_cost = 3\n')
    assert_clean_error(packctl("pack", vlm_corpus, "-o", tmp_path / "o2", "--config", bad), 2, "balance_cost")
    assert_nothing_left(tmp_path / "o2")


def test_stats_of_an_output_refuses_limit_and_balance_cost(vlm_corpus, tmp_path):
    out = tmp_path / "out"
    assert packctl("pack", vlm_corpus, "-o", out, "--capacity", "2048", "--too-long", "drop", "--limit",
                   "images=8", "-q").code == 0
    assert_clean_error(packctl("stats", out, "--limit", "images=4"), 2, "is a packed output", "--limit")
    assert_clean_error(packctl("stats", out, "--balance-cost", "images"), 2, "is a packed output", "--balance-cost")


# --- --limit COL=N ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_images(tmp_path_factory) -> Path:
    """The 12 sequences of `corpus` with an int32 `images` column (0 on text rows) and a float one."""
    path = tmp_path_factory.mktemp("images") / "a.parquet"
    tokens = pa.array(_lists(LENGTHS), pa.list_(pa.int32()))
    images = [0, 1, 0, 2, 3, 0, 1, 0, 0, 2, 1, 0]
    return write_table(path, {"input_ids": tokens, "labels": tokens, "images": pa.array(images, pa.int32()),
                              "ratio": pa.array([0.5] * 12, pa.float64())})


@pytest.mark.parametrize("spelling, mentions", [
    ("images", ["--limit 'images'", "COL=N"]),  # no =
    ("=8", ["--limit '=8'", "COL=N"]),  # no column
    ("images=", ["--limit 'images='", "whole number"]),
    ("images=0", ["--limit images=0", "[1, 2,147,483,647]"]),
    ("images=-3", ["--limit images=-3", "[1, 2,147,483,647]"]),
    ("images=2.5", ["--limit 'images=2.5'", "whole number"]),
    ("images=1e3", ["--limit 'images=1e3'", "whole number"]),
    ("images=--5", ["--limit 'images=--5'", "whole number"]),  # signs that int() refuses
    ("images=+-3", ["--limit 'images=+-3'", "whole number"]),
    ("images=\u00b2", ["--limit 'images=\u00b2'", "whole number"]),  # a digit to str.isdigit, not to int()
    (f"images={BIG}", ["--limit images=", "2,147,483,647"]),  # huge
    ("input_ids=8", ["--limit input_ids=8", "tokens"]),  # the tokens column
    ("labels=8", ["--limit labels=8", "tokens, the labels"]),
    ("num_tokens=8", ["--limit num_tokens=8", "packctl writes"]),  # an output column
    ("seq=8", None),  # fine here; its sum name is not taken
])
def test_bad_limit_spellings(with_images, tmp_path, spelling, mentions):
    out = tmp_path / "out"
    result = packctl("pack", str(with_images), "-o", str(out), "--capacity", "16", "--limit", spelling, "-q")
    if mentions is None:  # a name of no input column: refused from the footer, naming the file
        assert_clean_error(result, 2, "a.parquet", "no column 'seq'", "--limit seq=N")
    else:
        assert_clean_error(result, 2, *mentions)
    assert_nothing_left(out)


def test_a_limit_given_twice_is_refused(with_images, tmp_path):
    result = packctl("pack", str(with_images), "-o", str(tmp_path / "out"), "--capacity", "16",
                     "--limit", "images=4", "--limit", "images=5", "-q")
    assert_clean_error(result, 2, "--limit images is given twice", "keep one")
    assert_nothing_left(tmp_path / "out")


def test_a_limited_column_that_is_also_kept_is_refused(with_images, tmp_path):
    result = packctl("pack", str(with_images), "-o", str(tmp_path / "out"), "--capacity", "16",
                     "--limit", "images=4", "--keep-columns", "images", "-q")
    assert_clean_error(result, 2, "--keep-columns images", "drop images from --keep-columns")
    assert_nothing_left(tmp_path / "out")


def test_a_limit_whose_sum_name_is_another_limit_is_refused(with_images, tmp_path):
    result = packctl("pack", str(with_images), "-o", str(tmp_path / "out"), "--capacity", "16",
                     "--limit", "images=4", "--limit", "images_sum=4", "-q")
    assert_clean_error(result, 2, "images_sum", "rename")
    assert_nothing_left(tmp_path / "out")


def test_a_limit_with_batch_mode_is_refused(with_images, tmp_path):
    result = packctl("pack", str(with_images), "-o", str(tmp_path / "out"), "--capacity", "16", "--mode", "batch",
                     "--limit", "images=4", "-q")
    assert_clean_error(result, 2, "--limit", "--mode batch")
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("value, mentions", [
    ({"images": 2.5}, ["--limit images=2.5", "whole number"]),
    ({"images": True}, ["--limit images=True", "whole number"]),
    ({"images": 0}, ["--limit images=0"]),
    ("images=4", ["--limit", "table of column = limit"]),
])
def test_bad_limits_in_a_config_file_and_the_api(with_images, tmp_path, value, mentions):
    with pytest.raises(PackctlError) as caught:
        pack(PackConfig(inputs=[str(with_images)], output=str(tmp_path / "out"), capacity=16, limits=value))
    assert all(m in str(caught.value) for m in mentions), caught.value
    assert_nothing_left(tmp_path / "out")


def test_limits_from_a_config_file_and_flags(with_images, tmp_path):
    """TOML `limit = {images = 3}` is --limit images=3; the flag replaces the file's table."""
    config = tmp_path / "pack.toml"
    config.write_text("capacity = 16\nlimit = {images = 3}\n")
    out = tmp_path / "out"
    assert packctl("pack", str(with_images), "-o", str(out), "--config", str(config), "-q").code == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["layout"]["limits"] == {"images": 3} and manifest["config"]["limits"] == {"images": 3}
    assert_every_sample_once(out, [with_images])
    flagged = tmp_path / "flagged"
    assert packctl("pack", str(with_images), "-o", str(flagged), "--config", str(config), "--limit", "images=4",
                   "-q").code == 0
    assert json.loads((flagged / "_manifest.json").read_text())["layout"]["limits"] == {"images": 4}
    config.write_text("capacity = 16\nlimit = {images = 3.5}\n")
    result = packctl("pack", str(with_images), "-o", str(tmp_path / "bad"), "--config", str(config), "-q")
    assert_clean_error(result, 2, "--limit images=3.5", "whole number")
    assert_nothing_left(tmp_path / "bad")


def test_splitting_or_truncating_a_sample_with_media_is_refused(with_images, tmp_path):
    """Sample 10 (9 tokens, 1 image) is longer than --capacity 8: its media cannot be cut (sample 5,
    13 tokens and no image, could be)."""
    for policy in ("split", "truncate"):
        out = tmp_path / policy
        result = packctl("pack", str(with_images), "-o", str(out), "--capacity", "8", "--too-long", policy,
                         "--limit", "images=4", "-q")
        assert_clean_error(result, 2, "a.parquet row 10 column 'images'", "media cannot be cut",
                           f"--too-long {policy}", "--too-long drop")
        assert_nothing_left(out)


def test_a_sample_over_a_limit(with_images, tmp_path):
    """Sample 4 holds 3 images, over --limit images=2: named under error and split, dropped and
    counted under drop (verify --source accounts for it)."""
    for policy, mention in (("error", "pass --too-long drop"), ("split", "cannot cut media")):
        out = tmp_path / policy
        result = packctl("pack", str(with_images), "-o", str(out), "--capacity", "16", "--too-long", policy,
                         "--limit", "images=2", "-q")
        assert_clean_error(result, 2, "a.parquet row 4 column 'images'", "costs 3", "--limit images=2", mention)
        assert_nothing_left(out)
    out = tmp_path / "drop"
    assert packctl("pack", str(with_images), "-o", str(out), "--capacity", "16", "--too-long", "drop",
                   "--limit", "images=2", "-q").code == 0
    counts = json.loads((out / "_manifest.json").read_text())["counts"]
    assert counts["over_limit"] == 1 and counts["sequences_dropped"] == 1
    assert_every_sample_once(out, [with_images])
    report = verify(out, VerifyOptions(source=[str(with_images)], attention=False))
    assert report.ok, report.violations


def test_every_sample_over_a_limit_leaves_nothing_to_pack(with_images, tmp_path):
    result = packctl("pack", str(with_images), "-o", str(tmp_path / "out"), "--capacity", "16", "--too-long",
                     "drop", "--limit", "ratio=1", "-q")
    assert_clean_error(result, 2, "column 'ratio' is double", "whole number")  # a float column, from the footer
    assert_nothing_left(tmp_path / "out")

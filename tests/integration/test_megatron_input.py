"""Megatron indexed datasets as pack input, written by megatron-core's own IndexedDatasetBuilder: the
output's data columns are those of the same documents as Parquet (one row per document), byte for
byte, for any algorithm, order, over-long policy, block size and rank count; verify --source and
stats read the pair too; options that need Parquet columns are refused."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from packctl import PackConfig, PackctlError, pack
from packctl.output.outdir import Faults
from packctl.source import megatron
from packctl.stats.whatif import read_lengths
from packctl.verify import VerifyOptions, verify
from support.adversary import assert_clean_error, assert_nothing_left, packctl
from support.megatron import build_with_megatron, data_columns, random_documents, write_pair, write_twin
from support.threadcomm import run_ranks

NAMES = ("a", "b", "sub/c")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """Three pairs of mixed dtypes (uint16, int32, int64) under megatron/, their Parquet twins
    (small row groups) under parquet/: 300 documents of 1..3 sequences, a few empty."""
    root = tmp_path_factory.mktemp("megatron-input")
    for k, (name, dtype) in enumerate(zip(NAMES, (np.uint16, np.int32, np.int64))):
        documents = random_documents(11 + k, 100, high=60000, max_length=60, empty=0.03)
        build_with_megatron(root / "megatron" / name, documents, dtype)
        write_twin(root / "parquet" / f"{name}.parquet", documents, row_group_size=17)
    return root / "megatron", root / "parquet"


def pack_both(corpus, tmp_path, **options) -> tuple[Path, Path]:
    outs = []
    for source, name in zip(corpus, ("from-megatron", "from-parquet")):
        out = tmp_path / name
        pack(PackConfig(inputs=[str(source)], output=str(out), skip_empty=True, **options))
        outs.append(out)
    return outs[0], outs[1]


CASES = [
    dict(capacity=256, algorithm="ffd", too_long="split"),
    dict(capacity=256, algorithm="concat", too_long="truncate", order="input"),
    dict(capacity=128, algorithm="ffs", order="shuffle", seed=7, too_long="split", shard_rows=20),
    dict(capacity=256, algorithm="split", too_long="split", seq_multiple=8),
    dict(capacity=256, algorithm="bfd", order="curriculum", too_long="drop", dp_size=2, micro_batches=2),
]


@pytest.mark.parametrize("options", CASES, ids=[c["algorithm"] for c in CASES])
def test_the_same_documents_pack_to_the_same_data_columns_as_parquet(corpus, tmp_path, options):
    from_megatron, from_parquet = pack_both(corpus, tmp_path, **options)
    assert data_columns(from_megatron) == data_columns(from_parquet)
    manifests = [json.loads((out / "_manifest.json").read_text()) for out in (from_megatron, from_parquet)]
    assert [i["path"] for i in manifests[0]["inputs"]] == [f"{corpus[0]}/{n}.idx" for n in NAMES]
    assert [i["rows"] for i in manifests[0]["inputs"]] == [i["rows"] for i in manifests[1]["inputs"]]
    assert manifests[0]["counts"] == manifests[1]["counts"]
    assert manifests[0]["config"]["labels_column"] is None


def test_small_blocks_read_twice_and_several_ranks_write_the_same_bytes(corpus, tmp_path, monkeypatch):
    """Blocks of a few documents (cut by tokens and by documents), none kept in memory (read again
    in materialize), 1 and 3 in-process ranks: the bytes of the default run."""
    options = dict(inputs=[str(corpus[0])], capacity=128, too_long="split", order="shuffle", skip_empty=True)
    pack(PackConfig(output=str(tmp_path / "reference"), **options))
    monkeypatch.setattr(megatron, "BLOCK_TOKENS", 300)
    monkeypatch.setattr(megatron, "BLOCK_DOCUMENTS", 9)
    for ranks in (1, 3):
        out = tmp_path / f"ranks-{ranks}"
        config = PackConfig(output=str(out), memory_budget=2048, **options)
        results = run_ranks(ranks, lambda comm: pack(config, comm=comm))
        assert results[0].metrics["counts"]["sequences_in"] == 300
        assert sha256s(out) == sha256s(tmp_path / "reference")


def sha256s(out: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((out / "_manifest.json").read_text())["shards"]]


def test_verify_checks_every_document_against_the_pair(corpus, tmp_path):
    out = tmp_path / "out"
    pack(PackConfig(inputs=[str(corpus[0])], output=str(out), capacity=128, too_long="split", skip_empty=True))
    for source in (str(corpus[0]), f"{corpus[0]}/**/*.idx", f"{corpus[0]}/a", f"{corpus[0]}/a.bin"):
        sources = [source] if "/a" not in source else [source, f"{corpus[0]}/b", f"{corpus[0]}/sub/c.idx"]
        report = verify(out, VerifyOptions(source=sources, attention=False))
        assert report.checks["conservation"].status == "ok", report.checks["conservation"]
        assert report.checks["conservation"].details["samples"] == 300


@pytest.mark.torch
def test_verify_names_a_document_that_differs(tmp_path):
    documents = [[[1, 2, 3]], [[4, 5], [6]], [[7]]]
    idx = build_with_megatron(tmp_path / "c", documents)
    out = tmp_path / "out"
    pack(PackConfig(inputs=[str(idx)], output=str(out), capacity=8))
    st = idx.with_suffix(".bin").stat()
    build_with_megatron(tmp_path / "c", [[[1, 2, 3]], [[4, 9], [6]], [[7]]])
    os.utime(idx.with_suffix(".bin"), ns=(st.st_atime_ns, st.st_mtime_ns))
    report = verify(out, VerifyOptions(source=[str(idx)], attention=False))
    assert report.checks["conservation"].status == "failed"
    messages = [v.message for v in report.violations]
    assert any("c.idx document 1" in m and "token 1 of the sequence is 5, the source has 9" in m
               for m in messages), messages


def test_stats_reads_lengths_from_the_index_as_from_parquet(corpus):
    from_megatron = read_lengths([str(corpus[0])], skip_empty=True)
    from_parquet = read_lengths([str(corpus[1])], skip_empty=True)
    assert np.array_equal(from_megatron.lengths, from_parquet.lengths)
    assert from_megatron.describe(100) == f"{corpus[0]}/b.idx document 0"
    with pytest.raises(PackctlError, match=r"a.idx document \d+: empty document"):
        read_lengths([str(corpus[0])])
    result = packctl("stats", str(corpus[0]), "--capacity", "256", "--skip-empty", "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["sequences"] == 300


@pytest.mark.parametrize("option", [("--keep-columns", "x"), ("--weight-column", "w"), ("--group-column", "g"),
                                    ("--labels-column", "labels"), ("--tokens-column", "ids")])
def test_options_that_name_parquet_columns_are_refused(corpus, tmp_path, option):
    out = tmp_path / "out"
    result = packctl("pack", str(corpus[0]), "-o", str(out), "--capacity", "256", "--skip-empty", *option)
    assert_clean_error(result, 2, f"{option[0]}: names a Parquet column", "Megatron indexed dataset",
                       "drop the option")
    assert_nothing_left(out)
    if option[0] in ("--group-column", "--tokens-column"):
        result = packctl("stats", str(corpus[0]), "--capacity", "256", *option)
        assert_clean_error(result, 2, f"{option[0]}: names a Parquet column")


@pytest.mark.torch
def test_resume_refuses_a_pair_rewritten_after_the_crash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    documents = random_documents(1, 30, max_sequences=1, max_length=6)
    build_with_megatron(tmp_path / "data/c", documents)
    with pytest.raises(PackctlError, match="write failed"):
        pack(PackConfig(inputs=["data/c"], output="out", capacity=8, shard_rows=1),
             faults=Faults(fail_write_after_shards=1))
    result = packctl("pack", "data/c", "-o", "out", "--capacity", "8", "--shard-rows", "1", "--resume", "--json")
    assert result.code == 0, result.stderr  # unchanged: resumed
    assert json.loads(result.stdout)["metrics"]["throughput"]["resumed_shards"] == 1
    os.rename("out", "done")
    with pytest.raises(PackctlError, match="write failed"):
        pack(PackConfig(inputs=["data/c"], output="out", capacity=8, shard_rows=1),
             faults=Faults(fail_write_after_shards=1))
    bin_ = tmp_path / "data/c.bin"
    raw = bytearray(bin_.read_bytes())
    raw[0] ^= 1
    bin_.write_bytes(bytes(raw))
    result = packctl("pack", "data/c", "-o", "out", "--capacity", "8", "--shard-rows", "1", "--resume")
    assert_clean_error(result, 2, "--resume refused", "data/c.idx changed since that run read it",
                       "modification time, .idx header and ends")


def test_a_plan_of_a_megatron_input_reads_its_tokens_from_the_pair(corpus, tmp_path):
    """`--plan-only` on pairs: `packctl materialize` writes the shards a direct pack writes, the
    loader on the plan yields the materialized packs, and a pair changed since refuses the plan."""
    import shutil

    from packctl.pipeline.from_plan import materialize_plan
    from packctl.source.pieces import plan_source

    source = tmp_path / "pairs"
    shutil.copytree(corpus[0], source)
    write_pair(source / "zeros", [[[0, 0, 5, 0]], [[7, 0]]], np.uint16)  # tokens equal to the pad id (0)
    options = dict(capacity=128, too_long="split", order="shuffle", skip_empty=True, shard_rows=20)
    direct, plan, materialized = tmp_path / "direct", tmp_path / "plan", tmp_path / "materialized"
    pack(PackConfig(inputs=[str(source)], output=str(direct), **options))
    pack(PackConfig(inputs=[str(source)], output=str(plan), plan_only=True, **options))
    assert json.loads((plan / "_manifest.json").read_text())["kind"] == "plan"
    materialize_plan(plan, materialized)
    shas = [[s["sha256"] for s in json.loads((out / "_manifest.json").read_text())["shards"]]
            for out in (direct, materialized)]
    assert shas[0] == shas[1]
    counted = [json.loads((out / "_metrics.json").read_text())["throughput"]["tokens_equal_to_pad_id"]
               for out in (direct, plan, materialized)]
    assert counted[0] >= 4 and counted == [counted[0], None, counted[0]]  # a plan of pairs reads no token
    index, _ = plan_source(json.loads((plan / "_manifest.json").read_text()), plan / "_manifest.json")
    assert [f.path for f in index.files] == sorted(str(p) for p in source.rglob("*.idx"))

    idx = sorted(source.rglob("*.idx"))[0]
    bin_path = idx.with_suffix(".bin")
    data = bytearray(bin_path.read_bytes())
    data[-2:] = bytes([data[-1], data[-2]])  # the same size, other bytes, a new modification time
    bin_path.write_bytes(bytes(data))
    with pytest.raises(PackctlError, match=r"\.idx: not the source the plan .* was made from"):
        plan_source(json.loads((plan / "_manifest.json").read_text()), plan / "_manifest.json")
    result = packctl("materialize", str(plan), "-o", str(tmp_path / "again"))
    assert_clean_error(result, 2, "not the source the plan")
    assert_nothing_left(tmp_path / "again")


def test_an_over_long_document_is_refused_from_the_idx_before_any_token_is_read(tmp_path, monkeypatch):
    prefix = write_pair(tmp_path / "corpus", [[[1, 2, 3]], [list(range(1, 300))], [[4, 5]]])

    def no_decoding(*args, **kwargs):
        raise AssertionError("tokens decoded before --too-long error refused the document")

    monkeypatch.setattr(megatron, "decode_documents", no_decoding)
    result = packctl("pack", prefix, "-o", tmp_path / "out", "--capacity", "64", "-q")
    assert_clean_error(result, 2, f"{prefix} document 1", "299")

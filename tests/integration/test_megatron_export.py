"""`packctl export --format megatron` read back by megatron-core's own `IndexedDataset`
(megatron.core.datasets.indexed_dataset, a dev dependency): every pack's tokens, its sequence
boundaries (cu_seqlens_padded: the THD layout, alignment padding included), its true boundaries
(cu_seqlens) and its loss mask equal the THD output's, read with pyarrow, pack for pack.

Megatron-Bridge has no reader of packed `.bin/.idx` in a release (its packed SFT readers take
Parquet and NumPy: `--format nemo`), so megatron-core's IndexedDataset is the independent reader,
and the writer's bytes are compared with megatron-core's own `IndexedDatasetBuilder`.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from support.adversary import packctl
from support.data import write_table
from support.docs import run_docs_block
from support.runs import pack_to
from packctl.contract.manifest import EXPORT_MARK, sha256_file
from packctl.errors import PackctlError
from packctl.export import export

pytestmark = pytest.mark.torch  # megatron-core runs on torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                  reason="megatron-core is not installed (pip install -e '.[dev]')")

LAYOUTS = {
    "split": dict(capacity=512, too_long="split"),
    "cp2-multiple": dict(capacity=512, cp_size=2, pad_to="multiple", too_long="split"),
    "cp2-capacity": dict(capacity=512, cp_size=2, too_long="split"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_data):
    path = tmp_path_factory.mktemp("megatron-corpus") / "small.parquet"
    pq.write_table(pq.read_table(sorted(sample_data.glob("*.parquet"))[0]).slice(0, 120), path)
    return path


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def packed(request, tmp_path_factory, corpus):
    out = pack_to(tmp_path_factory.mktemp(request.param), [corpus], shard_rows=40, **LAYOUTS[request.param])[1]
    assert len(json.loads((out / "_manifest.json").read_text())["shards"]) > 1  # several shards
    return request.param, out


def thd_packs(out):
    """Per pack of the THD output, in output order: (input_ids, labels, cu_seqlens, cu_seqlens_padded)."""
    manifest = json.loads((out / "_manifest.json").read_text())
    packs = []
    for shard in manifest["shards"]:
        table = pq.read_table(out / shard["path"], columns=["input_ids", "labels", "cu_seqlens",
                                                            "cu_seqlens_padded"]).to_pydict()
        packs += [tuple(np.array(v) for v in row) for row in zip(*table.values())]
    return packs


def megatron_packs(target):
    """Per document of the export, as megatron-core's IndexedDataset reads it: (tokens, loss mask,
    cu_seqlens, boundaries = [0, cumsum(sequence lengths)]), and the token dtype."""
    tokens = indexed.IndexedDataset(str(target / "tokens"))
    mask = indexed.IndexedDataset(str(target / "loss_mask"))
    cu = indexed.IndexedDataset(str(target / "cu_seqlens"))
    docs = tokens.document_indices
    assert np.array_equal(mask.document_indices, docs) and np.array_equal(mask.sequence_lengths,
                                                                          tokens.sequence_lengths)
    assert np.array_equal(cu.document_indices, np.arange(len(docs)))  # one sequence per pack
    assert mask.index.dtype == np.uint8 and cu.index.dtype == np.int32
    packs = []
    for d in range(len(docs) - 1):
        a, b = int(docs[d]), int(docs[d + 1])
        lengths = tokens.sequence_lengths[a:b]
        packs.append((np.concatenate(tokens[a:b]), np.concatenate(mask[a:b]), cu[d].copy(),
                      np.concatenate([[0], np.cumsum(lengths)])))
    return packs, tokens.index.dtype


def assert_round_trip(out, target):
    expected, (got, dtype) = thd_packs(out), megatron_packs(target)
    assert len(got) == len(expected) > 0
    for (ids, labels, cu, cu_padded), (tokens, mask, got_cu, bounds) in zip(expected, got):
        assert np.array_equal(tokens, ids)
        assert np.array_equal(bounds, cu_padded)
        assert np.array_equal(got_cu, cu)
        target_of_next = np.append(labels[1:] != -100, False)
        assert np.array_equal(mask.astype(bool), target_of_next)
    return got, dtype


def test_megatron_export_round_trips(packed, tmp_path):
    name, out = packed
    result = export(out, tmp_path / "meg", "megatron")
    got, dtype = assert_round_trip(out, tmp_path / "meg")
    assert dtype == np.uint16  # ids below 32,000: Megatron's uint16
    info = json.loads((tmp_path / "meg" / "megatron.json").read_text())
    manifest = json.loads((out / "_manifest.json").read_text())
    assert info["packs"] == result["packs"] == len(got) == manifest["counts"]["packs"]
    assert info["sequences"] == result["sequences"] == sum(len(cu) - 1 for _, _, cu, _ in got)
    assert info["tokens"] == sum(len(t) for t, *_ in got)
    assert info["sequence_tokens"] == sum(int(cu[-1]) for _, _, cu, _ in got) == manifest["counts"]["tokens_packed"]
    assert info["loss_tokens"] == sum(int(m.sum()) for _, m, _, _ in got)
    assert info["align"] == (4 if name.startswith("cp2") else 1) and info["token_dtype"] == "uint16"
    assert info["source"]["manifest_sha256"] == sha256_file(out / "_manifest.json")
    assert (sorted(p.name for p in (tmp_path / "meg").iterdir()) ==
            sorted(result["files"] + ["megatron.json", EXPORT_MARK]))
    if name == "cp2-capacity":
        assert all(len(t) == 512 for t, *_ in got)
    if name.startswith("cp2"):  # every sequence with its alignment padding a multiple of 2 x cp
        assert all((np.diff(b) % 4 == 0).all() for *_, b in got)


def test_megatron_export_bytes_are_megatron_cores_own(packed, tmp_path):
    """The three files written as megatron-core's IndexedDatasetBuilder writes the same documents."""
    import torch

    _, out = packed
    export(out, tmp_path / "meg", "megatron")
    got, _ = megatron_packs(tmp_path / "meg")
    for name, dtype, document in (("tokens", np.uint16, lambda p: (p[0], np.diff(p[3]))),
                                  ("loss_mask", np.uint8, lambda p: (p[1], np.diff(p[3]))),
                                  ("cu_seqlens", np.int32, lambda p: (p[2], [len(p[2])]))):
        prefix = str(tmp_path / f"ref-{name}")
        builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for pack in got:
            values, lengths = document(pack)
            builder.add_document(torch.from_numpy(values.astype(np.int64)), list(map(int, lengths)))
        builder.finalize(prefix + ".idx")
        for ext in ("bin", "idx"):
            assert (tmp_path / "meg" / f"{name}.{ext}").read_bytes() == (tmp_path / f"ref-{name}.{ext}").read_bytes()


def test_megatron_export_of_each_epoch(corpus, tmp_path):
    """`pack --epochs 2`: each epoch's folder exports (export takes one epoch, as every reader)."""
    _, out = pack_to(tmp_path, [corpus], capacity=512, too_long="split", order="shuffle", epochs=2, shard_rows=40)
    for e in (0, 1):
        export(out / f"epoch-{e:05d}", tmp_path / f"meg{e}", "megatron")
        assert_round_trip(out / f"epoch-{e:05d}", tmp_path / f"meg{e}")
    assert (tmp_path / "meg0" / "tokens.bin").read_bytes() != (tmp_path / "meg1" / "tokens.bin").read_bytes()
    with pytest.raises(PackctlError):
        export(out, tmp_path / "root", "megatron")
    assert not (tmp_path / "root").exists()


def _ids_table(tmp_path, rows, shard_rows=2, **options):
    write_table(tmp_path / "in" / "a.parquet", {"input_ids": rows})
    return pack_to(tmp_path, [tmp_path / "in"], capacity=8, shard_rows=shard_rows, **options)[1]


@pytest.mark.parametrize("vocab, dtype", [(None, np.uint16), (65_499, np.uint16), (65_500, np.int32),
                                          (200_000, np.int32)])
def test_megatron_export_token_dtype(tmp_path, vocab, dtype):
    """Megatron's rule: uint16 for a vocabulary below 65,500 ids, else int32; from --vocab-size,
    or without it from the data's largest id."""
    out = _ids_table(tmp_path, [[5, 6, 7], [8, 9], [65_498, 3]])
    export(out, tmp_path / "meg", "megatron", vocab_size=vocab)
    assert assert_round_trip(out, tmp_path / "meg")[1] == dtype
    assert json.loads((tmp_path / "meg" / "megatron.json").read_text())["vocab_size"] == vocab


def test_megatron_export_widens_when_a_large_id_arrives_late(tmp_path, monkeypatch):
    """Without --vocab-size, shards written as uint16 are rewritten as int32 when a later shard holds
    an id of 65,499 or more (ids above uint16's range come back exactly)."""
    from packctl.export import megatron

    rows = [[5] * 7] * 3 + [[8] * 6 + [65_499], [70_000] * 6 + [2**31 - 1]]  # a pack each, in input order
    out = _ids_table(tmp_path, rows, shard_rows=1, order="input")
    assert len(json.loads((out / "_manifest.json").read_text())["shards"]) > 2
    widened, real = [], megatron.IndexedWriter.widen

    def widen(writer, dtype):
        widened.append((writer.bin_path.name, writer.dtype.name, writer.sequences))
        real(writer, dtype)

    monkeypatch.setattr(megatron.IndexedWriter, "widen", widen)
    export(out, tmp_path / "meg", "megatron")
    assert len(widened) == 1 and widened[0][:2] == ("tokens.bin", "uint16") and widened[0][2] > 0
    got, dtype = assert_round_trip(out, tmp_path / "meg")
    assert dtype == np.int32 and int(got[-1][0].max()) == 2**31 - 1
    assert sorted(p.name for p in (tmp_path / "meg").iterdir())[-1] == "tokens.idx"  # no side files left


@pytest.mark.parametrize("rows, options, vocab, mentions", [
    ([[5, 6, 7, 8, 9, 10], [8, 9, 10, 11, 16]], {}, 16, ["train-00001.parquet row 0 (pack 1 of the output)",
                                                        "token id 16 is not in [0, 16)"]),
    ([[5, 6, 7]], {"pad_token_id": 20}, 16, ["packed with --pad-token-id 20, not below --vocab-size 16"]),
])
def test_megatron_export_refuses_ids_beyond_the_vocabulary(tmp_path, rows, options, vocab, mentions):
    out = _ids_table(tmp_path, rows, shard_rows=1, **options)
    with pytest.raises(PackctlError) as refused:
        export(out, tmp_path / "meg", "megatron", vocab_size=vocab)
    for mention in mentions:
        assert mention in str(refused.value)
    assert not (tmp_path / "meg").exists()


def _files_open_under(directory: Path) -> list[str]:
    """The files this process holds open under `directory` (Linux: /proc/self/fd)."""
    fds = Path("/proc/self/fd")
    held = [os.path.realpath(fd) for fd in fds.iterdir()] if fds.is_dir() else []
    return [path for path in held if path.startswith(str(directory.resolve()) + os.sep)]


def test_megatron_export_refuses_labels_that_are_not_the_tokens(tmp_path):
    write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[5, 6, 7, 8]], "labels": [[-100, 6, 9, 8]]})
    _, out = pack_to(tmp_path, [tmp_path / "in"], capacity=8)
    with pytest.raises(PackctlError, match="row 0 .pack 0 of the output.: a label differs from its token") as refused:
        export(out, tmp_path / "meg", "megatron")
    # closed by the export itself, even while its frames live on in the error's traceback
    assert refused.tb is not None and _files_open_under(tmp_path) == []


def test_megatron_export_records_the_data_parallel_plan(corpus, tmp_path):
    _, out = pack_to(tmp_path, [corpus], capacity=512, too_long="split", dp_size=2, micro_batches=2)
    export(out, tmp_path / "meg", "megatron")
    assert_round_trip(out, tmp_path / "meg")
    info = json.loads((tmp_path / "meg" / "megatron.json").read_text())
    assert info["data_loader"] == {"shuffle": False, "dp_world_size": 2, "micro_batches": 2, "packs_per_step": 4}


def test_megatron_export_cli(packed, tmp_path):
    _, out = packed
    proc = packctl("export", out, "-o", tmp_path / "meg", "--format", "megatron", "--vocab-size", "32000", "--json")
    assert proc.code == 0, proc.stderr
    assert json.loads(proc.stdout)["files"] == ["tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx",
                                                "cu_seqlens.bin", "cu_seqlens.idx"]
    for flag in ("--eos-token-id", "--bos-token-id"):
        bad = packctl("export", out, "-o", tmp_path / "x", "--format", "megatron", flag, "2")
        assert bad.code == 2, bad.stderr
        assert f"{flag}: applies to --format" in bad.stderr and "megatron does not use it" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_the_documented_megatron_recipe_yields_packctls_thd_batches(packed, tmp_path):
    """docs/training.md "megatron-export": the dataset over the export yields, pack for pack, the
    tensors `collate_thd` makes of the THD output, and megatron-core's PackedSeqParams from them."""
    torch = pytest.importorskip("torch")
    from packctl.torch import PackedDataset, collate_thd

    _, out = packed
    export(out, tmp_path / "meg", "megatron")
    ns = run_docs_block("megatron-export", {"export_dir": tmp_path / "meg"})
    dataset, thd = ns["dataset"], PackedDataset(out)
    assert len(dataset) == len(thd)
    keys = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded")
    for i in range(len(thd)):
        got, want = dataset[i], collate_thd([thd[i]])
        for key in keys:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (i, key)
        assert got["max_seqlen"] == want["max_seqlen"]
        params = ns["packed_seq_params"](got)
        assert params.qkv_format == "thd" and torch.equal(params.cu_seqlens_q, want["cu_seqlens"])
        assert (params.cu_seqlens_q_padded is params.cu_seqlens_q) == torch.equal(want["cu_seqlens"],
                                                                                   want["cu_seqlens_padded"])


def test_megatron_in_packctl_in_between_megatron_out(tmp_path):
    """The whole way a Megatron user takes: a corpus written by megatron-core's own builder packs,
    verifies against its pairs, and exports to indexed datasets that megatron-core reads back,
    each pack's tokens the documents its sample_ids name, in order, each cut where its pieces are."""
    from support.megatron import build_with_megatron, random_documents

    documents = random_documents(21, 120, high=30000, max_length=70)
    idx = build_with_megatron(tmp_path / "corpus" / "web", documents, np.uint16)
    _, out = pack_to(tmp_path, [idx], capacity=128, too_long="split", seq_multiple=4)
    result = packctl("verify", str(out), "--source", str(idx), "--no-attention")
    assert result.code == 0, result.stdout + result.stderr
    export(out, tmp_path / "meg", "megatron")
    got, _ = assert_round_trip(out, tmp_path / "meg")
    joined = [np.array([t for sequence in document for t in sequence], dtype=np.int64) for document in documents]
    starts = {}
    manifest = json.loads((out / "_manifest.json").read_text())
    packs = [row for s in manifest["shards"] for row in pq.read_table(out / s["path"]).to_pylist()]
    assert len(packs) == len(got)
    for row, (tokens, _, cu, _) in zip(packs, got):
        for k, sample in enumerate(row["sample_ids"]):
            start = starts.get(sample, 0)
            piece = tokens[row["cu_seqlens_padded"][k]:row["cu_seqlens_padded"][k] + row["seq_lens"][k]]
            assert np.array_equal(piece, joined[sample][start:start + len(piece)]), (sample, start)
            starts[sample] = start + len(piece)
    assert all(starts.get(s, 0) == len(d) for s, d in enumerate(joined))  # every document whole, once

"""`packctl export`: each format read back by an independent reader, written here from the
published format (not from packctl's writer), round-trips tokens, boundaries and loss masks.

The NeMo reader follows Megatron-Bridge's packed SFT datasets: a row's sub-sequence [b, e) gives
tokens input_ids[b:e-1], labels input_ids[b+1:e] and loss mask loss_mask[b:e-1]; with
pad_seq_to_mult m > 1 the run-time length e-b-1 is a multiple of m and trailing EOS tokens without
loss are padding. What it yields is compared with the source sequences read by sample id.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.adversary import packctl
from support.runs import pack_to
from support.data import write_table
from packctl.errors import PackctlError
from packctl.export import export

EOS = 2
LAYOUTS = {
    "cp1": dict(capacity=512, too_long="split"),
    "cp2": dict(capacity=512, cp_size=2, pad_to="multiple", too_long="split"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_data) -> Path:
    path = tmp_path_factory.mktemp("export-corpus") / "small.parquet"
    pq.write_table(pq.read_table(sorted(sample_data.glob("*.parquet"))[0]).slice(0, 120), path)
    return path


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def packed(request, tmp_path_factory, corpus):
    out = pack_to(tmp_path_factory.mktemp(request.param), [corpus], shard_rows=40, **LAYOUTS[request.param])[1]
    return request.param, out


def _expected(out: Path, corpus: Path) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per pack, per sequence: (tokens, target mask) from the source, by sample id; a split sample's
    pieces follow each other in output order. Target mask[j] = the source labels token j + 1."""
    source = pq.read_table(corpus).to_pydict()
    manifest = json.loads((out / "_manifest.json").read_text())
    consumed: dict[int, int] = {}
    packs = []
    for shard in manifest["shards"]:
        table = pq.read_table(out / shard["path"], columns=["sample_ids", "seq_lens"]).to_pydict()
        for gids, lens in zip(table["sample_ids"], table["seq_lens"]):
            pack = []
            for gid, n in zip(gids, lens):
                start = consumed.get(gid, 0)
                consumed[gid] = start + n
                tokens = np.array(source["input_ids"][gid][start:start + n])
                labels = np.array(source["labels"][gid][start:start + n])
                pack.append((tokens, labels[1:] != -100))
            packs.append(pack)
    return packs


def _nemo_rows(target: Path, npy: bool) -> list[dict]:
    if npy:
        return list(np.load(target / "train.npy", allow_pickle=True))
    rows = []
    for path in sorted(target.glob("*.idx.parquet")):
        table = pq.read_table(path)
        assert table.schema.field("input_ids").type == pa.list_(pa.int32())
        assert table.schema.field("seq_start_id").type == pa.list_(pa.int32())
        assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
        rows += table.to_pylist()
    return rows


def _nemo_read(row: dict, mult: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """A row as NeMo's collate_fn splits it: per sub-sequence its stored tokens, its loss mask over
    the run-time positions (loss_mask[b:e-1], pre-shifted: position j predicts token j + 1) and its
    logical length (trailing EOS tokens without loss are alignment padding)."""
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
    bounds = list(row["seq_start_id"]) + [len(ids)]
    out = []
    for b, e in zip(bounds[:-1], bounds[1:]):
        assert (e - b - 1) % mult == 0, (e - b - 1, mult)  # run-time length, as TE's CP split needs
        tokens, lm = ids[b:e - 1], mask[b:e - 1].astype(bool)
        logical = len(tokens)
        while logical > 0 and tokens[logical - 1] == EOS and not lm[logical - 1]:
            logical -= 1
        out.append((ids[b:e], lm, logical))
    return out


@pytest.mark.parametrize("fmt", ["nemo", "nemo-npy"])
def test_nemo_export_round_trips(packed, corpus, tmp_path, fmt):
    name, out = packed
    mult = 4 if name == "cp2" else 1
    result = export(out, tmp_path / "nemo", fmt, eos_token_id=EOS)
    rows = _nemo_rows(tmp_path / "nemo", npy=fmt == "nemo-npy")
    expected = _expected(out, corpus)
    assert len(rows) == len(expected) == result["packs"]
    checked = 0
    for row, pack in zip(rows, expected):
        got = _nemo_read(row, mult)
        assert len(got) == len(pack)
        for (stored, lm, logical), (src_tokens, src_targets) in zip(got, pack):
            n = len(src_tokens)
            assert np.array_equal(stored[:n], src_tokens) and (stored[n:] == EOS).all()
            assert np.array_equal(lm[:n - 1], src_targets) and not lm[n - 1:].any()
            # every target NeMo trains lies inside its logical sequence
            assert logical <= n and not lm[logical:].any()
            checked += 1
    assert checked > len(rows)  # several sequences per pack
    meta = json.loads((tmp_path / "nemo" / "packing_metadata.json").read_text())
    assert isinstance(meta, list) and len(meta) == 1
    runtime = [sum(int(e - b - 1) for b, e in zip(list(r["seq_start_id"]), list(r["seq_start_id"])[1:] +
                                                   [len(r["input_ids"])])) for r in rows]
    assert meta[0] == {
        "dataset_max_seqlen": max(int(e - b - 1) for r in rows for b, e in
                                  zip(list(r["seq_start_id"]), list(r["seq_start_id"])[1:] + [len(r["input_ids"])])),
        "max_samples_per_bin": max(len(r["seq_start_id"]) for r in rows),
        "packing_factor": round(sum(len(r["seq_start_id"]) for r in rows) / len(rows), 2),
        "packing_efficiency": round(sum(runtime) / len(rows) / 512 * 100, 2),
        "pack_size": 512,
        "min_packed_seqlen": min(runtime),
    }
    assert max(runtime) <= 512  # NeMo's pack_size holds every row


def test_nemo_export_needs_the_eos_id_for_aligned_outputs(packed, tmp_path):
    name, out = packed
    if name == "cp1":
        assert export(out, tmp_path / "x", "nemo")["packs"] > 0  # nothing to pad: no EOS id needed
        return
    with pytest.raises(PackctlError, match="pass --eos-token-id"):
        export(out, tmp_path / "x", "nemo")


def test_nemo_export_refuses_labels_that_are_not_the_tokens(tmp_path):
    write_table(tmp_path / "in" / "a.parquet", {"input_ids": [[5, 6, 7, 8]], "labels": [[-100, 6, 9, 8]]})
    _, out = pack_to(tmp_path, [tmp_path / "in"], capacity=8)
    with pytest.raises(PackctlError) as refused:
        export(out, tmp_path / "nemo", "nemo")
    # OUT, the shard, its row and the pack's number in the output, the values that differ
    assert str(refused.value).startswith(f"{out}/data/train-00000.parquet row 0 (pack 0 of the output): a label "
                                         "differs from its token (label 9, token 7)")


def test_export_cli(packed, tmp_path):
    _, out = packed
    proc = packctl("export", str(out), "-o", str(tmp_path / "e"), "--format", "nemo", "--eos-token-id", str(EOS),
                   "--json")
    assert proc.code == 0, proc.stderr
    assert json.loads(proc.stdout)["files"][0] == "train-00000.idx.parquet"
    again = packctl("export", str(out), "-o", str(tmp_path / "e"), "--format", "nemo", "--eos-token-id", str(EOS))
    assert again.code == 2 and "exists; choose another -o or pass --overwrite" in " ".join(again.stderr.split())
    bad = packctl("export", str(out), "-o", str(tmp_path / "f"), "--format", "megatron-lm")
    assert bad.code == 2 and "--format 'megatron-lm': choose one of" in bad.stderr
    inside = packctl("export", str(out), "-o", str(out), "--format", "nemo", "--overwrite")
    assert inside.code == 2 and "inside the packed output" in inside.stderr
    assert (out / "_manifest.json").exists()  # nothing of the output was touched


# --- OLMo-core ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_corpus(tmp_path_factory) -> Path:
    """Documents that end with the EOS id (2) and hold no other, masked prompts on every other one,
    some longer than the capacity (dropped, so no piece lacks its EOS)."""
    rng = np.random.default_rng(0)
    tokens, labels = [], []
    for i in range(300):
        n = int(rng.integers(4, 300))
        ids = np.append(rng.integers(3, 70_000, n - 1), EOS)  # ids above 65,535: uint32 files
        lab = ids.copy()
        if i % 2:
            lab[:n // 3] = -100
        tokens.append(ids.tolist())
        labels.append(lab.tolist())
    root = tmp_path_factory.mktemp("eos")
    write_table(root / "in" / "a.parquet", {"input_ids": tokens[:150], "labels": labels[:150]})
    write_table(root / "in" / "b.parquet", {"input_ids": tokens[150:], "labels": labels[150:]})
    return root / "in"


def _olmo_documents(instance: np.ndarray, eos: int) -> list[int]:
    """OLMo-core's document lengths of one instance: a boundary after every EOS, and at the end."""
    ends = list(np.flatnonzero(instance == eos) + 1)
    if not ends or ends[-1] != len(instance):
        ends.append(len(instance))
    return list(np.diff([0] + ends))


def test_olmo_export_round_trips(eos_corpus, tmp_path):
    _, out = pack_to(tmp_path, [eos_corpus], capacity=256, too_long="drop", shard_rows=30)
    result = export(out, tmp_path / "olmo", "olmo", eos_token_id=EOS, vocab_size=70_000)
    info = json.loads((tmp_path / "olmo" / "olmo.json").read_text())
    assert info["token_dtype"] == "uint32" and info["sequence_length"] == 256
    source = {}
    for k, f in enumerate(sorted(eos_corpus.glob("*.parquet"))):
        t = pq.read_table(f).to_pydict()
        for r, (ids, lab) in enumerate(zip(t["input_ids"], t["labels"])):
            source[150 * k + r] = (np.array(ids), np.array(lab))
    manifest = json.loads((out / "_manifest.json").read_text())
    sample_ids = [ids for s in manifest["shards"] for ids in
                  pq.read_table(out / s["path"], columns=["sample_ids"]).column("sample_ids").to_pylist()]
    instances, masks, spans = [], [], []
    for name in info["files"]:
        tokens = np.fromfile(tmp_path / "olmo" / name, dtype=np.uint32)
        mask = np.fromfile(tmp_path / "olmo" / "label_mask" / name, dtype=np.bool_)
        assert len(tokens) == len(mask) and len(tokens) % 256 == 0
        base = len(instances) * 256  # spans are offsets in their file; make them global
        instances += list(tokens.reshape(-1, 256))
        masks += list(mask.reshape(-1, 256))
        with gzip.open(tmp_path / "olmo" / name.replace(".npy", ".csv.gz"), "rt") as fh:
            spans += [(base + int(a), base + int(b)) for a, b in (line.split(",") for line in fh)]
    assert len(instances) == len(sample_ids) == result["packs"]
    flat_spans = iter(spans)
    for p, (instance, mask, gids) in enumerate(zip(instances, masks, sample_ids)):
        docs = _olmo_documents(instance, EOS)
        lengths = [len(source[g][0]) for g in gids]
        tail = 256 - sum(lengths)
        assert docs == lengths + ([tail] if tail else [])  # OLMo's documents are packctl's sequences
        at = 0
        for g, n in zip(gids, lengths):
            ids, lab = source[g]
            assert np.array_equal(instance[at:at + n], ids)
            expect = lab != -100
            expect[0] = False  # the first token of a document is never a target
            assert np.array_equal(mask[at:at + n], expect)
            assert next(flat_spans) == (p * 256 + at, p * 256 + at + n)
            at += n
        assert not mask[at:].any()
        if at < 256:  # the tail padding: a document of its own in the index too, pad ... EOS
            assert next(flat_spans) == (p * 256 + at, p * 256 + 256)
            assert (instance[at:-1] == 0).all() and instance[-1] == EOS
    assert next(flat_spans, None) is None


@pytest.mark.parametrize("options, fragment", [
    (dict(capacity=256, too_long="split"), "does not end with the EOS id 2"),
    (dict(capacity=256, too_long="drop", cp_size=2), "sequences padded to a multiple of 4"),
    (dict(capacity=256, too_long="drop", pad_to="multiple"), "pack with --pad-to capacity"),
])
def test_olmo_export_refuses_what_olmo_would_read_otherwise(eos_corpus, tmp_path, options, fragment):
    _, out = pack_to(tmp_path, [eos_corpus], **options)
    with pytest.raises(PackctlError, match=fragment):
        export(out, tmp_path / "olmo", "olmo", eos_token_id=EOS, vocab_size=70_000)
    assert not (tmp_path / "olmo").exists()

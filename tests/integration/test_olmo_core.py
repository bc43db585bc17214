"""`packctl export --format olmo` read by OLMo-core's own readers (ai2-olmo-core, pinned in the dev
extra), each configured from olmo.json alone, finds packctl's packs and sequences exactly:

    NumpyFSLDataset (generate_doc_lengths)    instance i = pack i: tokens, label mask, doc lengths
    NumpyPackedFSLDataset                     the documents it repacks: the EOS scan and the index
    NumpyDocumentSource (composable)          documents in file order: the EOS scan and the index
    NumpyFSLDataLoader (shuffle off)          rank r's batches = the --dp-size plan's packs of r

for sequences without BOS, with BOS (read with or without the BOS id, as olmo.json says; BOS equal
to EOS too) and for a vocabulary over 65,536 ids (uint32 files). The expected documents are
packctl's: each pack's sequences (from the packed output), then its tail padding as one document
without targets.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from support.data import write_table
from support.docs import run_docs_block
from support.runs import pack_to
from packctl.export import export
from packctl.sample import SampleSpec, write_sample

pytestmark = pytest.mark.torch  # OLMo-core runs on torch

olmo_data = pytest.importorskip("olmo_core.data", reason="ai2-olmo-core is not installed (pip install -e '.[dev]')")

CAPACITY = 1024


def _sample(root: Path, **spec) -> Path:
    write_sample(root / "corpus", SampleSpec(sequences=160, shards=2, max_length=1500, **spec))
    return root / "corpus"


def _chat(root: Path, bos: int, eos: int) -> Path:
    """Conversations: BOS ... EOS with EOS inside (turn ends, not followed by BOS), even lengths, so
    no pack of an even capacity ends with exactly 1 token of padding: read with the BOS id."""
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(120):
        n = 2 * int(rng.integers(4, 200))
        ids = rng.integers(3, 1000, n)
        ids[0], ids[-1] = bos, eos
        ids[rng.integers(2, n - 2, 3)] = eos  # turn ends inside the conversation
        rows.append(ids.tolist())
    labels = [[-100] * (len(r) // 3) + r[len(r) // 3:] for r in rows]
    write_table(root / "corpus" / "a.parquet", {"input_ids": rows[:60], "labels": labels[:60]})
    write_table(root / "corpus" / "b.parquet", {"input_ids": rows[60:], "labels": labels[60:]})
    return root / "corpus"


# case: (corpus maker, export options, the bos_token_id olmo.json must tell readers, token dtype)
CASES = {
    "eos": (lambda r: _sample(r, eos_id=32000), dict(eos_token_id=32000, vocab_size=32002), None, "uint16"),
    # BOS sequences whose packs end with 1 token of padding: documents by EOS alone
    "bos": (lambda r: _sample(r, eos_id=32000, bos_id=32001), dict(eos_token_id=32000, bos_token_id=32001,
                                                                  vocab_size=32002), None, "uint16"),
    "bos-chat": (lambda r: _chat(r, bos=1, eos=2), dict(eos_token_id=2, bos_token_id=1, vocab_size=1000), 1,
                 "uint16"),
    "bos-is-eos": (lambda r: _sample(r, vocab_size=50256, eos_id=50256, bos_id=50256),
                   dict(eos_token_id=50256, bos_token_id=50256, vocab_size=50257), 50256, "uint16"),
    "vocab-131072": (lambda r: _sample(r, vocab_size=131000, eos_id=131000, bos_id=131001),
                     dict(eos_token_id=131000, bos_token_id=131001, vocab_size=131072), None, "uint32"),
}


class Packs:
    """packctl's packs, from the packed output: per pack its tokens, labels, sequence lengths and
    (with --dp-size) plan position; and the documents OLMo-core must find, file by file."""

    def __init__(self, out: Path):
        manifest = json.loads((out / "_manifest.json").read_text())
        self.files: list[list[int]] = []  # pack indices of each export file
        self.tokens, self.labels, self.seq_lens, self.plan = [], [], [], []
        for shard in manifest["shards"]:
            table = pq.read_table(out / shard["path"]).to_pydict()
            self.files.append(list(range(len(self.tokens), len(self.tokens) + len(table["input_ids"]))))
            self.tokens += [np.array(t) for t in table["input_ids"]]
            self.labels += [np.array(t) for t in table["labels"]]
            self.seq_lens += [list(s) for s in table["seq_lens"]]
            if "step" in table:
                self.plan += list(zip(table["step"], table["dp_rank"], table["micro_batch"]))

    def doc_lens(self, p: int, info: dict) -> list[int]:
        """Pack p's sequences, then its tail padding as one document; with BOS = EOS a tail of 2 is
        [EOS EOS], two documents of 1 token (a boundary at every EOS followed by the BOS)."""
        tail = len(self.tokens[p]) - sum(self.seq_lens[p])
        if tail == 2 and info["tokenizer"]["bos_token_id"] == info["eos_token_id"]:
            return self.seq_lens[p] + [1, 1]
        return self.seq_lens[p] + ([tail] if tail else [])

    def padded(self, p: int, info: dict) -> np.ndarray:
        """Pack p as the export writes it: the tail padding made a document, [BOS] pad ... EOS (the
        layout docs/training.md describes; BOS when the export was given one, on 2 tokens or more)."""
        tokens = self.tokens[p].copy()
        tail = len(tokens) - sum(self.seq_lens[p])
        if tail:
            tokens[-tail:] = info["pad_token_id"]
            if info["bos_token_id"] is not None:
                tokens[-tail] = info["bos_token_id"]
            tokens[-1] = info["eos_token_id"]
        return tokens

    def documents(self, p: int, info: dict) -> list[tuple[np.ndarray, np.ndarray]]:
        """(tokens, label mask) of pack p's documents as OLMo-core must find them."""
        tokens, docs, at = self.padded(p, info), [], 0
        for n in self.doc_lens(p, info):
            docs.append((tokens[at:at + n], self.labels[p][at:at + n] != -100))
            at += n
        return docs


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    make, options, reader_bos, dtype = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    _, out = pack_to(root, [make(root)], capacity=CAPACITY, too_long="drop", shard_rows=16)
    result = export(out, root / "olmo", "olmo", **options)
    info = json.loads((root / "olmo" / "olmo.json").read_text())
    assert info["tokenizer"]["bos_token_id"] == reader_bos and info["token_dtype"] == dtype
    assert info["bos_token_id"] == options.get("bos_token_id")
    assert result["tokenizer"] == info["tokenizer"]
    return request.param, root, root / "olmo", info, Packs(out)


def _tokenizer(info: dict):
    return olmo_data.TokenizerConfig(**info["tokenizer"])


def _paths(export_dir: Path, names: list[str]) -> list[str]:
    return [str(export_dir / n) for n in names]


def test_fsl_dataset_instances_are_packctl_packs(exported, tmp_path):
    name, _, export_dir, info, packs = exported
    dataset = olmo_data.NumpyFSLDatasetConfig(
        tokenizer=_tokenizer(info), paths=_paths(export_dir, info["files"]),
        label_mask_paths=_paths(export_dir, info["label_mask_files"]), sequence_length=info["sequence_length"],
        generate_doc_lengths=True, work_dir=str(tmp_path)).build()  # dtype inferred from the vocabulary
    dataset.prepare()
    assert np.dtype(dataset.dtype).name == info["token_dtype"]
    assert len(dataset) == len(packs.tokens) == info["instances"]
    mismatches = 0
    for p in range(len(dataset)):
        item = dataset[p]
        ids, mask = np.asarray(item["input_ids"]), np.asarray(item["label_mask"])
        ok = (np.array_equal(ids, packs.padded(p, info))
              and np.array_equal(mask, packs.labels[p] != -100)
              and item["doc_lens"].tolist() == packs.doc_lens(p, info))
        mismatches += not ok
    assert mismatches == 0, f"{name}: {mismatches} of {len(dataset)} instances differ from packctl's packs"


def _expected_documents(packs: Packs, info: dict) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per export file, its documents in order."""
    return [[doc for p in pack_ids for doc in packs.documents(p, info)] for pack_ids in packs.files]


def _same(doc, ids, mask) -> bool:
    return np.array_equal(doc[0], ids) and np.array_equal(doc[1], mask)


@pytest.mark.parametrize("via", ["eos-scan", "index"])
def test_document_source_finds_packctl_sequences_in_order(exported, tmp_path, monkeypatch, via):
    from olmo_core.data.composable import numpy_document_source
    from olmo_core.data.utils import iter_document_indices

    name, _, export_dir, info, packs = exported
    if via == "index":  # what s3:// and gs:// sources always read: the .csv.gz beside each file
        monkeypatch.setattr(numpy_document_source, "iter_document_indices",
                            functools.partial(iter_document_indices, use_array_if_local=False))
    source = numpy_document_source.NumpyDocumentSource(
        source_paths=_paths(export_dir, info["files"]), label_mask_paths=_paths(export_dir, info["label_mask_files"]),
        tokenizer=_tokenizer(info), dtype=np.dtype(info["token_dtype"]).type, work_dir=tmp_path)
    offsets = list(source.get_document_offsets())
    expected = [doc for docs in _expected_documents(packs, info) for doc in docs]
    assert len(offsets) == len(expected) == info["documents"]
    mismatches = 0
    for (a, b), doc in zip(offsets, expected):
        got = source.get_token_range(int(a), int(b))
        mismatches += not _same(doc, np.asarray(got["input_ids"]), np.asarray(got["label_mask"]))
    assert mismatches == 0, f"{name} via {via}: {mismatches} of {len(expected)} documents differ"


@pytest.mark.parametrize("via", ["eos-scan", "index"])
def test_index_and_scan_agree_file_by_file(exported, via):
    from olmo_core.data.utils import iter_document_indices

    _, _, export_dir, info, packs = exported
    for name, docs in zip(info["files"], _expected_documents(packs, info)):
        kwargs = (dict(use_array_if_local=False) if via == "index" else
                  dict(eos_token_id=info["eos_token_id"], bos_token_id=info["tokenizer"]["bos_token_id"],
                       dtype=np.dtype(info["token_dtype"]).type))
        spans = [(int(a), int(b)) for a, b in iter_document_indices(str(export_dir / name), **kwargs)]
        ends = np.cumsum([len(d[0]) for d in docs]).tolist()
        assert spans == list(zip([0] + ends[:-1], ends)), name


@pytest.mark.parametrize("use_array_if_local", [None, False], ids=["eos-scan", "index"])
def test_packed_fsl_dataset_repacks_packctl_documents(exported, tmp_path, use_array_if_local):
    name, _, export_dir, info, packs = exported
    tokenizer = _tokenizer(info)
    dataset = olmo_data.NumpyPackedFSLDataset(
        *_paths(export_dir, info["files"]), label_mask_paths=_paths(export_dir, info["label_mask_files"]),
        sequence_length=info["sequence_length"], pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, vocab_size=tokenizer.vocab_size,
        dtype=np.dtype(info["token_dtype"]).type, generate_doc_lengths=True, use_array_if_local=use_array_if_local)
    dataset.work_dir = tmp_path
    dataset.prepare()
    # OLMo-core packs the documents again (best-fit decreasing) and pads its instances with the pad id
    # after the last document: split each instance by its doc_lens up to its last EOS
    found = []
    for i in range(len(dataset)):
        item = dataset[i]
        ids, mask = np.asarray(item["input_ids"]), np.asarray(item["label_mask"])
        used = int(np.flatnonzero(ids == info["eos_token_id"])[-1]) + 1
        assert (ids[used:] == tokenizer.pad_token_id).all() and not mask[used:].any()
        at = 0
        for n in item["doc_lens"].tolist():
            n = min(n, used - at)
            if n <= 0:
                break
            found.append((ids[at:at + n], mask[at:at + n]))
            at += n
        assert at == used
    expected = [doc for docs in _expected_documents(packs, info) for doc in docs]
    assert len(found) == len(expected) == info["documents"]

    def key(doc):
        return np.asarray(doc[0], np.int64).tobytes(), np.asarray(doc[1], bool).tobytes()

    found, expected = sorted(map(key, found)), sorted(map(key, expected))
    mismatches = sum(a != b for a, b in zip(found, expected))
    assert mismatches == 0, f"{name}: {mismatches} of {len(expected)} documents differ"


def test_the_padding_is_a_document(exported):
    """Every file is its packs as written, pack after pack; olmo.json counts the padding documents."""
    _, _, export_dir, info, packs = exported
    tails = padding = 0
    for name, pack_ids in zip(info["files"], packs.files):
        tokens = np.fromfile(export_dir / name, dtype=info["token_dtype"])
        mask = np.fromfile(export_dir / "label_mask" / name, dtype=np.bool_)
        assert np.array_equal(tokens, np.concatenate([packs.padded(p, info) for p in pack_ids]))
        assert np.array_equal(mask, np.concatenate([packs.labels[p] != -100 for p in pack_ids]))
        for p in pack_ids:
            tails += CAPACITY - sum(packs.seq_lens[p])
            padding += len(packs.doc_lens(p, info)) - len(packs.seq_lens[p])
    assert padding > 0 and info["padding_documents"] == padding and info["padding_tokens"] == tails
    assert info["documents"] == info["sequences"] + padding


@pytest.mark.parametrize("dp_size, micro_batches", [(2, 2), (4, 1)])
def test_data_loader_follows_the_dp_plan(tmp_path, dp_size, micro_batches):
    """The recipe of docs/training.md: shuffle off, dp_world_size, global_batch_size = dp size x
    micro-batches x capacity; rank r's batches are the plan's packs of rank r, step by step."""
    corpus = _sample(tmp_path, eos_id=32000)
    _, out = pack_to(tmp_path, [corpus], capacity=CAPACITY, too_long="drop", dp_size=dp_size,
                     micro_batches=micro_batches)
    export(out, tmp_path / "packed-olmo", "olmo", eos_token_id=32000, vocab_size=32002)
    packs = Packs(out)
    info = json.loads((tmp_path / "packed-olmo" / "olmo.json").read_text())
    assert info["data_loader"] == {"shuffle": False, "dp_world_size": dp_size, "micro_batches": micro_batches,
                                   "global_batch_size": dp_size * micro_batches * CAPACITY}
    per_step = dp_size * micro_batches
    planned = {}
    for p, (step, rank, micro) in enumerate(packs.plan):
        planned.setdefault((step, rank), []).append((micro, p))
    followed = total = 0
    for rank in range(dp_size):
        ns = run_docs_block("olmo-core", {"export": tmp_path / "packed-olmo", "dp_rank": rank,
                                          "work_dir": str(tmp_path / f"work-{rank}")})
        batches = list(ns["loader"])
        assert len(batches) == len(packs.tokens) // per_step  # a last step of fewer packs is left out
        for step, batch in enumerate(batches):
            want = [p for _, p in sorted(planned[(step, rank)])]
            assert batch["input_ids"].shape == (micro_batches, CAPACITY)
            for row, p in enumerate(want):
                total += 1
                followed += (np.array_equal(batch["input_ids"][row].numpy(), packs.padded(p, info))
                             and batch["doc_lens"][row][batch["doc_lens"][row] > 0].tolist() == packs.doc_lens(p, info))
    assert total == len(packs.tokens) // per_step * per_step
    assert followed == total, f"{followed}/{total} packs where the plan puts them"


def test_the_readme_export_runs_as_written(tmp_path, monkeypatch):
    """The README's sample -> pack -> export commands, run as written; OLMo-core reads the result."""
    import re
    import shlex

    from support.adversary import packctl
    from support.paths import ROOT

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test: olmo-export -->\s*```bash\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["packctl", "sample"], ["packctl", "pack"], ["packctl", "export"]]
    for command in commands:
        result = packctl(*command[1:])
        assert result.code == 0, (command, result.stderr)
    info = json.loads((tmp_path / "packed-olmo" / "olmo.json").read_text())
    assert info["sequences"] == 1937 and info["instances"] == 481 and info["bos_token_id"] == 32001
    dataset = olmo_data.NumpyFSLDatasetConfig(
        tokenizer=_tokenizer(info), paths=_paths(tmp_path / "packed-olmo", info["files"]),
        sequence_length=info["sequence_length"], generate_doc_lengths=True, work_dir=str(tmp_path / "w")).build()
    dataset.prepare()
    assert sum(len(dataset[i]["doc_lens"]) for i in range(len(dataset))) == info["documents"]

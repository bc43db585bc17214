"""Reading an output, and paths that escape OUT (docs/errors.md): what a damaged, tampered or
hand-edited output does to each reader of it.

Every case is a copy of a tiny output (packed once per module) changed the way a disk, a copy, a
hand or a tool would change it, then read by each consumer:

    PackedDataset   raises PackctlError naming the file (and the shard), before any pack of it
    export, stats   exit 2 with one line naming the file; export leaves nothing behind
    verify          exit 1 naming the broken rule (exit 2 when there is no manifest to read at all)

and each opt-out (`verify=False`, `--no-verify-checksums`) reads a tampered-but-parseable output.
PackedDataset is judged where torch is installed; the other readers everywhere.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.adversary import Result, assert_clean_error, assert_every_sample_once, assert_nothing_left, packctl
from support.data import write_table
from packctl import PackctlError

TORCH = importlib.util.find_spec("torch") is not None

PACK = ("--capacity", "64", "--shard-rows", "4", "--algorithm", "concat")
SHARD = ["data/train-00000.parquet", "data/train-00001.parquet", "data/train-00002.parquet"]


def _corpus(root: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 40, size=30)
    tokens = [rng.integers(1, 1000, size=n).tolist() for n in lengths]
    write_table(root / "a.parquet", {"input_ids": pa.array(tokens, pa.list_(pa.int32()))})
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Tiny outputs: `out` (3 shards), `other` (another corpus, same options: same layout),
    `epochs` (--epochs 2) and `balanced` (--dp-size 2)."""
    root = tmp_path_factory.mktemp("reading")
    corpus, other_corpus = _corpus(root / "corpus", 0), _corpus(root / "other_corpus", 1)
    runs = {"out": (corpus, ()), "other": (other_corpus, ()),
            "epochs": (corpus, ("--epochs", "2", "--order", "shuffle")),
            "balanced": (corpus, ("--dp-size", "2", "--micro-batches", "1"))}
    for name, (source, extra) in runs.items():
        result = packctl("pack", source, "-o", root / name, *PACK, *extra, "--quiet")
        assert result.code == 0, result.stderr
    manifest = json.loads((root / "out/_manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]][:3] == SHARD  # what the cases below take for granted
    return {"corpus": corpus, **{name: root / name for name in runs}}


@pytest.fixture()
def out(built, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(built["out"], copy, symlinks=True)
    return copy


def _manifest(out: Path) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def _save(out: Path, manifest: dict) -> None:
    (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))


def _edit(out: Path, change) -> None:
    manifest = _manifest(out)
    change(manifest)
    _save(out, manifest)


# ---- the four readers ----------------------------------------------------------------------------


def _loader_error(out: Path, **options) -> str:
    """PackedDataset over OUT, every pack read: the PackctlError it raises, as one line."""
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    with pytest.raises(PackctlError) as err:
        dataset = PackedDataset(out, **options)
        for i in range(len(dataset)):
            dataset[i]
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    return message


def _loader_reads(out: Path, **options) -> list[dict]:
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    dataset = PackedDataset(out, **options)
    return [dataset[i] for i in range(len(dataset))]


def _export(out: Path, *flags: str) -> tuple[Result, Path]:
    target = out.parent / "exported"
    return packctl("export", out, "-o", target, "--format", "nemo", *flags), target


def _verify(out: Path) -> tuple[Result, list[str]]:
    result = packctl("verify", out, "--no-attention", "--json")
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    rules = [v["rule"] for v in json.loads(result.stdout)["violations"]] if result.code in (0, 1) else []
    return result, rules


def assert_refused(out: Path, mentions: tuple[str, ...], rule: str, *, loader_mentions: tuple[str, ...] = ()) -> None:
    """Every reader refuses OUT: the loader raises, export and stats exit 2 with one line naming
    each of `mentions`, export leaves nothing, verify exits 1 with `rule` among the broken rules."""
    if TORCH:
        message = _loader_error(out)
        for text in (*mentions, *loader_mentions):
            assert text in message, f"{text!r} not in {message!r}"
    result, target = _export(out)
    assert_clean_error(result, 2, *mentions)
    assert not target.exists()
    assert_clean_error(packctl("stats", out, "--json"), 2, *mentions)
    result, rules = _verify(out)
    assert result.code == 1 and rule in rules, (result.code, rules, result.stderr)


def assert_all_read(out: Path, sources: list[Path]) -> None:
    """Every reader takes OUT: exit 0, and the loader's packs hold every source sample once."""
    if TORCH:
        packs = _loader_reads(out)
        ids = np.sort(np.concatenate([p["sample_ids"] for p in packs]))
        assert np.array_equal(ids, np.arange(len(ids))) and len(ids) == 30
    result, target = _export(out)
    assert result.code == 0, result.stderr
    assert packctl("stats", out, "--json").code == 0
    result, rules = _verify(out)
    assert result.code == 0 and rules == [], rules
    assert_every_sample_once(out.resolve(), sources)


def test_the_untouched_output_reads_everywhere(out, built):
    assert_all_read(out, [built["corpus"]])


# ---- shard bytes ----------------------------------------------------------------------------------


def _flip_bit(out: Path) -> None:
    path = out / SHARD[1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _truncate(out: Path) -> None:
    path = out / SHARD[1]
    path.write_bytes(path.read_bytes()[:-100])


def _swap_files(out: Path) -> None:
    a, b = out / SHARD[0], out / SHARD[1]
    a.rename(out / "tmp")
    b.rename(a)
    (out / "tmp").rename(b)


def _one_token_changed(out: Path) -> None:
    """Shard 1 rewritten with pyarrow, one token changed, the manifest left alone: parseable, and
    every rule of its own still holds."""
    path = out / SHARD[1]
    table = pq.read_table(path)
    for name in ("input_ids", "labels"):  # labels are the tokens (the corpus has none of its own)
        values = table.column(name).to_pylist()
        values[0][1] += 1
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, pa.list_(pa.int32())))
    pq.write_table(table, path)


SHARD_CASES = {  # name -> (change, shard named)
    "a flipped bit": (_flip_bit, SHARD[1]),
    "a truncated shard": (_truncate, SHARD[1]),
    "two shard files swapped": (_swap_files, SHARD[0]),
    "a token changed": (_one_token_changed, SHARD[1]),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_shard_bytes_that_differ_from_the_manifest(out, case):
    change, shard = SHARD_CASES[case]
    change(out)
    assert_refused(out, (shard,), "checksum", loader_mentions=("sha256 differs",))


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_a_megatron_export_stops_at_the_shard_that_differs(out, case):
    """`export --format megatron` has written the packs of the shards before into its staging
    directory when it reads the damaged one: one line naming it, and neither -o nor the staging
    directory (with its .bin files and the side files of the .idx) is left."""
    change, shard = SHARD_CASES[case]
    change(out)
    target = out.parent / "megatron"
    assert_clean_error(packctl("export", out, "-o", target, "--format", "megatron"), 2, shard)
    assert_nothing_left(target)


def test_a_shard_replaced_by_another_outputs_shard_of_the_same_layout(out, built):
    other = built["other"] / SHARD[0]
    assert json.loads(pq.read_schema(other).metadata[b"packctl"])["layout"] == _manifest(out)["layout"]
    shutil.copy(other, out / SHARD[0])
    assert_refused(out, (SHARD[0], "sha256 differs"), "checksum")


@pytest.mark.torch
def test_the_loader_returns_no_pack_of_a_shard_that_fails(out):
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    _flip_bit(out)
    dataset = PackedDataset(out)
    rows = _manifest(out)["shards"][0]["rows"]
    assert [dataset[i]["index"] for i in range(rows)] == list(range(rows))  # shard 0 is intact
    with pytest.raises(PackctlError, match=f"{SHARD[1]}: sha256 differs"):
        dataset[rows]


def test_opting_out_reads_a_tampered_but_parseable_output(out, built):
    _one_token_changed(out)
    if TORCH:
        packs = _loader_reads(out, verify=False)
        changed = pq.read_table(out / SHARD[1]).column("input_ids")[0].as_py()
        rows = _manifest(out)["shards"][0]["rows"]
        assert packs[rows]["input_ids"].tolist() == changed
    result, target = _export(out, "--no-verify-checksums")
    assert result.code == 0, result.stderr
    assert target.is_dir()
    assert packctl("stats", out, "--json", "--no-verify-checksums").code == 0


@pytest.mark.torch
def test_a_balanced_output_hands_out_only_packs_of_checked_shards(built, tmp_path):
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    out = tmp_path / "balanced"
    shutil.copytree(built["balanced"], out)
    shard = out / SHARD[0]
    original = shard.read_bytes()
    table = pq.read_table(shard)
    steps = table.column("step").to_numpy()
    table = table.set_column(table.schema.get_field_index("step"), "step", pa.array(steps[::-1].copy(), pa.int32()))
    pq.write_table(table, shard)
    # the order is planned from the balance columns, read unchecked; no pack of the shard is handed out
    dataset = PackedDataset(out, dp_rank=0, dp_size=2)
    with pytest.raises(PackctlError, match=f"{SHARD[0]}: sha256 differs"):
        [dataset[i] for i in range(len(dataset))]
    # the shard put back after the order was planned: its packs would go to another step, so still refused
    shard.write_bytes(original)
    with pytest.raises(PackctlError, match=f"{SHARD[0]}: its step, dp_rank, micro_batch differ from those read"):
        [dataset[i] for i in range(len(dataset))]
    assert len([PackedDataset(out, dp_rank=0, dp_size=2)[i] for i in range(len(dataset))]) == len(dataset)


# ---- manifest entries -----------------------------------------------------------------------------


def _reorder(m):
    m["shards"][0], m["shards"][1] = m["shards"][1], m["shards"][0]


def _duplicate(m):
    m["shards"].append(dict(m["shards"][0]))


def _drop_middle(m):
    m["shards"].pop(1)


def _drop_last(m):
    m["shards"].pop()


def _rows(m):
    m["shards"][0]["rows"] += 1


def _tokens(m):
    m["shards"][2]["tokens"] -= 5


def _rows_and_count(m):
    m["shards"][0]["rows"] += 1
    m["counts"]["packs"] += 1


def _tokens_and_count(m):
    m["shards"][2]["tokens"] -= 5
    m["counts"]["tokens_packed"] -= 5


ENTRY_CASES = {  # name -> (edit, what the line names, verify rule)
    "entries reordered": (_reorder, ("shards[0].path", "data/train-00001.parquet", "reordered"), "manifest-order"),
    "an entry duplicated": (_duplicate, ("is listed again (also shards[0])",), "manifest-paths"),
    "a middle entry dropped": (_drop_middle, ("shards[1].path", "data/train-00002.parquet"), "manifest-order"),
    "the last entry dropped": (_drop_last, ("counts.packs", "the shards' rows sum to"), "manifest-counts"),
    "rows edited": (_rows, ("counts.packs",), "manifest-counts"),
    "tokens edited": (_tokens, ("counts.tokens_packed",), "manifest-counts"),
    "rows and counts.packs edited": (_rows_and_count, (SHARD[0], "packs, the manifest says"), "manifest-shard"),
    "tokens and counts edited": (_tokens_and_count, (SHARD[2], "tokens (sum of num_tokens), the manifest says"),
                                 "manifest-shard"),
    "sha256 in upper case": (lambda m: m["shards"][1].update(sha256=m["shards"][1]["sha256"].upper()),
                             ("shards[1].sha256", "64 lowercase hex digits"), "manifest-fields"),
    "sha256 short": (lambda m: m["shards"][1].update(sha256=m["shards"][1]["sha256"][:40]),
                     ("shards[1].sha256",), "manifest-fields"),
}


@pytest.mark.parametrize("case", list(ENTRY_CASES))
def test_manifest_entries_edited(out, case):
    edit, mentions, rule = ENTRY_CASES[case]
    _edit(out, edit)
    manifest_named = () if rule == "manifest-shard" else ("_manifest.json",)
    assert_refused(out, (*manifest_named, *mentions), rule)


def _next_shard(out: Path) -> str:
    """The name pack would give one more shard of OUT."""
    return f"data/train-{len(_manifest(out)['shards']):05d}.parquet"


def test_an_entry_added_for_a_copied_shard(out):
    added = _next_shard(out)
    shutil.copy(out / SHARD[0], out / added)
    _edit(out, lambda m: m["shards"].append(dict(m["shards"][0], path=added)))
    assert_refused(out, ("_manifest.json", "counts.packs"), "manifest-counts")


# ---- paths that escape OUT ------------------------------------------------------------------------


def _outside_copy(out: Path) -> Path:
    """The bytes of shard 0, beside OUT: a reader that follows a path out of OUT would find them."""
    target = out.parent / "x.parquet"
    shutil.copy(out / SHARD[0], target)
    return target


@pytest.mark.parametrize("path, why", [
    ("../x.parquet", "leads out of OUT (..)"),
    ("data/../../x.parquet", "leads out of OUT (..)"),
    ("ABSOLUTE", "is absolute"),
    ("./data/train-00000.parquet", "is not normalized"),
    ("data//train-00000.parquet", "is not normalized"),
    ("data\\train-00000.parquet", "backslash"),
])
def test_shard_paths_that_escape_out_or_are_not_normalized(out, path, why):
    outside = _outside_copy(out)
    path = str(outside) if path == "ABSOLUTE" else path
    _edit(out, lambda m: m["shards"][0].update(path=path))
    assert_refused(out, ("_manifest.json", "shards[0].path", why), "manifest-paths")


def test_a_shard_that_is_a_link_to_a_file_outside_out(out):
    outside = _outside_copy(out)
    (out / SHARD[0]).unlink()
    (out / SHARD[0]).symlink_to(outside)  # the same bytes: the sha256 alone would pass it
    assert_refused(out, ("_manifest.json", "shards[0].path", "leads out of OUT through a symbolic link"),
                   "manifest-paths")


def test_the_data_folder_a_link_to_a_folder_outside_out(out):
    elsewhere = out.parent / "elsewhere"
    (out / "data").rename(elsewhere)
    (out / "data").symlink_to(elsewhere)
    assert_refused(out, ("_manifest.json", "shards[0].path", "symbolic link"), "manifest-paths")
    result, rules = _verify(out)
    assert rules.count("manifest-paths") == 1 and "shard-missing" not in rules


def test_out_itself_a_link_is_read(out, built):
    link = out.parent / "link"
    link.symlink_to(out)
    assert_all_read(link, [built["corpus"]])


# ---- the manifest as a whole ----------------------------------------------------------------------


FIELD_CASES = {  # field -> value, each read by every consumer
    "layout": None,
    "layout.capacity": None,
    "layout.align": "1",
    "layout.pad_to": 3,
    "layout.pad_token_id": -1,
    "layout.cp_size": True,
    "shards": {"0": SHARD[0]},
    "shards.1": SHARD[1],
    "shards.0.path": 7,
    "shards.0.rows": "4",
    "shards.1.tokens": 1.5,
    "counts": [1],
    "counts.packs": "12",
    "counts.tokens_in": None,
    "inputs": "corpus",
    "config": [],
    "config.attn_coeff": "0.5",
}


def _field_name(path: str) -> str:
    """'shards.0.rows' -> 'shards[0].rows', as the error names it."""
    parts = path.split(".")
    return ".".join(f"[{p}]" if p.isdigit() else p for p in parts).replace(".[", "[")


@pytest.mark.parametrize("field", list(FIELD_CASES))
def test_manifest_fields_of_the_wrong_type(out, field):
    def edit(m):
        *parents, last = field.split(".")
        node = m
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = FIELD_CASES[field]

    _edit(out, edit)
    assert_refused(out, ("_manifest.json", _field_name(field)), "manifest-fields")


def test_an_empty_list_of_shards(out):
    _edit(out, lambda m: m.update(shards=[]))
    assert_refused(out, ("_manifest.json", "shards lists no shards"), "manifest-fields")


@pytest.mark.parametrize("text, said", [
    ("{\"format_version\": 2, \"shards\": [", "not readable JSON"),
    ("[{\"path\": \"data/train-00000.parquet\"}]", "not a JSON object"),
    ("{\"format_version\": \"2\"}", "format_version \"2\""),
])
def test_a_manifest_that_is_no_manifest_at_all(out, text, said):
    """Not JSON, not an object, no version this packctl reads: nothing to check against, so every
    reader, verify too, exits 2 with the one line."""
    (out / "_manifest.json").write_text(text)
    if TORCH:
        message = _loader_error(out)
        assert "_manifest.json" in message and said in message
    result, target = _export(out)
    assert_clean_error(result, 2, "_manifest.json", said)
    assert not target.exists()
    assert_clean_error(packctl("stats", out), 2, "_manifest.json", said)
    assert_clean_error(packctl("verify", out, "--no-attention"), 2, "_manifest.json", said)


# ---- other files of OUT ---------------------------------------------------------------------------


@pytest.mark.parametrize("place", ["NEXT", "stray.parquet"])
def test_a_stray_unlisted_parquet_file(out, place):
    place = _next_shard(out) if place == "NEXT" else place  # the shard of a dropped last entry, or any file
    shutil.copy(out / SHARD[0], out / place)
    assert_refused(out, (place, "does not list"), "shard-unlisted")
    if TORCH:
        assert len(_loader_reads(out, verify=False)) == sum(s["rows"] for s in _manifest(out)["shards"])
    assert packctl("stats", out, "--json", "--no-verify-checksums").code == 0


@pytest.mark.parametrize("text", ["{\"counts\": ", "[1, 2]", "{\"counts\": {\"packs\": 1}}",
                                  "{\"balance\": \"x\", \"scale_out\": [1], \"counts\": null}"])
def test_a_garbled_metrics_report(out, text):
    """_metrics.json is the run's report, not data: the readers go on from the shards, verify
    names the rule."""
    (out / "_metrics.json").write_text(text)
    if TORCH:
        assert len(_loader_reads(out)) == _manifest(out)["counts"]["packs"]
    assert _export(out)[0].code == 0
    result = packctl("stats", out, "--json")
    assert result.code == 0 and json.loads(result.stdout)["packs"] == _manifest(out)["counts"]["packs"]
    assert "scale_out" not in json.loads(result.stdout)
    result, rules = _verify(out)
    assert result.code == 1 and rules == ["metrics"]


def test_a_garbled_scale_out_in_a_balanced_report_is_left_out(built, tmp_path):
    out = tmp_path / "balanced"
    shutil.copytree(built["balanced"], out)
    metrics = json.loads((out / "_metrics.json").read_text())
    metrics["balance"] = {"attn_coeff": 0.0, "before": {"tokens": "x"}}
    metrics["scale_out"] = {"ranks": 2, "stage_seconds": {"scan": 1}}
    (out / "_metrics.json").write_text(json.dumps(metrics))
    result = packctl("stats", out)  # the terminal report too: it draws both when they are there
    assert result.code == 0, result.stderr
    report = json.loads(packctl("stats", out, "--json").stdout)
    assert report["dp_balance"] is not None and "round_robin" not in report["dp_balance"]


# ---- --epochs -------------------------------------------------------------------------------------


@pytest.fixture()
def epochs(built, tmp_path) -> Path:
    copy = tmp_path / "epochs"
    shutil.copytree(built["epochs"], copy)
    return copy


def _epochs_error(epochs: Path, *mentions: str) -> None:
    """Every reader of the OUT of --epochs refuses it: the loader, verify (exit 2: the index says
    which outputs there are to check); export and stats take one epoch's folder."""
    if TORCH:
        message = _loader_error(epochs, epoch=0)
        for text in mentions:
            assert text in message, message
    assert_clean_error(packctl("verify", epochs, "--no-attention"), 2, *mentions)


def test_an_epochs_index_that_is_garbage(epochs):
    (epochs / "_epochs.json").write_text("not json")
    _epochs_error(epochs, "_epochs.json", "not readable JSON")


def test_an_epochs_index_pointing_outside_out(epochs):
    outside = epochs.parent / "elsewhere"
    shutil.copytree(epochs / "epoch-00000", outside)
    index = json.loads((epochs / "_epochs.json").read_text())
    index["outputs"][0]["path"] = "../elsewhere"
    (epochs / "_epochs.json").write_text(json.dumps(index))
    _epochs_error(epochs, "_epochs.json", "outputs[0].path", "../elsewhere")


def test_an_epoch_folder_that_is_a_link_outside_out(epochs):
    outside = epochs.parent / "elsewhere"
    (epochs / "epoch-00001").rename(outside)
    os.symlink(outside, epochs / "epoch-00001")
    _epochs_error(epochs, "_epochs.json", "outputs[1].path", "symbolic link")


@pytest.mark.torch
def test_each_epoch_is_checked_like_any_output(epochs, built):
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    folder = epochs / "epoch-00001"
    first = json.loads((folder / "_manifest.json").read_text())["shards"][0]["path"]
    assert first == "data/train-00000.parquet"  # numbered from 0 in each epoch's folder
    assert len(PackedDataset(epochs, epoch=1)) > 0
    _flip_bit(folder)
    with pytest.raises(PackctlError, match="epoch-00001/data/train-00001.parquet: sha256 differs"):
        [item for item in PackedDataset(epochs, epoch=1)]
    result, rules = _verify(folder)
    assert result.code == 1 and "checksum" in rules
    assert len([item for item in PackedDataset(epochs, epoch=0)]) > 0  # the other epoch is intact

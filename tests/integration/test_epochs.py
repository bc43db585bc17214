"""`pack --epochs K`: K outputs in OUT/epoch-0000e, each a full pass over every sequence in its own
shuffled order and packing, from one read of the input; the same bytes for any rank count and
after --resume."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from support.contract import check_contract
from support.adversary import packctl
from packctl import PackConfig, pack
from packctl.errors import PackctlError
from packctl.contract.manifest import epoch_output, read_manifest
from packctl.output.outdir import Faults
from packctl.plan.order import epoch_seed
from support.threadcomm import run_ranks

OPTIONS = dict(capacity=4096, too_long="split", order="shuffle", window=700, shard_rows=60, overwrite=True)


def _pack(tmp_path: Path, sample_data: Path, name: str = "out", **options):
    out = tmp_path / name
    result = pack(PackConfig(inputs=[str(sample_data)], output=str(out), **{**OPTIONS, **options}))
    return result, out


def _column(out: Path, name: str) -> list:
    _, manifest = read_manifest(out)
    return [v for s in manifest["shards"] for v in pq.read_table(out / s["path"], columns=[name])[name].to_pylist()]


def _packs(out: Path) -> dict[str, list]:
    """The written values of every pack, without the `packctl` metadata (it records the run's options)."""
    return {name: _column(out, name) for name in ("input_ids", "labels", "position_ids", "cu_seqlens_padded",
                                                  "sample_ids")}


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "_epochs.json"
                       and not p.name.endswith("metrics.json")):
        text = path.read_bytes()
        if path.name == "_manifest.json":  # where and how it ran, not what it wrote
            manifest = json.loads(text)
            for key in ("timings",):
                manifest.pop(key)
            for key in ("output", "token_transfer", "resume", "memory_budget"):
                manifest["config"].pop(key)
            text = json.dumps(manifest, sort_keys=True).encode()
        h.update(str(path.relative_to(out)).encode() + text)
    return h.hexdigest()


def test_every_epoch_is_a_full_pass_in_its_own_order(tmp_path, sample_data, contract):
    result, out = _pack(tmp_path, sample_data, epochs=3, algorithm="ffs")
    assert sorted(p.name for p in out.iterdir()) == ["_epochs.json", "_metrics.json", "epoch-00000", "epoch-00001",
                                                    "epoch-00002"]
    index = json.loads((out / "_epochs.json").read_text())
    assert index["epochs"] == 3 and [o["path"] for o in index["outputs"]] == ["epoch-00000", "epoch-00001",
                                                                              "epoch-00002"]
    orders = []
    for e in range(3):
        folder = epoch_output(out, e)
        assert check_contract(contract, folder, [sample_data]) == []  # every sample once, identical tokens
        _, manifest = read_manifest(folder)
        assert manifest["epoch"] == {"index": e, "of": 3, "seed": epoch_seed(0, e)}
        assert manifest["counts"]["sequences_packed"] == 2000
        orders.append([gid for pack_ids in _column(folder, "sample_ids") for gid in pack_ids])
    assert all(sorted(set(o)) == list(range(2000)) for o in orders)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    assert result.counts["epochs"] == 3 and result.counts["sequences_packed"] == 2000
    assert result.counts["packs"] == sum(o["packs"] for o in index["outputs"])
    assert result.counts["tokens_packed"] == 3 * result.counts["tokens_in"]
    assert [e["epoch"] for e in result.metrics["epochs"]] == [0, 1, 2]


def test_epoch_e_is_the_packing_of_its_seed(tmp_path, sample_data):
    """Epoch 0 packs as --epochs 1 does, epoch e as --seed epoch_seed(seed, e) and then exchanges
    sequences between its packs at equal cost: as many packs, every sequence once, other packs."""
    _, out = _pack(tmp_path, sample_data, epochs=2, algorithm="ffs", seed=7)
    _, one = _pack(tmp_path, sample_data, "one", seed=7, algorithm="ffs")
    _, other = _pack(tmp_path, sample_data, "other", seed=epoch_seed(7, 1), algorithm="ffs")
    assert _packs(out / "epoch-00000") == _packs(one)
    exchanged, planned = _packs(out / "epoch-00001")["sample_ids"], _packs(other)["sample_ids"]
    assert len(exchanged) == len(planned) and sorted(sum(exchanged, [])) == sorted(sum(planned, []))
    assert exchanged != planned
    _, again = _pack(tmp_path, sample_data, "again", epochs=2, algorithm="ffs", seed=7)
    assert _digest(again) == _digest(out)


def test_one_epoch_is_the_output_without_epochs(tmp_path, sample_data):
    _, out = _pack(tmp_path, sample_data, epochs=1)
    assert (out / "_manifest.json").is_file() and not (out / "_epochs.json").exists()
    _, manifest = read_manifest(out)
    assert "epochs" not in manifest["config"] and "epoch" not in manifest
    metadata = json.loads(pq.read_schema(out / manifest["shards"][0]["path"]).metadata[b"packctl"])
    assert "epochs" not in metadata["config"]


def test_epochs_need_shuffle(tmp_path, sample_data):
    proc = packctl("pack", str(sample_data), "-o", str(tmp_path / "out"), "--epochs", "3")
    assert proc.code == 2
    assert "--epochs 3 with --order input" in proc.stderr and "--order shuffle" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ranks, extra", [(2, {"token_transfer": "read"}), (3, {"token_transfer": "exchange"})])
def test_ranks_write_the_single_process_bytes(tmp_path, sample_data, ranks, extra):
    _, one = _pack(tmp_path, sample_data, "one", epochs=3)
    options = {**OPTIONS, **extra, "epochs": 3}
    run_ranks(ranks, lambda comm: pack(PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "many"),
                                                  **options), comm=comm))
    assert _digest(tmp_path / "many") == _digest(one)


def test_spilled_tokens_write_the_same_bytes(tmp_path, sample_data):
    """A budget far below the corpus: blocks are decoded again and units wait on disk (spilled),
    each sequence's tokens written three times from one decode of its block in materialize."""
    _, held = _pack(tmp_path, sample_data, "held", epochs=3)
    result, spilled = _pack(tmp_path, sample_data, "spilled", epochs=3, memory_budget="2MB")
    assert result.metrics["throughput"]["spilled_bytes"] > 0
    assert result.metrics["throughput"]["blocks_read_twice"] <= result.metrics["throughput"]["blocks"]
    assert _digest(spilled) == _digest(held)


def test_resume_after_a_failed_write(tmp_path, sample_data):
    _, reference = _pack(tmp_path, sample_data, "reference", epochs=2)
    config = PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "out"), **{**OPTIONS, "epochs": 2})
    with pytest.raises(PackctlError, match="No space left"):
        pack(config, faults=Faults(fail_write_after_shards=7))  # epoch 0 has 5 shards: stops in epoch 1
    result = pack(PackConfig(inputs=[str(sample_data)], output=str(tmp_path / "out"),
                             **{**OPTIONS, "epochs": 2, "resume": True}))
    assert result.metrics["throughput"]["resumed_shards"] >= 6
    assert _digest(tmp_path / "out") == _digest(reference)


def test_balanced_steps_are_numbered_per_epoch(tmp_path, sample_data):
    _, out = _pack(tmp_path, sample_data, epochs=2, dp_size=2, micro_batches=2)
    for e in range(2):
        steps = _column(out / f"epoch-{e:05d}", "step")
        assert steps[0] == 0 and steps == sorted(steps)
    proc = packctl("verify", str(out), "--source", str(sample_data), "--no-attention", "--json")
    assert proc.code == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and len(report["epochs"]) == 2
    assert all(r["checks"]["conservation"]["status"] == "ok" for r in report["epochs"])


def test_readers_name_the_epochs(tmp_path, sample_data):
    _, out = _pack(tmp_path, sample_data, epochs=2)
    with pytest.raises(PackctlError, match="one output per epoch"):
        read_manifest(out)
    with pytest.raises(PackctlError, match="holds epochs 0 to 1"):
        epoch_output(out, 2)
    proc = packctl("stats", str(out), str(out / "epoch-00001"))  # comparing: one output each
    assert proc.code == 2 and "epoch-00000" in proc.stderr


@pytest.mark.torch
def test_packed_dataset_reads_one_epoch(tmp_path, sample_data):
    pytest.importorskip("torch")
    from packctl.torch import PackedDataset

    _, out = _pack(tmp_path, sample_data, epochs=2)
    for e in range(2):
        dataset = PackedDataset(out, epoch=e)
        ids = np.concatenate([dataset[i]["sample_ids"] for i in range(len(dataset))])
        assert np.array_equal(np.unique(ids), np.arange(2000))
        assert [int(x) for x in ids] == [g for p in _column(out / f"epoch-{e:05d}", "sample_ids") for g in p]


@pytest.mark.torch
def test_the_documented_epoch_loop(tmp_path, sample_data, monkeypatch):
    pytest.importorskip("torch")
    from support.docs import run_docs_block

    result, _ = _pack(tmp_path, sample_data, "packed-epochs", epochs=3, algorithm="ffs")
    monkeypatch.chdir(tmp_path)
    seen = []
    run_docs_block("epochs", {"train_step": lambda batch: seen.append(batch["input_ids"].numel())})
    assert sum(seen) == result.counts["packs"] * 4096  # every pack of every epoch


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpiexec_writes_the_single_process_bytes(tmp_path, sample_data, ranks):
    mpiexec = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if mpiexec is None:
        pytest.skip("no mpiexec on PATH (pip install 'packctl[mpi]')")
    options = ["--order", "shuffle", "--algorithm", "ffs", "--too-long", "split", "--window", "300",
               "--shard-rows", "40", "--epochs", "3", "--dp-size", "2", "--micro-batches", "2", "--overwrite", "-q"]
    one, many = tmp_path / "one", tmp_path / "many"
    assert packctl("pack", sample_data, "-o", one, *options).code == 0  # in this process
    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "packctl", "pack", str(sample_data),
                           "-o", str(many), *options], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert _digest(many) == _digest(one)
    assert len(json.loads((many / "_metrics.json").read_text())["ranks"]) == ranks

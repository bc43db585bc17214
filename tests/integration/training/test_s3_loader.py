"""`PackedDataset` over an output on S3 (moto's server on 127.0.0.1; tests/support/s3.py): the
same packs, byte for byte, as over the same output on disk, for every data-parallel view, through
a DataLoader's worker processes too (each reads through the shared mirror)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from packctl import PackConfig, pack

pytest.importorskip("torch")
pytest.importorskip("boto3")
from packctl.torch import PackedDataset  # noqa: E402
from support.s3 import s3, s3_server  # noqa: E402,F401  (fixtures)

SAMPLE = Path(__file__).resolve().parents[3] / "sample_data"
OPTIONS = dict(too_long="split", shard_rows=100, dp_size=2, micro_batches=2)


def _same(a: PackedDataset, b: PackedDataset) -> None:
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert list(x) == list(y)
        for key in x:
            if isinstance(y[key], np.ndarray):
                assert x[key].dtype == y[key].dtype and x[key].tobytes() == y[key].tobytes(), (i, key)
            else:
                assert x[key] == y[key], (i, key)


def test_packed_dataset_over_s3_equals_it_over_disk(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PACKCTL_OUTPUT_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "local"
    pack(PackConfig(inputs=[str(SAMPLE)], output=str(local), **OPTIONS))
    url = s3.url("out")
    pack(PackConfig(inputs=[str(SAMPLE)], output=url, **OPTIONS))
    for rank in range(2):
        _same(PackedDataset(url, dp_rank=rank, dp_size=2), PackedDataset(local, dp_rank=rank, dp_size=2))
    assert repr(PackedDataset(url)).startswith(f"PackedDataset('{url}'")


@pytest.mark.slow
def test_a_dataloader_worker_reads_an_output_on_s3(s3, tmp_path, monkeypatch):
    import torch
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PACKCTL_OUTPUT_CACHE", str(tmp_path / "cache"))
    url = s3.url("out")
    pack(PackConfig(inputs=[str(SAMPLE)], output=url, too_long="split", shard_rows=100))
    dataset = PackedDataset(url)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1,
                                         multiprocessing_context="spawn")
    tokens = sum(int(item["num_tokens"]) for item in loader)
    assert tokens == sum(s.tokens for s in dataset.output.shards)

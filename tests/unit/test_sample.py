from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from packctl import PackctlError
from packctl.sample import SampleSpec, generate, write_sample


def test_regenerates_the_committed_sample_data(sample_data):
    tables = generate(SampleSpec(sequences=2000, distribution="lognormal", seed=0))
    committed = sorted(sample_data.glob("*.parquet"))
    assert len(committed) == len(tables) == 4
    for path, table in zip(committed, tables):
        assert pq.read_table(path).equals(table)


@pytest.mark.parametrize("distribution", ["zipf", "lognormal", "rl-longtail"])
def test_distributions(distribution):
    tables = generate(SampleSpec(sequences=5_000, distribution=distribution, shards=3, seed=1))
    ids = np.concatenate([t.column("input_ids").combine_chunks().values.to_numpy() for t in tables])
    labels = np.concatenate([t.column("labels").combine_chunks().values.to_numpy() for t in tables])
    lengths = np.concatenate([np.diff(t.column("input_ids").combine_chunks().offsets.to_numpy()) for t in tables])
    assert sum(t.num_rows for t in tables) == 5_000
    assert ids.min() >= 1 and ids.max() < 32000
    masked = labels == -100
    assert masked.any() and ((labels == ids) | masked).all()
    median = np.median(lengths)
    if distribution == "zipf":
        assert 64 <= lengths.min() and 70 < median < 120 and lengths.max() > 4096
    elif distribution == "lognormal":
        assert 300 < median < 500 and (lengths > 4096).any()
    else:
        assert 1000 < median < 2500 and lengths.max() > 16384


def test_same_seed_same_corpus_and_other_seed_differs():
    a = generate(SampleSpec(sequences=500, seed=3))
    assert all(x.equals(y) for x, y in zip(a, generate(SampleSpec(sequences=500, seed=3))))
    assert not a[0].equals(generate(SampleSpec(sequences=500, seed=4))[0])


def test_refuses_existing_directory(tmp_path):
    write_sample(tmp_path / "c", SampleSpec(sequences=10))
    with pytest.raises(PackctlError, match="--overwrite"):
        write_sample(tmp_path / "c", SampleSpec(sequences=10))
    assert len(write_sample(tmp_path / "c", SampleSpec(sequences=10, shards=2), overwrite=True)) == 2

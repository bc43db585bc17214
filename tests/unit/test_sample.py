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


@pytest.mark.slow
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


@pytest.mark.parametrize("groups", ["none", "rollout"])
@pytest.mark.parametrize("eos, bos", [(32000, None), (32000, 32001), (None, 32001), (32000, 32000)])
def test_eos_and_bos_ids_end_and_start_every_sequence(groups, eos, bos):
    """--eos-id/--bos-id replace each row's last/first token; nothing else changes (same lengths,
    same other tokens, labels follow the tokens), and they occur nowhere else."""
    spec = dict(sequences=300, shards=2, seed=5, groups=groups, max_length=3000)
    plain = generate(SampleSpec(**spec))
    marked = generate(SampleSpec(**spec, eos_id=eos, bos_id=bos))
    for a, b in zip(plain, marked):
        ids_a, ids_b = (t.column("input_ids").combine_chunks() for t in (a, b))
        assert np.array_equal(ids_a.offsets.to_numpy(), ids_b.offsets.to_numpy())
        offsets = ids_b.offsets.to_numpy()
        va, vb = ids_a.values.to_numpy(), ids_b.values.to_numpy()
        special = np.zeros(len(vb), dtype=bool)
        if bos is not None:
            assert (vb[offsets[:-1]] == bos).all()
            special[offsets[:-1]] = True
        if eos is not None:
            assert (vb[offsets[1:] - 1] == eos).all()
            special[offsets[1:] - 1] = True
        assert np.array_equal(va[~special], vb[~special]) and (vb[~special] < 32000).all()
        labels = b.column("labels").combine_chunks().values.to_numpy()
        assert ((labels == vb) | (labels == -100)).all()
        if eos is not None:
            assert (labels[offsets[1:] - 1] == eos).all()  # the EOS is a target
        if groups != "none":
            assert b.column("group_id").equals(a.column("group_id"))


def test_default_corpus_is_unchanged_by_the_special_id_options():
    """Without --eos-id/--bos-id a corpus is the one it was (sample_data and its hashes rely on it)."""
    a = generate(SampleSpec(sequences=200, seed=2))
    b = generate(SampleSpec(sequences=200, seed=2, eos_id=None, bos_id=None))
    assert all(x.equals(y) for x, y in zip(a, b))


def _image_corpus(**options):
    import pyarrow as pa

    table = pa.concat_tables(generate(SampleSpec(modality="image", **options)))
    lengths = np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy())
    ids = table.column("input_ids").combine_chunks().values.to_numpy()
    labels = table.column("labels").combine_chunks().values.to_numpy()
    return table, lengths, ids, labels


@pytest.mark.slow
def test_image_corpus_looks_like_a_llava_mix():
    table, lengths, ids, labels = _image_corpus(sequences=20_000, shards=3, seed=2)
    assert table.schema.field("images").type == table.schema.field("image_tokens").type == "int32"
    images = table.column("images").to_numpy()
    image_tokens = table.column("image_tokens").to_numpy()
    assert 0.37 < (images == 0).mean() < 0.43  # text-only rows
    assert (image_tokens == 576 * images).all()  # one tile of 576 tokens an image
    with_images = images > 0
    assert 1.3 < images[with_images].mean() < 1.8 and 0.6 < (images[with_images] == 1).mean() < 0.8
    assert images.max() <= 16 and (images >= 4).sum() > 50  # a tail of multi-image rows
    # the image tokens are part of input_ids: an image row is longer by them than a text row
    assert (lengths[with_images] >= image_tokens[with_images] + 2).all()
    assert np.median(lengths[with_images]) > np.median(lengths[~with_images]) + 576
    assert np.corrcoef(lengths, images)[0, 1] > 0.5
    # longer text carries more images (multi-image conversations)
    text = lengths - image_tokens
    long_text = with_images & (text > np.median(text[with_images]))
    assert images[long_text].mean() > images[with_images & ~long_text].mean() + 0.1
    # the image tokens open the row, id vocab_size, and are masked in the labels
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    is_image = ids == 32000
    assert is_image.sum() == image_tokens.sum() and (labels[is_image] == -100).all()
    assert (ids[starts[with_images]] == 32000).all() and (ids[starts[~with_images]] < 32000).all()
    assert ((labels == ids) | (labels == -100)).all()


def test_image_tiles_and_max_length():
    table, lengths, _, _ = _image_corpus(sequences=5_000, seed=1, max_tiles=5, max_length=4000)
    images = table.column("images").to_numpy()
    image_tokens = table.column("image_tokens").to_numpy()
    per_image = image_tokens[images > 0] / images[images > 0]
    assert per_image.min() >= 576 and per_image.max() <= 5 * 576 and 1400 < per_image.mean() < 2100
    assert (image_tokens % 576 == 0).all() and lengths.max() <= 4000
    assert (lengths >= image_tokens + 2).all()


def test_image_corpus_is_deterministic_and_leaves_text_corpora_alone():
    a, b = generate(SampleSpec(sequences=400, modality="image", seed=4)), generate(SampleSpec(sequences=400,
                                                                                              modality="image", seed=4))
    assert all(x.equals(y) for x, y in zip(a, b))
    text = generate(SampleSpec(sequences=400, seed=4))
    assert all(x.equals(y) for x, y in zip(text, generate(SampleSpec(sequences=400, seed=4, modality="text"))))
    assert "images" not in text[0].column_names


@pytest.mark.parametrize("options, mention", [
    ({"modality": "video"}, "--modality"),
    ({"modality": "image", "groups": "preference"}, "--groups"),
    ({"modality": "image", "max_length": 577}, "--max-length 578"),
    ({"modality": "image", "max_tiles": 0}, "--max-tiles"),
    ({"modality": "image", "eos_id": 32000}, "--eos-id 32000"),
])
def test_image_options_are_checked(options, mention):
    with pytest.raises(PackctlError, match=mention):
        SampleSpec(sequences=10, **options).validate()

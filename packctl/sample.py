"""`packctl sample`: a deterministic synthetic tokenized corpus, for trying packctl and for tests.

Lengths follow one of three shapes seen in practice:

| distribution | shape | typical use |
|---|---|---|
| `zipf` | power law (Pareto, alpha 1.2, from 64 tokens): many short documents, a heavy tail | pre-training |
| `lognormal` | lognormal, median ~400, mean ~600 tokens | SFT conversations |
| `rl-longtail` | prompt (~300) + response (median ~1.1k) with a long tail and a spike at the generation limit 16384 | RL rollouts |

Token ids are Zipf-distributed over the vocabulary (like text). Labels equal the tokens except on
a share of the rows (all of them for `rl-longtail`), where a prompt prefix is masked with -100.

Grouped corpora (`groups`, for `packctl pack --group-column group_id`): every group shares one
prompt (lognormal, median ~245 tokens, masked in the labels) followed by a response of its own,
whose length follows the distribution; an int64 `group_id` column numbers the groups 0, 1, ...

    preference            rows 2g, 2g+1: prompt g + chosen, prompt g + rejected (DPO/KTO pairs)
    rollout, group_size N rows Ng..Ng+N-1: prompt g + each of N sampled responses (GRPO)

Vision-language corpora (`modality="image"`, for `--limit images=N` / `image_tokens=N`), modelled
on LLaVA-style SFT mixes, where each image is expanded into its tokens inside `input_ids`:

    images        int32: 0 on a text-only row (about 40%), else 1 + Poisson(0.35 x text / 400)
                  (mostly one image; longer conversations carry more: multi-image, interleaved),
                  at most 16
    image_tokens  int32: the row's image tokens, `image_tokens` (576: a 24 x 24 CLIP grid) per
                  tile, each image 1..`max_tiles` tiles (1: fixed 576 as LLaVA-1.5; 5: the
                  576-2880 of LLaVA-NeXT's any-resolution tiling)
    input_ids     the image tokens (id `vocab_size`, one past the text ids, as LLaVA-1.5's 32000
                  beside a 32000-token vocabulary) first, then the text; length = text + image tokens
    labels        -100 on the image tokens (and on a masked prompt of the text, as above)

So both columns grow with the length: an image row is at least 576 tokens longer than its text.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import offsets_of, positions_in_segments
from packctl.config import as_python
from packctl.contract.schema import IGNORE_INDEX, INT32_MAX
from packctl.errors import PackctlError
from packctl.output.fs import write_failed

DISTRIBUTIONS = ("zipf", "lognormal", "rl-longtail")
GROUP_KINDS = ("none", "preference", "rollout")
MODALITIES = ("text", "image")
IMAGE_SHARE = 0.6  # rows with one image or more (LLaVA-style mixes hold ~40% text-only rows)
MAX_IMAGES = 16  # images of one row at most
RL_GENERATION_LIMIT = 16384


@dataclass(frozen=True)
class SampleSpec:
    sequences: int = 3000
    distribution: str = "lognormal"
    shards: int = 4
    seed: int = 0
    vocab_size: int = 32000
    max_length: int = 32768
    prompt_fraction: float = 0.5  # share of rows whose labels mask a prompt prefix
    groups: str = "none"  # GROUP_KINDS
    group_size: int = 4  # responses per prompt of `rollout` (`preference`: 2)
    eos_id: int | None = None  # every row ends with it (its last token replaced), for EOS-delimited readers
    bos_id: int | None = None  # every row starts with it (its first token replaced)
    modality: str = "text"  # MODALITIES: "image" adds images and image tokens (module docstring)
    image_tokens: int = 576  # tokens per image tile (modality image)
    max_tiles: int = 1  # tiles per image, drawn in [1, max_tiles] (modality image)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # numpy scalars as their Python value (np.int64(8) -> 8)
            object.__setattr__(self, name, as_python(value))

    def validate(self) -> SampleSpec:
        """Raise PackctlError naming the option (its `packctl sample` flag) for any value that
        cannot make a corpus, before anything is written."""
        for name, value in vars(self).items():
            wanted = _TYPES[name]
            if value is None and name in _OPTIONAL:
                continue
            if wanted == "a number":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            elif wanted == "a whole number":
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, str)
            if not ok:
                raise PackctlError(f"--{name.replace('_', '-')} {value!r}: must be {wanted}")
        for name, (low, high, why) in _RANGES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not low <= value <= high:
                raise PackctlError(f"--{name.replace('_', '-')} {value}: must be in [{low:,}, {high:,}] ({why})")
        if self.shards > self.sequences:
            raise PackctlError(f"--shards {self.shards} with --sequences {self.sequences}: a shard would be empty; "
                               f"use --shards {self.sequences} or less")
        if not 0 <= self.prompt_fraction <= 1:
            raise PackctlError(f"--prompt-fraction {self.prompt_fraction}: must be a share in [0, 1]")
        if self.distribution not in DISTRIBUTIONS:
            raise PackctlError(f"--distribution {self.distribution!r}: choose one of {', '.join(DISTRIBUTIONS)}")
        if self.groups not in GROUP_KINDS:
            raise PackctlError(f"--groups {self.groups!r}: choose one of {', '.join(GROUP_KINDS)}")
        if self.groups == "rollout" and self.group_size < 2:
            raise PackctlError(f"--group-size {self.group_size}: a rollout group holds 2 or more responses")
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None and 1 <= value < self.vocab_size:
                raise PackctlError(f"--{name.replace('_', '-')} {value}: ids inside sequences are drawn from "
                                   f"[1, {self.vocab_size}) (--vocab-size), so it would appear inside them too; use "
                                   f"{self.vocab_size} or more")
        if self.eos_id is not None and self.bos_id is not None and self.max_length < 2:
            raise PackctlError(f"--max-length {self.max_length}: a row that starts with --bos-id and ends with "
                               "--eos-id holds 2 tokens or more")
        if self.modality not in MODALITIES:
            raise PackctlError(f"--modality {self.modality!r}: choose one of {', '.join(MODALITIES)}")
        if self.modality == "image":
            if self.groups != "none":
                raise PackctlError(f"--modality image with --groups {self.groups}: image corpora are ungrouped; "
                                   "pass --groups none")
            if self.image_tokens * self.max_tiles + 2 > self.max_length:
                raise PackctlError(f"--max-length {self.max_length}: an image of up to {self.max_tiles} tile(s) of "
                                   f"{self.image_tokens} tokens (--max-tiles, --image-tokens) and 2 text tokens must "
                                   f"fit; use --max-length {self.image_tokens * self.max_tiles + 2} or more")
            for name in _OPTIONAL:
                if getattr(self, name) == self.vocab_size:
                    raise PackctlError(f"--{name.replace('_', '-')} {self.vocab_size}: --modality image writes image "
                                       f"tokens as id {self.vocab_size} (--vocab-size); use another id")
        if self.groups != "none" and self.max_length < 2:
            raise PackctlError(f"--max-length {self.max_length}: a grouped row holds a prompt and a response, "
                               "2 tokens or more")
        return self


# What each option of SampleSpec is, and the range of the whole numbers (with why).
_TYPES = {"sequences": "a whole number", "distribution": "a string", "shards": "a whole number",
          "seed": "a whole number", "vocab_size": "a whole number", "max_length": "a whole number",
          "prompt_fraction": "a number", "groups": "a string", "group_size": "a whole number",
          "eos_id": "a whole number", "bos_id": "a whole number", "modality": "a string",
          "image_tokens": "a whole number", "max_tiles": "a whole number"}
_OPTIONAL = ("eos_id", "bos_id")
_RANGES = {
    "sequences": (1, INT32_MAX, "the corpus is generated in memory"),
    "shards": (1, INT32_MAX, "one file each"),
    "seed": (0, 2**63 - 1, "seeds are 63-bit"),
    "vocab_size": (2, INT32_MAX + 1, "token ids are drawn from [1, vocab-size) and are int32"),
    "max_length": (1, INT32_MAX, "token offsets are int32"),
    "group_size": (1, INT32_MAX, "rows of a group"),
    "eos_id": (0, INT32_MAX, "token ids are int32"),
    "bos_id": (0, INT32_MAX, "token ids are int32"),
    "image_tokens": (1, 1 << 20, "tokens of one image tile"),
    "max_tiles": (1, 64, "tiles of one image"),
}


def sample_lengths(rng: np.random.Generator, n: int, distribution: str, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, prompt lengths) for `n` sequences; prompt length 0 where no prefix is masked."""
    if distribution == "zipf":
        lengths = np.floor(64 * (1 + rng.pareto(1.2, n)))
        prompts = np.zeros(n)
    elif distribution == "lognormal":
        lengths = np.ceil(rng.lognormal(6.0, 0.9, n))
        prompts = np.zeros(n)
    elif distribution == "rl-longtail":
        prompts = np.ceil(rng.lognormal(5.5, 0.6, n))
        responses = np.minimum(np.ceil(rng.lognormal(7.0, 1.0, n)), RL_GENERATION_LIMIT)
        lengths = prompts + responses
    else:
        raise PackctlError(f"--distribution {distribution!r}: choose one of {', '.join(DISTRIBUTIONS)}")
    lengths = np.clip(lengths, min(2, max_length), max_length).astype(np.int64)
    prompts = np.minimum(prompts.astype(np.int64), lengths - 1)
    return lengths, prompts


def generate(spec: SampleSpec) -> list[pa.Table]:
    """The corpus as one Arrow table per shard (columns `input_ids`, `labels`: list<int32>, with
    `groups` an int64 `group_id`, with modality image int32 `images` and `image_tokens`)."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    images = None
    if spec.groups != "none":
        lengths, prompts, tokens, group = _grouped(rng, spec)
    elif spec.modality == "image":
        lengths, prompts, tokens, images, image_tokens = _with_images(rng, spec)
        group = None
    else:
        lengths, prompts, tokens, group = (*_ungrouped(rng, spec), None)
    offsets = offsets_of(lengths)
    if spec.bos_id is not None:
        tokens[offsets[:-1]] = spec.bos_id
    if spec.eos_id is not None:
        tokens[offsets[1:] - 1] = spec.eos_id
    labels = tokens.copy()
    labels[positions_in_segments(lengths) < np.repeat(prompts, lengths)] = IGNORE_INDEX
    bounds = np.linspace(0, spec.sequences, spec.shards + 1).astype(np.int64)
    per_shard = np.diff(offsets[bounds])
    if per_shard.max() > INT32_MAX:  # the list offsets of a shard are int32
        enough = 2 * -(-int(offsets[-1]) // INT32_MAX)
        raise PackctlError(f"--shards {spec.shards}: a shard would hold {int(per_shard.max()):,} tokens, more than "
                           f"2^31-1 (Parquet list offsets are int32); use --shards {enough} or more")
    tables = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rel = (offsets[lo:hi + 1] - offsets[lo]).astype(np.int32)
        span = slice(int(offsets[lo]), int(offsets[hi]))
        columns = {
            "input_ids": pa.ListArray.from_arrays(pa.array(rel), pa.array(tokens[span])),
            "labels": pa.ListArray.from_arrays(pa.array(rel), pa.array(labels[span])),
        }
        if group is not None:
            columns["group_id"] = pa.array(group[lo:hi], pa.int64())
        if images is not None:
            columns["images"] = pa.array(images[lo:hi], pa.int32())
            columns["image_tokens"] = pa.array(image_tokens[lo:hi], pa.int32())
        tables.append(pa.table(columns))
    return tables


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    # Zipf-distributed ids in [1, vocab): frequent ids small, as with BPE vocabularies; 0 stays free for padding.
    return (1 + (rng.zipf(1.2, n) - 1) % (vocab_size - 1)).astype(np.int32)


def _ungrouped(rng: np.random.Generator, spec: SampleSpec, *, tokens: bool = True
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(lengths, masked prompt lengths, tokens) of independent rows (tokens None: not drawn)."""
    lengths, prompts = sample_lengths(rng, spec.sequences, spec.distribution, spec.max_length)
    if spec.distribution != "rl-longtail":
        # SFT-style rows: a prompt of 10-50% of the sequence is masked on `prompt_fraction` rows.
        masked = rng.random(spec.sequences) < spec.prompt_fraction
        share = rng.uniform(0.1, 0.5, spec.sequences)
        prompts = np.where(masked, np.maximum(1, (lengths * share).astype(np.int64)), 0)
        prompts = np.minimum(prompts, lengths - 1)
    return lengths, prompts, _token_ids(rng, int(lengths.sum()), spec.vocab_size) if tokens else None


def _with_images(rng: np.random.Generator, spec: SampleSpec
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, masked prompt lengths, tokens, images, image tokens) of a vision-language corpus."""
    lengths, prompts, images, image_tokens = sample_image_rows(rng, spec)
    tokens = _token_ids(rng, int(lengths.sum()), spec.vocab_size)
    tokens[positions_in_segments(lengths) < np.repeat(image_tokens, lengths)] = spec.vocab_size
    return lengths, prompts, tokens, images, image_tokens


def sample_image_rows(rng: np.random.Generator, spec: SampleSpec
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, masked prompt lengths, images, image tokens) of the rows of a vision-language
    corpus (the module docstring says how it is modelled), without their tokens: what the
    benchmarks pack."""
    n = spec.sequences
    text, prompts, _ = _ungrouped(rng, spec, tokens=False)
    with_image = rng.random(n) < IMAGE_SHARE
    images = np.where(with_image, 1 + rng.poisson(0.35 * text / 400), 0).clip(0, MAX_IMAGES)
    row_of_image = np.repeat(np.arange(n), images)
    per_image = rng.integers(1, spec.max_tiles + 1, int(images.sum())) * spec.image_tokens
    # the row must fit --max-length with 2 text tokens: its last images go first (never the first one)
    start = np.repeat(np.cumsum(images) - images, images)
    cumulative = np.cumsum(per_image)
    within_row = cumulative - np.concatenate([[0], cumulative])[start]
    kept = within_row + 2 <= spec.max_length
    images = np.bincount(row_of_image[kept], minlength=n)
    image_tokens = np.bincount(row_of_image[kept], weights=per_image[kept], minlength=n).astype(np.int64)
    text = np.maximum(2, np.minimum(text, spec.max_length - image_tokens))
    prompts = np.minimum(prompts, text - 1)
    lengths = text + image_tokens
    return lengths, prompts + image_tokens, images.astype(np.int32), image_tokens.astype(np.int32)


def _grouped(rng: np.random.Generator, spec: SampleSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, masked prompt lengths, tokens, group of each row): the rows of a group repeat its
    prompt's tokens, then each has a response of its own."""
    size = 2 if spec.groups == "preference" else spec.group_size
    group = np.arange(spec.sequences, dtype=np.int64) // size
    num_groups = int(group[-1]) + 1
    group_prompts = np.clip(np.ceil(rng.lognormal(5.5, 0.6, num_groups)), 1, spec.max_length - 1).astype(np.int64)
    responses, _ = sample_lengths(rng, spec.sequences, spec.distribution, spec.max_length)
    prompts = group_prompts[group]
    lengths = np.minimum(prompts + responses, spec.max_length)
    prompt_tokens = _token_ids(rng, int(group_prompts.sum()), spec.vocab_size)
    row = np.repeat(np.arange(spec.sequences), lengths)
    position = positions_in_segments(lengths)
    in_prompt = position < prompts[row]
    tokens = np.empty(int(lengths.sum()), dtype=np.int32)
    tokens[in_prompt] = prompt_tokens[(offsets_of(group_prompts)[group[row]] + position)[in_prompt]]
    tokens[~in_prompt] = _token_ids(rng, int((~in_prompt).sum()), spec.vocab_size)
    return lengths, prompts, tokens, group


_SHARD_NAME = re.compile(r"shard-\d{5}\.parquet")


def write_sample(out: str | Path, spec: SampleSpec, *, overwrite: bool = False, progress=None) -> list[Path]:
    """Write the corpus as `shard-00000.parquet ...` under `out`; returns the paths. `progress` (a
    `packctl.pipeline.Progress`) shows stages `generate` and `write` (shards).

    The options are checked and the corpus generated before `out` is touched; a write that fails
    (a full disk, a read-only place) removes what was written, and says where and why."""
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise PackctlError(f"{out}: already exists; pass --overwrite to replace it")
    if out.is_dir() and not out.is_symlink():
        # --overwrite replaces a corpus this command wrote, never a directory of other files
        other = next((p.name for p in sorted(out.iterdir()) if not _SHARD_NAME.fullmatch(p.name)), None)
        if other is not None:
            raise PackctlError(f"{out}: holds {other}, which packctl sample did not write; --overwrite replaces a "
                               "directory of shard-NNNNN.parquet files only: choose another -o")
    if progress is not None:
        progress.stage("generate", None)
    tables = generate(spec)  # checks the options first
    advance = progress.stage("write", len(tables)) if progress is not None else lambda n: None
    try:
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        elif out.exists() or out.is_symlink():
            out.unlink()
        out.mkdir(parents=True)
    except OSError as exc:
        raise PackctlError(f"{out}: cannot be created ({exc.strerror or exc}); choose another -o") from None
    paths = []
    path = out
    try:
        for k, table in enumerate(tables):
            path = out / f"shard-{k:05d}.parquet"
            pq.write_table(table, path, compression="zstd", compression_level=9)
            paths.append(path)
            advance(1)
    except OSError as exc:
        shutil.rmtree(out, ignore_errors=True)
        # Arrow's own text ("Error writing bytes to file. Detail: ...") says less than the errno
        cause = OSError(exc.errno, os.strerror(exc.errno)) if exc.errno else exc
        raise write_failed(path, cause) from None
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return paths

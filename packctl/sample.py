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
        if self.groups != "none" and self.max_length < 2:
            raise PackctlError(f"--max-length {self.max_length}: a grouped row holds a prompt and a response, "
                               "2 tokens or more")
        return self


# What each option of SampleSpec is, and the range of the whole numbers (with why).
_TYPES = {"sequences": "a whole number", "distribution": "a string", "shards": "a whole number",
          "seed": "a whole number", "vocab_size": "a whole number", "max_length": "a whole number",
          "prompt_fraction": "a number", "groups": "a string", "group_size": "a whole number",
          "eos_id": "a whole number", "bos_id": "a whole number"}
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
    """The corpus as one Arrow table per shard (columns `input_ids`, `labels`: list<int32>, and
    with `groups` an int64 `group_id`)."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    if spec.groups != "none":
        lengths, prompts, tokens, group = _grouped(rng, spec)
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
        tables.append(pa.table(columns))
    return tables


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    # Zipf-distributed ids in [1, vocab): frequent ids small, as with BPE vocabularies; 0 stays free for padding.
    return (1 + (rng.zipf(1.2, n) - 1) % (vocab_size - 1)).astype(np.int32)


def _ungrouped(rng: np.random.Generator, spec: SampleSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, masked prompt lengths, tokens) of independent rows."""
    lengths, prompts = sample_lengths(rng, spec.sequences, spec.distribution, spec.max_length)
    if spec.distribution != "rl-longtail":
        # SFT-style rows: a prompt of 10-50% of the sequence is masked on `prompt_fraction` rows.
        masked = rng.random(spec.sequences) < spec.prompt_fraction
        share = rng.uniform(0.1, 0.5, spec.sequences)
        prompts = np.where(masked, np.maximum(1, (lengths * share).astype(np.int64)), 0)
        prompts = np.minimum(prompts, lengths - 1)
    return lengths, prompts, _token_ids(rng, int(lengths.sum()), spec.vocab_size)


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


def write_sample(out: str | Path, spec: SampleSpec, *, overwrite: bool = False) -> list[Path]:
    """Write the corpus as `shard-00000.parquet ...` under `out`; returns the paths.

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
    tables = generate(spec)  # checks the options first
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
    except OSError as exc:
        shutil.rmtree(out, ignore_errors=True)
        # Arrow's own text ("Error writing bytes to file. Detail: ...") says less than the errno
        cause = OSError(exc.errno, os.strerror(exc.errno)) if exc.errno else exc
        raise write_failed(path, cause) from None
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return paths

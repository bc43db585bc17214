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

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl.arrays import offsets_of, positions_in_segments
from packctl.contract.schema import IGNORE_INDEX
from packctl.errors import PackctlError

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
    lengths = np.clip(lengths, 2, max_length).astype(np.int64)
    prompts = np.minimum(prompts.astype(np.int64), lengths - 1)
    return lengths, prompts


def generate(spec: SampleSpec) -> list[pa.Table]:
    """The corpus as one Arrow table per shard (columns `input_ids`, `labels`: list<int32>, and
    with `groups` an int64 `group_id`)."""
    if spec.sequences < 1 or spec.shards < 1 or spec.vocab_size < 2 or spec.max_length < 2:
        raise PackctlError("--sequences, --shards must be >= 1 and --vocab-size, --max-length >= 2")
    if spec.groups not in GROUP_KINDS:
        raise PackctlError(f"--groups {spec.groups!r}: choose one of {', '.join(GROUP_KINDS)}")
    if spec.group_size < 1:
        raise PackctlError(f"--group-size {spec.group_size}: must be >= 1")
    rng = np.random.default_rng(spec.seed)
    if spec.groups != "none":
        lengths, prompts, tokens, group = _grouped(rng, spec)
    else:
        lengths, prompts, tokens, group = (*_ungrouped(rng, spec), None)
    labels = tokens.copy()
    labels[positions_in_segments(lengths) < np.repeat(prompts, lengths)] = IGNORE_INDEX
    offsets = offsets_of(lengths)
    bounds = np.linspace(0, spec.sequences, spec.shards + 1).astype(np.int64)
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


def write_sample(out: str | Path, spec: SampleSpec, *, overwrite: bool = False) -> list[Path]:
    """Write the corpus as `shard-00000.parquet ...` under `out`; returns the paths."""
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise PackctlError(f"{out}: already exists; pass --overwrite to replace it")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True)
    paths = []
    for k, table in enumerate(generate(spec)):
        path = out / f"shard-{k:05d}.parquet"
        pq.write_table(table, path, compression="zstd", compression_level=9)
        paths.append(path)
    return paths

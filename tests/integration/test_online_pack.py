"""The online API plans what `packctl pack` plans: the packs of `plan_packs` are those of a real
`pack --plan-only --order input` of a Parquet file holding sequences of those lengths, for every
algorithm, and the steps of `plan_steps` those of `pack --dp-size --micro-batches`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import packctl
from packctl.plan.names import ALGORITHMS
from support.data import write_table
from support.runs import pack_to

LENGTHS = np.random.default_rng(7).integers(1, 300, 240)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rows = [list(range(1, int(n) + 1)) for n in LENGTHS]
    return write_table(tmp_path_factory.mktemp("online") / "lengths.parquet", {"input_ids": rows})


def written_packs(out: Path) -> list[list[tuple[int, int, int]]]:
    """(sample id, first token, tokens) of each piece, pack by pack, as the plan's shards hold them."""
    table = pq.read_table(out / "data", columns=["sample_ids", "seq_starts", "seq_lens"])
    return [list(zip(*(table[c][row].as_py() for c in ("sample_ids", "seq_starts", "seq_lens"))))
            for row in range(table.num_rows)]


def api_packs(packs) -> list[list[tuple[int, int, int]]]:
    return [list(zip(packs.sequence[a:b].tolist(), packs.start[a:b].tolist(), packs.length[a:b].tolist()))
            for a, b in zip(packs.offsets[:-1], packs.offsets[1:])]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_plan_packs_is_the_plan_of_pack(tmp_path, corpus, algorithm):
    options = dict(capacity=512, algorithm=algorithm, too_long="split", cp_size=2, seed=3)
    _, out = pack_to(tmp_path, [corpus], plan_only=True, order="input", window=10_000, **options)
    packs = packctl.plan_packs(LENGTHS, 512, algorithm=algorithm, too_long="split", align=4, seed=3)
    assert api_packs(packs) == written_packs(out)


def test_plan_steps_are_the_steps_of_pack(tmp_path, corpus):
    _, out = pack_to(tmp_path, [corpus], plan_only=True, order="input", window=10_000, capacity=1024,
                     dp_size=4, micro_batches=3, balance="attention", attn_coeff=64.0)
    steps = packctl.plan_steps(LENGTHS, dp_size=4, micro_batches=3, capacity=1024, attn_coeff=64.0)
    table = pq.read_table(out / "data", columns=["step", "dp_rank", "micro_batch"])
    assert api_packs(steps.packs) == written_packs(out)
    assert steps.step.tolist() == table["step"].to_pylist()
    assert steps.rank.tolist() == table["dp_rank"].to_pylist()
    assert steps.micro_batch.tolist() == table["micro_batch"].to_pylist()


def test_groups_are_kept_as_pack_keeps_them(tmp_path):
    groups = np.arange(len(LENGTHS)) // 3  # a prompt's three rollouts, next to each other
    rows = [list(range(1, int(n) + 1)) for n in LENGTHS]
    source = write_table(tmp_path / "groups.parquet", {"input_ids": rows, "prompt": groups.tolist()})
    _, out = pack_to(tmp_path, [source], plan_only=True, order="input", window=10_000, capacity=1024,
                     group_column="prompt")
    packs = packctl.plan_packs(LENGTHS, 1024, groups=groups)
    assert api_packs(packs) == written_packs(out)

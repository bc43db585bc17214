"""Distributed runs: tests launch `mpiexec` themselves, under a timeout."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.runs import assert_ranks_shared_the_run
from support.paths import MPIEXEC, ROOT, SUPPORT

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install 'packctl[mpi]')")


def mpirun(n: int, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([MPIEXEC, "-n", str(n), *args], capture_output=True, text=True, timeout=timeout)


SORTS = [(5000, 7), (20000, 10**9), (3, 2)]  # (n_total, key_range): many ties, few ties, fewer keys than ranks


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_sample_sort_matches_a_single_process_sort(ranks):
    """Every (n_total, key_range) of SORTS in one launch of `ranks` processes."""
    proc = mpirun(ranks, sys.executable, str(SUPPORT / "samplesort_check.py"), *(str(v) for sort in SORTS for v in sort))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for n_total, key_range in SORTS:
        assert f"ok {ranks} ranks: {n_total} keys in [0, {key_range})" in proc.stdout


def _pack_cmd(out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "packctl", "pack", str(ROOT / "sample_data"), "-o", str(out), "--overwrite",
            "-q", *options]


def _fingerprint(out: Path) -> tuple[list[str], dict]:
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest.pop("timings")
    return [s["sha256"] for s in manifest["shards"]], manifest


OPTIONS = ["--too-long", "split", "--window", "300", "--shard-rows", "40"]


BALANCED = ["--dp-size", "4", "--micro-batches", "2", "--lr-scaling", "sqrt"]


# Every rank count from 1 to 8 (2 and 3 for the last two) writes these bytes in
# tests/integration/test_scaleout.py::test_any_number_of_in_process_ranks_writes_the_single_process_bytes;
# here mpiexec runs some of the counts, each rank a process of its own talking through MPI.
@pytest.mark.parametrize("order, algorithm, extra, ranks", [
    ("input", "concat", [], (1, 4)),
    ("shuffle", "ffs", [], (3,)),
    ("curriculum", "bfd", [], (2, 5)),
    ("shuffle", "ffs", BALANCED, (3,)),
    # one shard of several row groups, cut between writers and joined; tokens read, not exchanged
    ("input", "bfd", ["--shard-rows", "1024", "--token-transfer", "read"], (2,)),
    # the stratified pack order and near ties of --order shuffle, packs and whole steps
    ("shuffle", "bfd", [], (1, 2, 3)),
    ("shuffle", "mffd", BALANCED, (2, 3)),
])
def test_same_bytes_for_any_number_of_ranks(tmp_path, order, algorithm, extra, ranks, contract):
    from support.adversary import packctl
    from support.contract import check_contract

    out = tmp_path / "out"
    options = [*OPTIONS, "--order", order, "--algorithm", algorithm, *extra]
    single = packctl(*_pack_cmd(out, *options)[3:])  # the same command line, in this process
    assert single.code == 0, single.stderr
    reference = _fingerprint(out)
    assert len(reference[0]) > 4 or "--shard-rows" in extra
    assert check_contract(contract, out, [ROOT / "sample_data"]) == []
    for n in ranks:
        proc = mpirun(n, *_pack_cmd(out, *options))
        assert proc.returncode == 0, proc.stderr
        assert _fingerprint(out) == reference, f"{n} ranks"
        assert_ranks_shared_the_run(json.loads((out / "_metrics.json").read_text()), n, 2000)


def test_a_rank_that_fails_stops_all_ranks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for path in sorted((ROOT / "sample_data").glob("*.parquet")):
        shutil.copy(path, corpus / path.name)
    last = corpus / "shard-00003.parquet"  # read by the last rank only
    table = pq.read_table(last)
    ids = table.column("input_ids").to_pylist()
    ids[10][5] = -7
    pq.write_table(table.set_column(0, "input_ids", pa.array(ids, pa.list_(pa.int32()))), last)
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = mpirun(4, sys.executable, "-m", "packctl", "pack", str(corpus), "-o", str(out), "--too-long", "split",
                  timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    assert "rank 3: " in proc.stderr and "shard-00003.parquet row 10 column 'input_ids': value -7" in proc.stderr
    assert proc.stderr.count("value -7") == 1
    assert not (out / "_manifest.json").exists()


def test_errors_found_before_reading_are_printed_once(tmp_path):
    proc = mpirun(3, sys.executable, "-m", "packctl", "pack", str(ROOT / "sample_data"), "-o", str(tmp_path / "o"))
    assert proc.returncode != 0
    assert proc.stderr.count("is longer than the capacity 4096") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [[], BALANCED])
def test_a_plan_and_its_materialization_are_the_same_for_any_number_of_ranks(tmp_path, extra):
    """`pack --plan-only` under mpiexec writes the single-process plan, and `packctl materialize`
    under mpiexec writes the shards `pack` writes in one process."""
    from support.adversary import packctl

    options = [*OPTIONS, "--order", "shuffle", *extra]
    direct, plan, materialized = tmp_path / "direct", tmp_path / "plan", tmp_path / "materialized"
    assert packctl(*_pack_cmd(direct, *options)[3:]).code == 0
    assert packctl(*_pack_cmd(plan, *options, "--plan-only")[3:]).code == 0
    plan_shards = _fingerprint(plan)[0]
    proc = mpirun(3, *_pack_cmd(plan, *options, "--plan-only"))
    assert proc.returncode == 0, proc.stderr
    assert _fingerprint(plan)[0] == plan_shards
    proc = mpirun(3, sys.executable, "-m", "packctl", "materialize", str(plan), "-o", str(materialized), "-q")
    assert proc.returncode == 0, proc.stderr
    assert _fingerprint(materialized)[0] == _fingerprint(direct)[0]


# Options that add to _metrics.json, each packed by 3 MPI processes: the figures of the whole plan
# (tests/integration/test_metrics_summaries.py runs many more in one process and in-process ranks).
METRIC_CASES = {
    "balance-sqrt": ["--order", "shuffle", "--too-long", "split", "--window", "300", *BALANCED],
    "batch-buckets": ["--mode", "batch", "--too-long", "truncate", "--window", "400", "--shape-buckets", "3"],
    "epochs": ["--order", "shuffle", "--too-long", "split", "--window", "500", "--epochs", "2",
               "--algorithm", "ffs"],
    "groups-step": ["--group-column", "group_id", "--group-scope", "step", "--dp-size", "2",
                    "--micro-batches", "2", "--window", "40", "--capacity", "8192"],
}


@pytest.mark.parametrize("name", list(METRIC_CASES))
def test_metrics_of_three_processes_are_those_of_the_whole_plan(tmp_path, name):
    from packctl.sample import SampleSpec, write_sample
    from support.whole_plan_metrics import assert_same_report, manifest_config, reference_metrics, written_metrics

    options = METRIC_CASES[name]
    source = ROOT / "sample_data"
    if "--group-column" in options:
        source = tmp_path / "grouped"
        write_sample(source, SampleSpec(sequences=600, shards=3, seed=6, max_length=900, groups="rollout"))
    out = tmp_path / "out"
    proc = mpirun(3, sys.executable, "-m", "packctl", "pack", str(source), "-o", str(out), "-q", *options)
    assert proc.returncode == 0, proc.stderr
    assert_same_report(written_metrics(out), reference_metrics(manifest_config(out)))


def test_more_ranks_than_windows_and_uneven_group_windows_write_the_same_bytes(tmp_path):
    """4 processes for 2 windows (two plan nothing); 3 for 7 windows of groups of 1 to 12 sequences."""
    import numpy as np

    from support.adversary import packctl
    from support.data import write_table

    rng = np.random.default_rng(5)
    group = np.repeat(np.arange(70), rng.integers(1, 13, 70))
    rows = [[int(t) for t in rng.integers(1, 1000, n)] for n in rng.integers(5, 300, len(group))]
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    half = len(rows) // 2
    for k, (lo, hi) in enumerate([(0, half), (half, len(rows))]):
        write_table(grouped / f"g{k}.parquet", {"input_ids": rows[lo:hi], "g": group[lo:hi].tolist()})
    for source, options, n in [
        (ROOT / "sample_data", ["--too-long", "split", "--window", "1000", "--shard-rows", "100"], 4),
        (grouped, ["--group-column", "g", "--capacity", "8192", "--window", "10", "--order", "shuffle",
                   "--shard-rows", "20"], 3),
    ]:
        out = tmp_path / "out"
        args = ["pack", str(source), "-o", str(out), "--overwrite", "-q", *options]
        single = packctl(*args)
        assert single.code == 0, single.stderr
        reference = _fingerprint(out)
        proc = mpirun(n, sys.executable, "-m", "packctl", *args)
        assert proc.returncode == 0, proc.stderr
        assert _fingerprint(out) == reference, f"{n} ranks"
        planned = [r["sequences_planned"] for r in json.loads((out / "_metrics.json").read_text())["ranks"]]
        assert len(planned) == n and sum(planned) == json.loads((out / "_manifest.json").read_text())["counts"][
            "sequences_in"]


@pytest.mark.torch
def test_a_megatron_input_under_mpi_writes_the_bytes_of_its_parquet_twin(tmp_path):
    """Pairs written by megatron-core, 1 and 3 ranks under mpiexec: the shards' data columns are
    those of the same documents packed from Parquet in one process, and 3 ranks write the bytes of
    one."""
    import numpy as np

    from support.adversary import packctl
    from support.megatron import build_with_megatron, data_columns, random_documents, write_twin

    for k, name in enumerate(("a", "b", "c", "d")):
        documents = random_documents(k, 150, high=60000, max_length=80)
        build_with_megatron(tmp_path / "megatron" / name, documents, np.uint16)
        write_twin(tmp_path / "parquet" / f"{name}.parquet", documents, row_group_size=40)
    options = ["--capacity", "256", "--too-long", "split", "--order", "shuffle", "--algorithm", "ffs",
               "--shard-rows", "30", "-q", "--overwrite"]
    twin = packctl("pack", str(tmp_path / "parquet"), "-o", str(tmp_path / "twin"), *options)
    assert twin.code == 0, twin.stderr
    digests = {}
    for n in (1, 3):
        out = tmp_path / f"out-{n}"
        proc = mpirun(n, sys.executable, "-m", "packctl", "pack", str(tmp_path / "megatron"), "-o", str(out), *options)
        assert proc.returncode == 0, proc.stderr
        assert data_columns(out) == data_columns(tmp_path / "twin")
        digests[n] = _fingerprint(out)[0]
    assert digests[1] == digests[3]


@pytest.mark.mpi
def test_limits_under_three_processes_write_the_single_process_bytes(tmp_path, contract):
    """A synthetic vision-language corpus packed under --limit images=N --limit image_tokens=M, in one
    process and under mpiexec -n 3 (shuffled, windows on every rank, sequences over a limit
    dropped): the same bytes, every pack within every limit, the contract checker passing."""
    import pyarrow.parquet as pq

    from support.adversary import packctl
    from support.contract import check_contract
    from support.data import sample_corpus

    corpus = sample_corpus(tmp_path / "vlm", sequences=3000, modality="image", max_tiles=2, max_length=3000,
                           shards=3)
    out = tmp_path / "out"
    args = ["pack", str(corpus), "-o", str(out), "--overwrite", "-q", "--capacity", "4096", "--order", "shuffle",
            "--window", "500", "--too-long", "drop", "--limit", "images=3", "--limit", "image_tokens=2000"]
    single = packctl(*args)
    assert single.code == 0, single.stderr
    reference = _fingerprint(out)
    assert check_contract(contract, out, [corpus]) == []
    proc = mpirun(3, sys.executable, "-m", "packctl", *args)
    assert proc.returncode == 0, proc.stderr
    assert _fingerprint(out) == reference
    for shard in sorted(out.glob("data/*.parquet")):
        table = pq.read_table(shard, columns=["images_sum", "image_tokens_sum"])
        assert max(table.column("images_sum").to_pylist()) <= 3
        assert max(table.column("image_tokens_sum").to_pylist()) <= 2000
    assert json.loads((out / "_manifest.json").read_text())["counts"]["over_limit"] > 0


@pytest.mark.torch
def test_a_plan_under_mpi_is_the_packed_output_without_its_token_columns(tmp_path):
    """`pack --plan-only` under mpiexec -n 3 counts its loss tokens without moving a token: with a
    labels column (sample_data, sequences cut by --too-long split), without one, and from Megatron
    pairs (the .idx alone): every plan column is the column of `pack` in one process."""
    import numpy as np
    import pyarrow.parquet as pq

    from packctl.contract.schema import SEQ_STARTS, TOKEN_COLUMNS
    from support.adversary import packctl
    from support.megatron import build_with_megatron, random_documents

    (tmp_path / "no-labels").mkdir()
    for path in sorted((ROOT / "sample_data").glob("*.parquet")):
        pq.write_table(pq.read_table(path).drop(["labels"]), tmp_path / "no-labels" / path.name, row_group_size=300)
    for k in range(2):
        build_with_megatron(tmp_path / "megatron" / f"m{k}", random_documents(k, 200, high=8, max_length=900),
                            np.uint16)
    options = ["--capacity", "1024", "--too-long", "split", "--order", "shuffle", "--dp-size", "2",
               "--micro-batches", "2", "--shard-rows", "40", "-q", "--overwrite"]
    for source in (ROOT / "sample_data", tmp_path / "no-labels", tmp_path / "megatron"):
        packs, plan = tmp_path / f"{source.name}-packs", tmp_path / f"{source.name}-plan"
        assert packctl("pack", str(source), "-o", str(packs), *options).code == 0
        proc = mpirun(3, sys.executable, "-m", "packctl", "pack", str(source), "-o", str(plan), *options,
                      "--plan-only")
        assert proc.returncode == 0, proc.stderr
        shards = sorted(p.name for p in (packs / "data").glob("*.parquet"))
        assert shards and shards == sorted(p.name for p in (plan / "data").glob("*.parquet"))
        for name in shards:
            packed, planned = pq.read_table(packs / "data" / name), pq.read_table(plan / "data" / name)
            assert planned.column_names == [n for n in packed.column_names if n not in TOKEN_COLUMNS] + [SEQ_STARTS]
            for column in planned.column_names[:-1]:
                assert planned.column(column).equals(packed.column(column)), (source.name, name, column)


def _same_bytes_for_one_to_three_processes(out: Path, options: list[str]) -> None:
    """`pack -o OUT OPTIONS` in one process, then under mpiexec -n 2 and 3: the same shards."""
    from support.adversary import packctl

    command = [sys.executable, "-m", "packctl", "pack", "-o", str(out), "--overwrite", "-q", *options]
    single = packctl(*command[3:])
    assert single.code == 0, single.stderr
    reference = _fingerprint(out)
    assert len(reference[0]) > 3
    for n in (2, 3):
        proc = mpirun(n, *command)
        assert proc.returncode == 0, proc.stderr
        assert _fingerprint(out) == reference, f"{n} ranks"


def test_a_blend_of_sources_writes_the_same_bytes_for_one_to_three_processes(tmp_path):
    """--source: the draw and the interleave are computed from every row's length on every rank;
    the windows are dealt to ranks as for one input, so the bytes do not depend on the count."""
    from support.adversary import packctl

    data = ROOT / "sample_data"
    out = tmp_path / "out"
    blend = ["--source", f"web={data / 'shard-00000.parquet'}:0.3",
             "--source", f"code={data / 'shard-00001.parquet'}:0.5:3",  # 1.5 passes: rows drawn twice
             "--source", f"math={data / 'shard-00002.parquet'}:0.2:2", "--tokens", "900000", "--order", "shuffle",
             "--too-long", "split", "--window", "200", "--shard-rows", "30", "--dp-size", "2", "--micro-batches", "2"]
    _same_bytes_for_one_to_three_processes(out, blend)


def test_a_grouped_blend_writes_the_same_bytes_for_one_to_three_processes(tmp_path):
    """--source with --group-column: groups are drawn whole from every rank's lengths and group
    starts, a group's uses never straddle a window or a rank, so the bytes do not depend on the
    count (code, drawn 1.5 times, repeats whole groups)."""
    from packctl.sample import SampleSpec, write_sample

    data = tmp_path / "grouped"
    write_sample(data, SampleSpec(sequences=600, shards=3, seed=6, max_length=900, groups="rollout"))
    shards = sorted(data.rglob("*.parquet"))
    out = tmp_path / "out"
    blend = ["--source", f"web={shards[0]}:0.3", "--source", f"code={shards[1]}:0.5:3",
             "--source", f"math={shards[2]}:0.2:2", "--group-column", "group_id", "--tokens", "400000",
             "--order", "shuffle", "--capacity", "8192", "--window", "40", "--shard-rows", "10",
             "--dp-size", "2", "--micro-batches", "2"]
    _same_bytes_for_one_to_three_processes(out, blend)
    mixture = json.loads((out / "_metrics.json").read_text())["mixture"]
    assert mixture["sources"][1]["max_uses_of_a_row"] == 2  # code's groups drawn twice


@pytest.mark.mpi
def test_shared_prefixes_under_three_processes_write_the_single_process_bytes(tmp_path):
    """Pairs and rollouts sharing prompts, in row groups of 5 so groups straddle blocks and ranks,
    packed with --share-prefix in one process and under mpiexec -n 3 (shuffled, balanced over 2
    data-parallel ranks): the same bytes, and prefixes shared."""
    import numpy as np

    from support.adversary import packctl
    from support.data import write_table
    import pyarrow.parquet as pq

    rng = np.random.default_rng(9)
    ids, group = [], []
    for g in range(80):
        prompt = rng.integers(1, 900, int(rng.integers(2, 60))).tolist()
        for _ in range(int(rng.integers(1, 6))):
            ids.append(prompt + rng.integers(1, 900, int(rng.integers(1, 40))).tolist())
            group.append(g)
    src = write_table(tmp_path / "in" / "rows.parquet", {"input_ids": ids, "g": group})
    pq.write_table(pq.read_table(src), src, row_group_size=5)
    out = tmp_path / "out"
    args = ["pack", str(src), "-o", str(out), "--overwrite", "-q", "--capacity", "1024", "--group-column", "g",
            "--share-prefix", "--order", "shuffle", "--window", "7", "--dp-size", "2", "--micro-batches", "2"]
    single = packctl(*args)
    assert single.code == 0, single.stderr
    reference = _fingerprint(out)
    assert reference[1]["counts"]["tokens_shared"] > 0
    proc = mpirun(3, sys.executable, "-m", "packctl", *args)
    assert proc.returncode == 0, proc.stderr
    assert _fingerprint(out) == reference

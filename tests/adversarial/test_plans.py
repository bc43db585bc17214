"""Plans (`pack --plan-only`) and `packctl materialize` (docs/errors.md: "Plans and their source").

A plan holds no token: its readers (`materialize`, `verify`, the loader) read them from the files
the plan was made from, and refuse, in one line naming the file, a source that is missing or is
not what the plan read (size or Parquet footer). A tampered plan shard is refused by its sha256.
A materialize killed at any step of the commit protocol resumes to the output an uninterrupted
run writes. A plan given where packs are expected (export) is refused with what to run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl.output.commit import COMMIT_STEPS, OPEN_STEPS, SHARD_STEPS
from packctl.output.journal import partial_dir, read_journal
from packctl.output.outdir import Faults
from support.adversary import assert_clean_error, assert_complete, assert_every_sample_once, assert_nothing_left, \
    packctl
from support.data import sample_corpus, write_table
from support.faulty_pack import run_forked

OPTIONS = ["--capacity", "256", "--too-long", "split", "--shard-rows", "150", "--order", "shuffle", "-q"]


def digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(out).rglob("*")) if p.is_file() and p.suffix != ".json"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return sample_corpus(tmp_path_factory.mktemp("corpus") / "corpus", sequences=300, distribution="lognormal",
                         shards=2, seed=0, max_length=1000)


@pytest.fixture(scope="module")
def plan(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("plan") / "plan"
    assert packctl("pack", corpus, "-o", out, *OPTIONS, "--plan-only").code == 0
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[str, str]:
    """What `pack` without --plan-only writes: what every materialize must write."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert packctl("pack", corpus, "-o", out, *OPTIONS).code == 0
    return digests(out)


def own_plan(tmp_path: Path, corpus: Path) -> tuple[Path, Path]:
    """A copy of the corpus and a plan of it, for tests that change the source."""
    source = tmp_path / "source"
    shutil.copytree(corpus, source)
    out = tmp_path / "plan"
    assert packctl("pack", source, "-o", out, *OPTIONS, "--plan-only").code == 0
    return source, out


# ---- the source ------------------------------------------------------------------------------------

def test_source_appended_to_is_refused(tmp_path, corpus):
    source, plan = own_plan(tmp_path, corpus)
    first = sorted(source.glob("*.parquet"))[0]
    table = pq.read_table(first)
    pq.write_table(pa.concat_tables([table, table.slice(0, 3)]), first)
    out = tmp_path / "out"
    assert_clean_error(packctl("materialize", plan, "-o", out, "-q"), 2, str(first), "not the source the plan",
                       "bytes")
    assert_nothing_left(out)
    assert_clean_error(packctl("verify", plan), 2, str(first), "not the source the plan")


def test_source_missing_is_refused(tmp_path, corpus):
    source, plan = own_plan(tmp_path, corpus)
    first = sorted(source.glob("*.parquet"))[0]
    first.unlink()
    out = tmp_path / "out"
    assert_clean_error(packctl("materialize", plan, "-o", out, "-q"), 2, str(first), "is missing", "put the file back")
    assert_nothing_left(out)


def test_source_rewritten_with_the_same_size_is_refused(tmp_path):
    """Other token values, the same lengths, encoding and size, the modification time set back:
    the Parquet footer's statistics still tell the file apart."""
    options = dict(compression="none", use_dictionary=False, write_statistics=True)
    source = tmp_path / "source" / "a.parquet"
    source.parent.mkdir()
    rows = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    pq.write_table(pa.table({"input_ids": rows}), source, **options)
    plan, out = tmp_path / "plan", tmp_path / "out"
    assert packctl("pack", source.parent, "-o", plan, "--capacity", "16", "--plan-only", "-q").code == 0
    st = source.stat()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 99]]}), source, **options)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert source.stat().st_size == st.st_size
    assert_clean_error(packctl("materialize", plan, "-o", out, "-q"), 2, str(source), "Parquet footer differs")
    assert_nothing_left(out)


def test_source_changed_under_materialize_is_refused(tmp_path, corpus, monkeypatch):
    """Checked when the plan is opened, and again at every block read: a file replaced between
    the two stops the run with the error of an input changed under a run."""
    source, plan = own_plan(tmp_path, corpus)
    first = sorted(source.glob("*.parquet"))[0]
    import packctl.pipeline.from_plan as from_plan

    real = from_plan.scan_blocks

    def replace_then_read(*args, **kwargs):
        table = pq.read_table(first)
        pq.write_table(table.slice(0, table.num_rows - 1), first)
        return real(*args, **kwargs)

    monkeypatch.setattr(from_plan, "scan_blocks", replace_then_read)
    out = tmp_path / "out"
    assert_clean_error(packctl("materialize", plan, "-o", out, "-q"), 2, str(first),
                       "changed while packctl was reading")
    assert_nothing_left(out)


@pytest.mark.torch
def test_loader_on_a_plan_whose_source_moved(tmp_path, corpus):
    pytest.importorskip("torch")
    from packctl import PackctlError
    from packctl.torch import PackedDataset

    source, plan = own_plan(tmp_path, corpus)
    source.rename(tmp_path / "moved")
    with pytest.raises(PackctlError) as raised:
        PackedDataset(plan)
    message = str(raised.value)
    assert "\n" not in message and "is missing" in message and str(source) in message


# ---- the plan --------------------------------------------------------------------------------------

def test_tampered_plan_shard_is_refused(tmp_path, plan):
    copy = tmp_path / "plan"
    shutil.copytree(plan, copy)
    shard = copy / "data" / "train-00001.parquet"
    table = pq.read_table(shard)
    starts = pa.array([[s + 1 for s in row] for row in table.column("seq_starts").to_pylist()],
                      pa.list_(pa.int64()))
    pq.write_table(table.set_column(table.column_names.index("seq_starts"), "seq_starts", starts), shard)
    out = tmp_path / "out"
    assert_clean_error(packctl("materialize", copy, "-o", out, "-q"), 2, str(shard), "sha256")
    assert_nothing_left(out)
    result = packctl("verify", copy, "--no-attention")
    assert result.code == 1 and "checksum" in result.stdout


def test_materialize_into_the_plan_itself_is_refused(tmp_path, plan):
    copy = tmp_path / "plan"
    shutil.copytree(plan, copy)
    before = digests(copy)
    for out in (copy, copy / "inside", tmp_path):
        assert_clean_error(packctl("materialize", copy, "-o", out, "--overwrite", "-q"), 2, "write the materialized "
                           "output to another -o")
    assert digests(copy) == before


def test_materialize_onto_a_half_of_the_plans_megatron_source_is_refused(tmp_path):
    """A pair is recorded by its .idx: its .bin is the plan's source all the same, never an -o."""
    from support.megatron import random_documents, write_pair

    idx = write_pair(tmp_path / "pairs" / "c", random_documents(3, 40), np.uint16)
    plan = tmp_path / "plan"
    assert packctl("pack", str(idx), "-o", str(plan), "--capacity", "64", "--too-long", "split",
                   "--plan-only", "-q").code == 0
    before = {p.name: p.read_bytes() for p in idx.parent.iterdir()}
    for half in (idx, idx.with_suffix(".bin")):
        result = packctl("materialize", str(plan), "-o", str(half), "--overwrite", "-q")
        assert_clean_error(result, 2, str(half))
    assert {p.name: p.read_bytes() for p in idx.parent.iterdir()} == before


def test_materialize_of_an_output_that_is_not_a_plan(tmp_path, corpus):
    out = tmp_path / "packed"
    assert packctl("pack", corpus, "-o", out, *OPTIONS).code == 0
    assert_clean_error(packctl("materialize", out, "-o", tmp_path / "again", "-q"), 2, "not a plan")
    assert_nothing_left(tmp_path / "again")
    assert_clean_error(packctl("materialize", tmp_path / "nothing", "-o", tmp_path / "again", "-q"), 2,
                       "no such output directory")


def test_materialize_onto_an_existing_output(tmp_path, plan, reference):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    assert_clean_error(packctl("materialize", plan, "-o", out, "-q"), 2, "already exists", "--overwrite")
    assert (out / "keep").read_text() == "mine"
    assert packctl("materialize", plan, "-o", out, "--overwrite", "-q").code == 0
    assert digests(out) == reference


def test_bad_token_transfer_is_refused(tmp_path, plan):
    assert_clean_error(packctl("materialize", plan, "-o", tmp_path / "out", "--token-transfer", "fax", "-q"), 2,
                       "--token-transfer", "exchange")
    assert_nothing_left(tmp_path / "out")


def test_export_of_a_plan_is_refused(tmp_path, plan):
    target = tmp_path / "nemo"
    assert_clean_error(packctl("export", plan, "-o", target, "--format", "nemo", "--eos-token-id", "2"), 2,
                       "a plan", "run packctl materialize")
    assert not target.exists()


def test_resume_of_a_plan_on_packs_and_of_packs_on_a_plan(tmp_path, corpus, plan):
    """A plan and the packs of the same options are two outputs: --resume takes neither for the other."""
    copy = tmp_path / "plan"
    shutil.copytree(plan, copy)
    assert_clean_error(packctl("pack", corpus, "-o", copy, *OPTIONS, "--resume"), 2, "already exists", "kind")


# ---- killed at every step --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("step", OPEN_STEPS + SHARD_STEPS + COMMIT_STEPS)
def test_materialize_killed_at_every_step_resumes(tmp_path, corpus, plan, reference, step):
    out = tmp_path / "out"
    argv = ["materialize", str(plan), "-o", str(out), "-q"]
    count = {"shard:renamed": 2, "shard:journal-torn": 2, "shard:journaled": 2}.get(step, 1)
    code, _, err = run_forked(argv, Faults(kill_at=step, kill_count=count))
    assert code == -signal.SIGKILL, f"not killed at {step} (exit {code}): {err}"
    tmp = partial_dir(out)
    kept = len(read_journal(tmp)) if tmp.is_dir() else 0
    result = packctl(*argv[:-1], "--resume", "--json")
    assert result.code == 0, result.stderr
    assert digests(out) == reference
    assert_complete(out)
    if not result.lines:  # packed again: the finished shards were kept, not written again
        assert json.loads(result.stdout)["shards"] >= kept
    assert_every_sample_once(out, [corpus])

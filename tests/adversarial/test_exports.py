"""Exports keep the promises of pack's outputs (docs/errors.md, "Input resolution" and "Crashes at
any moment"): an export is never read back as input, never replaces the corpus it came from, and a
crash at any step of its swap leaves the previous export or the new one, which the next export of
the same DIR puts in place.
"""
from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import pytest

from packctl.contract.manifest import EXPORT_MARK
from packctl.export import FORMATS, export, old_export, partial_export
from packctl.output.commit import EXPORT_STEPS
from packctl.output.outdir import Faults
from support.adversary import assert_clean_error, assert_nothing_left, leftovers, packctl
from support.data import write_table
from support.runs import pack_to

EOS = 2
OPTIONS = {"nemo": (), "nemo-npy": (), "olmo": ("--eos-token-id", str(EOS), "--vocab-size", "64"), "megatron": ()}


@pytest.fixture
def corpus(tmp_path) -> Path:
    """data/a.parquet: 40 documents of 2 to 9 tokens, each ending with EOS."""
    rows = [[3 + (r * 7 + k) % 50 for k in range(r % 8 + 1)] + [EOS] for r in range(40)]
    return write_table(tmp_path / "data" / "a.parquet", {"input_ids": rows})


@pytest.fixture
def packed(tmp_path, corpus) -> Path:
    return pack_to(tmp_path, [corpus], capacity=32, too_long="split", shard_rows=8)[1]


def _export(packed: Path, target: Path, fmt: str, *more: str):
    return packctl("export", str(packed), "-o", str(target), "--format", fmt, *OPTIONS[fmt], "-q", *more)


def _digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_inside_an_input_directory_is_never_read_as_input(tmp_path, corpus, packed, fmt):
    """A nemo export's packs would be samples again, a megatron export's loss_mask and cu_seqlens
    pairs token ids: every file under an export is refused, naming it; nothing is packed."""
    target = tmp_path / "data" / "exported"
    assert _export(packed, target, fmt).code == 0
    assert (target / EXPORT_MARK).is_file()
    out = tmp_path / "again"
    walked = packctl("pack", str(tmp_path / "data" / "**"), "-o", str(out), "--capacity", "32", "-q")
    assert_clean_error(walked, 2, f"part of the packctl export {target}", EXPORT_MARK, "never read as input")
    assert_nothing_left(out)
    directory = packctl("pack", str(tmp_path / "data"), "-o", str(out), "--capacity", "32", "-q")
    if fmt in ("nemo", "megatron"):  # files a directory walk reads: Parquet, .bin/.idx pairs
        assert_clean_error(directory, 2, f"part of the packctl export {target}", "never read as input")
        assert_nothing_left(out)
    else:  # .npy files: a walk reads none of them
        assert directory.code == 0, directory.stderr


def test_an_export_named_by_its_prefix_is_refused(tmp_path, packed):
    target = tmp_path / "mega"
    assert _export(packed, target, "megatron").code == 0
    out = tmp_path / "again"
    result = packctl("pack", str(target / "loss_mask"), "-o", str(out), "--capacity", "32", "-q")
    assert_clean_error(result, 2, f"part of the packctl export {target}")
    assert_nothing_left(out)


@pytest.mark.parametrize("fmt", ["nemo", "megatron"])
def test_export_never_replaces_the_corpus_of_its_output(tmp_path, corpus, packed, fmt):
    before = corpus.read_bytes()
    result = _export(packed, corpus.parent, fmt, "--overwrite")
    assert_clean_error(result, 2, str(corpus.parent), "would replace the input", str(corpus))
    assert corpus.read_bytes() == before
    assert leftovers(corpus.parent) == []


def _killed_export(packed: Path, target: Path, step: str) -> int:
    """`export` with --overwrite in a forked child that SIGKILLs itself at `step`; its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            export(packed, target, "megatron", overwrite=True, faults=Faults(kill_at=step))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.mark.parametrize("replacing", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("step", EXPORT_STEPS)
def test_a_kill_at_any_step_of_the_swap_is_recovered_by_the_next_export(tmp_path, packed, step, replacing):
    target = tmp_path / "mega"
    export(packed, tmp_path / "reference", "megatron")
    new = _digests(tmp_path / "reference")
    old = None
    if replacing:
        export(packed, target, "olmo", eos_token_id=EOS, vocab_size=64)
        old = _digests(target)
    code = _killed_export(packed, target, step)
    if step == "export:old-set-aside" and not replacing:
        assert code == 0  # no DIR to set aside: the step is not passed
    else:
        assert code == -signal.SIGKILL
    # between the kill and the next export: DIR is the old export or the complete new one, or
    # (at the moment of the swap) the old one waits beside the complete new one
    if target.exists():
        assert _digests(target) in (old, new)
    elif replacing:
        assert _digests(old_export(target)) == old and (partial_export(target) / EXPORT_MARK).is_file()
    again = packctl("export", str(packed), "-o", str(target), "--format", "megatron", "-q", "--overwrite")
    assert again.code == 0, again.stderr
    assert _digests(target) == new
    assert leftovers(target) == []

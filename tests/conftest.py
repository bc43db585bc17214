"""Fixtures, the hypothesis profiles, and the markers every test gets from its tier (tests/README.md):

    tests/unit/         pure functions, no packing run                      (fast)
    tests/integration/  whole runs in-process, verify, stats, exports       (integration/training: marker torch)
    tests/cli/          the command line as users type it, in processes of their own
    tests/adversarial/  what users and failures do to packctl: links, globs, full disks, kills, tampering
    tests/mpi/          under real mpiexec                                  (markers mpi and slow)
    tests/support/      helpers, no tests

Markers (registered in pyproject.toml, --strict-markers): `slow` (a test of more than a few seconds),
`mpi` (launches mpiexec), `torch` (needs torch). `pytest -m "not slow"` is the quick loop.

Hypothesis profiles: `default` (few examples, every run) and `thorough` (the counts each test names,
HYPOTHESIS_PROFILE=thorough); tests ask for theirs with `support.profiles.examples(n)`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import settings

from support.contract import load_checker
from support.paths import SAMPLE_DATA
from support.profiles import DEFAULT_EXAMPLES, THOROUGH_EXAMPLES

TESTS = Path(__file__).resolve().parent

# What the libraries the tests drive cache between runs (matplotlib's font list, Hugging Face's
# modules, triton and inductor kernels, cached_path, packctl's own cache directory) goes to one
# folder under the repository's ignored build/, never the user's ~/.cache or /tmp: set before any
# test module imports them, and kept between sessions (the font list alone is seconds to rebuild).
# numba caches packctl's kernels beside their sources (packctl/**/__pycache__), as for users.
# What `datasets.load_dataset` copies of each output it reads grows with every run: it goes to a
# folder of this session's own, removed when the session ends.
TEST_CACHE = TESTS.parent / "build" / "test-cache"
SESSION_DATASETS = TEST_CACHE / f"datasets-{os.getpid()}"
os.environ.update(
    HF_DATASETS_CACHE=str(SESSION_DATASETS),
    XDG_CACHE_HOME=str(TEST_CACHE),
    MPLCONFIGDIR=str(TEST_CACHE / "matplotlib"),
    HF_HOME=str(TEST_CACHE / "huggingface"),
    TRITON_CACHE_DIR=str(TEST_CACHE / "triton"),
    OLMO_TRITON_CACHE_BASE=str(TEST_CACHE / "olmo-triton"),
    TORCHINDUCTOR_CACHE_DIR=str(TEST_CACHE / "torchinductor"),
    CACHED_PATH_CACHE_ROOT=str(TEST_CACHE / "cached_path"),
)

settings.register_profile("default", max_examples=DEFAULT_EXAMPLES, deadline=None)
settings.register_profile("thorough", max_examples=THOROUGH_EXAMPLES, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_DATASETS, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts[0] == "mpi":
            item.add_marker(pytest.mark.mpi)
        if parts[:2] == ("integration", "training"):
            item.add_marker(pytest.mark.torch)
        if item.get_closest_marker("mpi") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)  # an mpiexec launch starts an interpreter per rank: seconds


@pytest.fixture(scope="session")
def sample_data() -> Path:
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def small_sample_data(tmp_path_factory) -> Path:
    """sample_data cut to every tenth row of each shard and every row over 4096 tokens: 4 shards,
    206 rows, 7 of them longer than 4096 (as in sample_data), 146,244 tokens (an eighth). For tests
    that pack many times and need the shape of sample_data, not its size."""
    out = tmp_path_factory.mktemp("small_sample_data")
    for path in sorted(SAMPLE_DATA.glob("*.parquet")):
        table = pq.read_table(path)
        lengths = np.diff(table.column("input_ids").combine_chunks().offsets.to_numpy())
        keep = np.flatnonzero((np.arange(len(lengths)) % 10 == 0) | (lengths > 4096))
        pq.write_table(table.take(keep), out / path.name)
    return out


@pytest.fixture(scope="session")
def contract():
    """The independent contract checker (../shared/contract/check_output.py) as a module."""
    module = load_checker()
    if module is None:
        pytest.skip("contract checker not found (it lives in the shared folder beside the repository)")
    return module

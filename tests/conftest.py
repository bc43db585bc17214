"""Fixtures, and the markers every test gets from its tier (tests/README.md):

    tests/unit/         pure functions, no packing run                      (fast)
    tests/integration/  whole runs in-process, verify, stats, exports       (integration/torch: marker torch)
    tests/cli/          the command line as users type it, in processes of their own
    tests/adversarial/  what users and failures do to packctl: links, globs, full disks, kills, tampering
    tests/mpi/          under real mpiexec                                  (marker mpi)
    tests/support/      helpers, no tests

Markers (registered in pyproject.toml, --strict-markers): `slow` (a test of more than a few seconds),
`mpi` (launches mpiexec), `torch` (needs torch). `pytest -m "not slow"` is the quick loop.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.contract import load_checker
from support.paths import SAMPLE_DATA

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts[0] == "mpi":
            item.add_marker(pytest.mark.mpi)
            item.add_marker(pytest.mark.slow)
        if parts[:2] == ("integration", "torch"):
            item.add_marker(pytest.mark.torch)


@pytest.fixture(scope="session")
def sample_data() -> Path:
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def contract():
    """The independent contract checker (../shared/contract/check_output.py) as a module."""
    module = load_checker()
    if module is None:
        pytest.skip("contract checker not found (it lives in the shared folder beside the repository)")
    return module

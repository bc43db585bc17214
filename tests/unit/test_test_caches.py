"""The test session caches nothing in the user's home or in /tmp: what packctl and the libraries
the tests drive cache goes under build/test-cache (tests/conftest.py), what a test writes under
its tmp_path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.paths import ROOT

TEST_CACHE = ROOT / "build" / "test-cache"


def test_packctl_caches_under_the_test_cache():
    from packctl.cachedir import user_cache_dir

    assert Path(user_cache_dir("numba")).is_relative_to(TEST_CACHE)


@pytest.mark.parametrize("variable", ["MPLCONFIGDIR", "HF_HOME", "HF_DATASETS_CACHE", "TRITON_CACHE_DIR",
                                      "OLMO_TRITON_CACHE_BASE", "TORCHINDUCTOR_CACHE_DIR", "CACHED_PATH_CACHE_ROOT"])
def test_the_libraries_cache_under_the_test_cache(variable):
    assert Path(os.environ[variable]).is_relative_to(TEST_CACHE)


def test_matplotlib_keeps_its_font_list_in_the_test_cache():
    matplotlib = pytest.importorskip("matplotlib")
    assert Path(matplotlib.get_cachedir()).is_relative_to(TEST_CACHE)


def test_a_passing_tests_folder_is_removed(pytestconfig):
    """A session leaves the folders of its failing tests alone (several hundred MB of outputs when
    all were kept)."""
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"

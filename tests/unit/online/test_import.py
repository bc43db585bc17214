"""What importing the online API loads, in a fresh interpreter: a training job imports it beside its
own stack, so it brings numpy and numba (the kernels) and nothing of packctl's I/O or CLI side."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("pyarrow", "polars", "typer", "rich", "torch", "mpi4py")


def loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(result.stdout.splitlines()[-1])
    return [m for m in HEAVY if m in modules or any(name.startswith(m + ".") for name in modules)]


@pytest.mark.parametrize("code", [
    "import packctl; packctl.plan_steps([5, 3, 2], 2, capacity=8)",
    "from packctl.online import plan_packs; plan_packs([5, 3, 2], 8)",
    "from packctl.online.adapters import get_packer, get_seqlen_balanced_partitions\n"
    "get_packer('first_fit_decreasing', 8).pack([5, 3, 2]); get_seqlen_balanced_partitions([5, 3, 2], 2, False)",
])
def test_the_api_loads_no_io_or_cli_library(code):
    assert loaded_after(code) == []


def test_import_packctl_loads_no_kernels():
    code = "import packctl\nassert 'numba' not in sys.modules and 'packctl.online' not in sys.modules"
    subprocess.run([sys.executable, "-c", f"import sys\n{code}"], check=True, timeout=120)


@pytest.mark.slow
def test_after_python_m_packctl_online_a_first_call_compiles_nothing(tmp_path):
    """`python -m packctl.online` fills numba's cache with every planning kernel: a training job
    started afterwards loads them, and its first calls (every algorithm, groups, steps) compile
    nothing."""
    import os

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    subprocess.run([sys.executable, "-m", "packctl.online"], check=True, env=env, timeout=600, capture_output=True)
    probe = ("import numpy as np, packctl\n"
             "from packctl.plan.names import ALGORITHMS\n"
             "lengths = np.random.default_rng(1).integers(1, 900, 500)\n"
             "for a in ALGORITHMS:\n"
             "    packctl.plan_steps(packctl.plan_packs(lengths, 1024, algorithm=a), 4)\n"
             "packctl.plan_packs(lengths, 2048, groups=np.arange(500) // 2)\n"
             "packctl.plan_steps(lengths, 4, capacity=1024, balance_scope='ranks')\n"
             "from packctl.jit import compile_seconds\n"
             "print(compile_seconds())")
    result = subprocess.run([sys.executable, "-c", probe], check=True, env=env, timeout=600, capture_output=True,
                            text=True)
    assert float(result.stdout.split()[-1]) == 0.0

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

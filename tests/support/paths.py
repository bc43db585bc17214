"""Where things are: the repository, its sample corpus, docs, the shared contract checker, mpiexec."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = ROOT / "sample_data"
DOCS = ROOT / "docs"
SUPPORT = Path(__file__).resolve().parent
FAULTY_PACK = SUPPORT / "faulty_pack.py"  # packctl pack with a simulated failure (tests/support/faulty_pack.py)
CHECKER = ROOT.parent / "shared" / "contract" / "check_output.py"
# mpiexec of the venv (pip install mpich) or of the system
MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))

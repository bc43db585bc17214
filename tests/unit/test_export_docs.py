"""What the README and docs/training.md tell a Megatron user of the exports: `--format megatron`
is storage that no Megatron-LM or Megatron-Bridge training path reads as packs (a dataset class
of one's own does, as the recipe shows), and `--format nemo` is the one Megatron-Bridge trains on."""
from __future__ import annotations

import re

from support.paths import DOCS


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_docs_say_no_megatron_training_path_reads_the_megatron_export():
    training = _flat((DOCS / "training.md").read_text())
    section = training[training.index("**Megatron-LM / megatron-core indexed datasets**"):]
    section = section[:section.index("## Data parallelism")]
    assert "No Megatron-LM or Megatron-Bridge training path reads packs from these files" in section
    for reader in ("GPTDataset", "--sft", "--format nemo", "dataset class of your own"):
        assert reader in section, reader
    readme = _flat((DOCS.parent / "README.md").read_text())
    assert re.search(r"No Megatron-LM or Megatron-Bridge training path reads packs from `\.bin`/`\.idx`", readme)
    megatron = readme[readme.index("(`--format megatron`"):]
    assert "export `--format nemo` for Megatron-Bridge" in megatron[:800]

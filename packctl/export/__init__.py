"""`packctl export OUT -o DIR --format F`: a packed output rewritten in the packed format another
trainer reads itself, pack for pack, in output order (docs/training.md "Exports").

    nemo       NeMo / Megatron-Bridge packed SFT: DIR/train-00000.idx.parquet ... (input_ids,
               seq_start_id, loss_mask) and DIR/packing_metadata.json
    nemo-npy   the same rows as NeMo's legacy DIR/train.npy (an array of dicts)
    olmo       OLMo-core numpy token files: DIR/part-00000.npy ... (flat tokens), label masks and
               document boundaries
    megatron   megatron-core indexed datasets: DIR/tokens.bin/.idx (one document per pack, one
               sequence per packed sequence), DIR/loss_mask.bin/.idx, DIR/cu_seqlens.bin/.idx and
               DIR/megatron.json

The formats are the rows of `EXPORTERS` (export/formats.py: name, options, layout check, writer);
`export` (export/run.py) checks the options, reads the output and writes a format's directory by
the commit protocol of pack. Every format is read back by an independent reader:
tests/integration/test_export.py, test_olmo_core.py (OLMo-core's own) and test_megatron_export.py
(megatron-core's IndexedDataset).
"""
from __future__ import annotations

from packctl.export.formats import EXPORTERS, FORMATS, Exporter

# What export/run.py defines, imported from there on first use: the table above loads neither
# numpy nor pyarrow, so the command line's --help and choices read it at no cost.
_RUN = ("ExportOptions", "ShardPacks", "check_options", "export", "old_export", "partial_export", "read_packs",
        "recover")

__all__ = ["EXPORTERS", "FORMATS", "Exporter", *_RUN]


def __getattr__(name: str):
    if name in _RUN:
        from packctl.export import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The export formats, one row each: the name `--format` takes, what it writes (a line of
`packctl export --help`), the options it reads, and the module that checks a layout and writes it.
Plain data: the command line builds `--format`'s choices and help from this table without loading
numpy, pyarrow or an exporter.

    Exporter("megatron", "megatron-core indexed datasets: ...", uses=("vocab_size",), module="megatron")
    packctl export OUT -o DIR --format megatron --vocab-size 32000
    -> packctl.export.megatron.check_layout(output, options), then .write(output, DIR, options)
       (--eos-token-id is refused: megatron does not use it)

An exporter's module holds `check_layout(output, options)` (the refusals that need no shard, made
before anything is created) and the writer named by `writer` (`write(output, directory, options)`,
returning what was written); `options` is export/run.py's `ExportOptions`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Exporter:
    """One export format: `name` (`--format NAME`), `summary` (what it writes, for --help), `uses`
    (the fields of ExportOptions it reads: any other given is refused), `module`
    (packctl.export.MODULE) and `writer` (the function of that module that writes it)."""

    name: str
    summary: str
    uses: tuple[str, ...]
    module: str
    writer: str = "write"

    def check_layout(self, output, options) -> None:
        """Refuse an output whose layout this format cannot hold, reading no shard."""
        self._module().check_layout(output, options)

    def write(self, output, directory, options) -> dict:
        """Write `output` into `directory` (new and empty); returns what was written."""
        return getattr(self._module(), self.writer)(output, directory, options)

    def _module(self):
        return importlib.import_module(f"packctl.export.{self.module}")


EXPORTERS = {exporter.name: exporter for exporter in (
    Exporter("nemo", "NeMo / Megatron-Bridge packed SFT, *.idx.parquet and packing_metadata.json",
             uses=("eos_token_id",), module="nemo"),
    Exporter("nemo-npy", "the same as NeMo's legacy .npy", uses=("eos_token_id",), module="nemo", writer="write_npy"),
    Exporter("olmo", "OLMo-core numpy token and label-mask files", uses=("eos_token_id", "bos_token_id", "vocab_size"),
             module="olmo"),
    Exporter("megatron", "megatron-core indexed datasets: tokens, loss_mask and cu_seqlens .bin/.idx",
             uses=("vocab_size",), module="megatron"),
)}
FORMATS = tuple(EXPORTERS)


def formats_help() -> str:
    """The formats as `packctl export --help` lists them: `nemo (NeMo / ...), nemo-npy (...), ...`."""
    return ", ".join(f"{e.name} ({e.summary})" for e in EXPORTERS.values())

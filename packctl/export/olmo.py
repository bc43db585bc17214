"""OLMo-core numpy token files (olmo_core.data: NumpyFSLDataset and the document-aware sources).

Their convention, from OLMo-core's data/utils.py and numpy datasets:

- a token file is a raw memory map of token ids (no header, despite the `.npy` suffix) in one of
  the unsigned dtypes (`token_dtype`: uint16 when every id is below 65,536, else uint32);
- a fixed-length dataset cuts each file into instances of `sequence_length` tokens;
- documents end with the EOS token: `get_document_lengths(input_ids, eos_token_id)` puts a boundary
  after every EOS (and at the end of the instance), which intra-document masking attends within;
  `iter_document_indices` reads the same boundaries from `<file>.csv.gz` ("start,end" lines);
- a label mask file is a raw np.bool_ memory map aligned with its token file: True where the token
  is a target (labels are the tokens shifted inside the model; a False target is ignored).

So a packctl output maps one to one: each pack is an instance of `--capacity` tokens (written in
output order), each sequence a document (it must end with the EOS id and hold no other, or OLMo
would see other documents than packctl's sequences), the label mask is `labels != -100`, and the
tail padding of a pack, after its last EOS, is a document of its own with no targets. Packs with
alignment padding between sequences cannot be expressed (the padding would join the next document).

    DIR/part-00000.npy               tokens of shard 0's packs, pack after pack
    DIR/part-00000.csv.gz            "start,end" of every sequence in that file
    DIR/label_mask/part-00000.npy    np.bool_, aligned with the tokens
    DIR/olmo.json                    sequence_length, token_dtype, eos_token_id, files
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from packctl.arrays import ranges
from packctl.contract.reader import PackedOutput
from packctl.errors import PackctlError
from packctl.contract.schema import IGNORE_INDEX


def _check(shard, eos: int) -> np.ndarray:
    """Each sequence's offset in the shard's flat tokens, after checking that OLMo-core will find
    exactly packctl's sequences as documents."""
    starts = shard.flat_starts()
    ends = starts + shard.seq_lens
    last_is_eos = shard.input_ids[ends - 1] == eos
    if not last_is_eos.all():
        k = int(np.argmin(last_is_eos))
        raise PackctlError(f"{shard.name}: sequence {k} (of the shard) does not end with the EOS id {eos}; OLMo-core "
                           "finds documents by their EOS, so every sequence must end with it (pieces of --too-long "
                           "split do not: pack with --too-long truncate or drop, or tokenize with EOS)")
    inner = np.zeros(len(shard.input_ids), dtype=bool)
    inner[ranges(starts, shard.seq_lens - 1)] = True
    extra = inner & (shard.input_ids == eos)
    if extra.any():
        position = int(np.argmax(extra))
        raise PackctlError(f"{shard.name}: token {position} is the EOS id {eos} inside a sequence; OLMo-core would "
                           "start a new document there (attention then differs from packctl's sequences)")
    supervised = shard.labels != IGNORE_INDEX
    if (supervised & (shard.labels != shard.input_ids)).any():
        raise PackctlError(f"{shard.name}: a label differs from its token, and OLMo-core derives labels from the "
                           "tokens; such outputs cannot be exported to olmo")
    return starts


def write(output: PackedOutput, target: Path, *, eos_token_id: int | None) -> dict:
    from packctl.export import read_packs

    out = output.root
    layout = output.layout
    capacity = int(layout["capacity"])
    if eos_token_id is None:
        raise PackctlError("--format olmo needs --eos-token-id: OLMo-core finds document boundaries by the EOS id")
    if layout.get("pad_to") != "capacity":
        raise PackctlError(f"{out}: packs of varying length (--pad-to {layout.get('pad_to')}); OLMo-core cuts token "
                           "files into instances of one sequence_length: pack with --pad-to capacity")
    if int(layout.get("align", 1)) != 1:
        raise PackctlError(f"{out}: sequences padded to a multiple of {layout['align']} (--cp-size/--tp-size/"
                           "--seq-multiple); OLMo-core would join that padding to the next document: pack without "
                           "alignment for OLMo-core (its context parallelism splits instances itself)")
    shards = list(read_packs(output))
    top = max(int(s.input_ids.max()) for s in shards)
    dtype = np.uint16 if max(top, eos_token_id) < 2**16 else np.uint32
    (target / "label_mask").mkdir(exist_ok=True)
    files, packs, sequences = [], 0, 0
    for k, shard in enumerate(shards):
        starts = _check(shard, eos_token_id)
        name = f"part-{k:05d}.npy"
        shard.input_ids.astype(dtype).tofile(target / name)
        (shard.labels != IGNORE_INDEX).astype(np.bool_).tofile(target / "label_mask" / name)
        with gzip.open(target / f"part-{k:05d}.csv.gz", "wt") as fh:
            fh.write("".join(f"{s},{s + n}\n" for s, n in zip(starts.tolist(), shard.seq_lens.tolist())))
        files.append(name)
        packs += shard.num_packs
        sequences += len(starts)
    info = {"sequence_length": capacity, "token_dtype": np.dtype(dtype).name, "eos_token_id": eos_token_id,
            "files": files, "label_mask_files": [f"label_mask/{f}" for f in files], "instances": packs}
    (target / "olmo.json").write_text(json.dumps(info, indent=2) + "\n")
    return {"format": "olmo", "output": str(target), "files": files, "packs": packs, "sequences": sequences,
            "sequence_length": capacity, "token_dtype": info["token_dtype"]}

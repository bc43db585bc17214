"""Carry wheels to a GPU node in batches: split them into parts, group the parts into batches under
a size limit here, and join them back there. Standard library only (it runs before anything is
installed on the node).

    python benchmarks/gpu/wheels.py split .whl                      # .whl/full/*.whl -> .whl/1/, .whl/2/
    python benchmarks/gpu/wheels.py join .whl /tmp/packctl-wheels   # on the node, in every call

A wheel over the part size (16 MiB) becomes `NAME.whl.part-000`, `NAME.whl.part-001`, ...; the parts
go, largest first, into the first batch with room (`--batch-mib`, 54 by default: a batch and the
source tree stay under the 64 MiB a device call carries). Every batch holds `wheels.sha256`, one
line per wheel, `SHA256 PARTS NAME`, so the node knows what makes a whole set:

    3f1c...  6  nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    9ab0...  1  flash_attn_4-4.0.0b36-py3-none-any.whl

`join` copies the parts of the batches carried this call into the stage folder (which outlives the
call while the machine stays warm), joins each wheel whose parts are all there, checks its hash
and writes it to STAGE/full/. Exit 0 when every wheel is whole, 3 when parts are still missing
(carry the next batch), 2 when a joined wheel's hash differs.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

MIB = 1 << 20
SUMS = "wheels.sha256"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def split(root: Path, batch_mib: float = 54, part_mib: float = 16) -> list[Path]:
    """root/full/*.whl -> root/1/, root/2/, ... (each at most batch_mib), returning the batches."""
    wheels = sorted((root / "full").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"{root / 'full'}: no wheels to split (run fetch_wheels.sh first)")
    for old in root.iterdir():
        if old.is_dir() and old.name.isdigit():
            shutil.rmtree(old)
    part_bytes, limit = int(part_mib * MIB), int(batch_mib * MIB)
    pieces = []  # (size, wheel, index, parts)
    lines = []
    for wheel in wheels:
        size = wheel.stat().st_size
        parts = max(1, -(-size // part_bytes))
        lines.append(f"{sha256(wheel)}  {parts}  {wheel.name}\n")
        for index in range(parts):
            pieces.append((min(part_bytes, size - index * part_bytes), wheel, index, parts))
    batches: list[list] = []
    used: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[0]):
        slot = next((b for b, total in enumerate(used) if total + piece[0] <= limit), None)
        if slot is None:
            batches.append([])
            used.append(0)
            slot = len(batches) - 1
        batches[slot].append(piece)
        used[slot] += piece[0]
    folders = []
    for number, batch in enumerate(batches, start=1):
        folder = root / str(number)
        folder.mkdir()
        (folder / SUMS).write_text("".join(lines))
        for size, wheel, index, parts in batch:
            name = wheel.name if parts == 1 else f"{wheel.name}.part-{index:03d}"
            with wheel.open("rb") as src, (folder / name).open("wb") as dst:
                src.seek(index * part_bytes)
                dst.write(src.read(size))
        folders.append(folder)
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / MIB:.1f} MiB: {len(folders)} batch(es) of at most {batch_mib:g} MiB")
    for folder, size in zip(folders, used):
        print(f"  {folder}: {size / MIB:.1f} MiB, {len(list(folder.iterdir())) - 1} files")
    return folders


def join(root: Path, stage: Path) -> int:
    """Copy the batches under root into stage, join the complete wheels into stage/full."""
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "full").mkdir(exist_ok=True)
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit()) if root.is_dir() else []:
        for item in folder.iterdir():
            shutil.copyfile(item, stage / item.name)
    if not (stage / SUMS).exists():
        print(f"no {SUMS} under {root}/N/ or {stage}: carry a batch of fetch_wheels.sh")
        return 3
    missing = []
    for line in (stage / SUMS).read_text().splitlines():
        digest, parts, name = line.split()
        whole = stage / "full" / name
        if whole.exists() and sha256(whole) == digest:
            continue
        sources = [stage / name] if int(parts) == 1 else [stage / f"{name}.part-{i:03d}" for i in range(int(parts))]
        absent = [s.name for s in sources if not s.exists()]
        if absent:
            missing.append(f"{name} ({len(absent)} of {parts} parts)")
            continue
        with whole.open("wb") as dst:
            for source in sources:
                with source.open("rb") as src:
                    shutil.copyfileobj(src, dst)
        if sha256(whole) != digest:
            whole.unlink()
            print(f"{name}: joined parts do not match {SUMS}; run fetch_wheels.sh again and carry its batches")
            return 2
    if missing:
        print("still missing: " + ", ".join(missing) + " (carry the next batch)")
        return 3
    print(f"all wheels whole in {stage / 'full'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split", help="ROOT/full/*.whl -> ROOT/1/, ROOT/2/, ...")
    cut.add_argument("root", type=Path)
    cut.add_argument("--batch-mib", type=float, default=54)
    cut.add_argument("--part-mib", type=float, default=16)
    glue = sub.add_parser("join", help="ROOT/N/ parts -> STAGE/full/*.whl")
    glue.add_argument("root", type=Path)
    glue.add_argument("stage", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        split(args.root, args.batch_mib, args.part_mib)
        return 0
    return join(args.root, args.stage)


if __name__ == "__main__":
    sys.exit(main())

"""A plain copy of a Parquet corpus, the yardstick of bench_copy.py: file by file, read the table
with pyarrow and write it again with zstd into a fresh directory. Imports nothing of packctl.

    python benchmarks/copy_parquet.py SRC_DIR DST_DIR
"""
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq


def main() -> None:
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for path in sorted(source.glob("*.parquet")):
        pq.write_table(pq.read_table(path), target / path.name, compression="zstd")


if __name__ == "__main__":
    main()

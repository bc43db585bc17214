"""`pack` from S3 against the same pack from local disk: the throughput ratio.

    python benchmarks/bench_s3.py [--input sample_data] [--synthetic-mb 160] [--repeats 5] [--capacity 4096]

The files of INPUT (and, with --synthetic-mb, a generated corpus of about that many megabytes of
int32 token values, lognormal lengths, in 8 Parquet files of row groups of 1,024 rows) are put into a bucket of
moto's S3 server on 127.0.0.1 (`moto[server]`, the `dev` extra), started as a process of its own
(`moto_server`), so that the server's work does not share this process's interpreter. Then `pack`
runs in this process over `s3://bench/<corpus>` and over the local files, in turns, `--repeats`
times each after one warm-up of both (numba's kernels compiled, the page cache warm). For each
corpus it prints the best seconds of each, the megabytes per second and the ratio local/S3
seconds (1.0: as fast as local disk; the goal is >= 0.8), and the spread of the S3 runs.

moto is a Python server answering each request in about a millisecond: for a small corpus the
ratio measures requests (a HEAD and a ranged GET of the footer per open of an object), for a
large one bytes. A real store on a fast network serves ranged GETs faster than moto, and adds the
network's latency, which this benchmark does not have.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packctl import PackConfig, pack


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def synthetic_corpus(folder: str, megabytes: int, files: int = 8, seed: int = 0) -> list[str]:
    """`files` Parquet files of tokenized rows (input_ids int32 lists) totalling about `megabytes` MB."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows_per_file = max(1, int(megabytes * 1e6 / files / (4 * 700)))
    paths = []
    for f in range(files):
        lengths = np.clip(rng.lognormal(np.log(500), 1.0, rows_per_file).astype(np.int64), 1, 16_000)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32)
        table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
        path = os.path.join(folder, f"part-{f:05d}.parquet")
        pq.write_table(table, path, row_group_size=1024)
        paths.append(path)
    return paths


def start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("moto_server did not start")


def measure(name: str, local_files: list[str], url: str, scratch: str, args) -> None:
    def run(inputs: list[str]) -> float:
        out = os.path.join(scratch, "out")
        start = time.perf_counter()
        pack(PackConfig(inputs=inputs, output=out, capacity=args.capacity, too_long="split", overwrite=True))
        seconds = time.perf_counter() - start
        shutil.rmtree(out)
        return seconds

    run(local_files), run([url])  # warm-up
    local, remote = [], []
    for _ in range(args.repeats):
        local.append(run(local_files))
        remote.append(run([url]))
    size = sum(os.path.getsize(p) for p in local_files)
    best_local, best_s3 = min(local), min(remote)
    print(f"{name}: {len(local_files)} files, {size / 1e6:.1f} MB; best of {args.repeats}")
    print(f"  local disk  {best_local:.3f} s  {size / 1e6 / best_local:.1f} MB/s")
    print(f"  S3 (moto)   {best_s3:.3f} s  {size / 1e6 / best_s3:.1f} MB/s  (runs {min(remote):.3f}-{max(remote):.3f} s)")
    print(f"  ratio (local s / S3 s): {best_local / best_s3:.2f}  (median {np.median(local) / np.median(remote):.2f})",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default="sample_data")
    parser.add_argument("--synthetic-mb", type=int, default=160,
                        help="megabytes of token values to generate (int32, before Parquet encoding); 0: none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--capacity", type=int, default=4096)
    args = parser.parse_args()

    import boto3

    server, endpoint = start_server()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_ENDPOINT_URL_S3=endpoint,
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    scratch = tempfile.mkdtemp(prefix="bench_s3_")
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        corpora = [(args.input, sorted(os.path.join(args.input, n) for n in os.listdir(args.input)
                                       if n.endswith(".parquet")), "corpus")]
        if args.synthetic_mb:
            corpora.append(("synthetic",
                            synthetic_corpus(os.path.join(scratch, "synthetic"), args.synthetic_mb), "synthetic"))
        for name, files, prefix in corpora:
            for path in files:
                with open(path, "rb") as fh:
                    client.put_object(Bucket="bench", Key=f"{prefix}/{os.path.basename(path)}", Body=fh.read())
            measure(name, files, f"s3://bench/{prefix}", scratch, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.kill()


if __name__ == "__main__":
    main()

"""`pack` from S3 against the same pack from local disk: the throughput ratio.

    python benchmarks/bench_s3.py [--input sample_data] [--repeats 3] [--capacity 4096]

The files of INPUT are put into a bucket of moto's S3 server on 127.0.0.1 (`moto[server]`, the
`dev` extra), then `pack` runs in this process over `s3://bench/corpus` and over INPUT, in turns,
`--repeats` times each after one warm-up of both (numba's kernels compiled, the page cache
warm). It prints the best seconds of each, the input's megabytes per second and the ratio
local/S3 seconds (1.0: as fast as local disk; the goal is >= 0.8). moto is a Python server: a
real store on a fast network serves ranged GETs faster, so the ratio here is a lower bound for
loopback transfers and says nothing of a store's latency across a network.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time

from packctl import PackConfig, pack


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default="sample_data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=4096)
    args = parser.parse_args()

    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_ENDPOINT_URL_S3=endpoint,
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    names = sorted(n for n in os.listdir(args.input) if n.endswith(".parquet"))
    for name in names:
        with open(os.path.join(args.input, name), "rb") as fh:
            client.put_object(Bucket="bench", Key=f"corpus/{name}", Body=fh.read())
    scratch = tempfile.mkdtemp(prefix="bench_s3_")
    try:
        def run(inputs: list[str]) -> float:
            out = os.path.join(scratch, "out")
            start = time.perf_counter()
            pack(PackConfig(inputs=inputs, output=out, capacity=args.capacity, too_long="split",
                                     overwrite=True))
            seconds = time.perf_counter() - start
            shutil.rmtree(out)
            return seconds

        local_in, s3_in = [os.path.join(args.input, n) for n in names], ["s3://bench/corpus"]
        run(local_in), run(s3_in)  # warm-up
        local, remote = [], []
        for _ in range(args.repeats):
            local.append(run(local_in))
            remote.append(run(s3_in))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        server.stop()
    size = sum(os.path.getsize(os.path.join(args.input, n)) for n in names)
    best_local, best_s3 = min(local), min(remote)
    print(f"input {args.input}: {len(names)} files, {size / 1e6:.1f} MB; best of {args.repeats}")
    print(f"local disk  {best_local:.3f} s  {size / 1e6 / best_local:.1f} MB/s")
    print(f"S3 (moto)   {best_s3:.3f} s  {size / 1e6 / best_s3:.1f} MB/s")
    print(f"ratio (local s / S3 s): {best_local / best_s3:.2f}")


if __name__ == "__main__":
    main()

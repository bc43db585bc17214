#!/usr/bin/env bash
# Download the wheels that run_all.sh installs on a GPU node (Python 3.12, manylinux x86_64, a CUDA
# 13 torch already there) into .whl/, split into parts of at most 16 MiB and grouped into carry
# batches .whl/1, .whl/2, ... of at most BATCH_MIB (default 54) each, so that every device call
# carries one batch plus the source tree under its 64 MiB limit.
#
#   benchmarks/gpu/fetch_wheels.sh            # -> .whl/full/*.whl, .whl/1/, .whl/2/, .whl/wheels.sha256
#   BATCH_MIB=40 benchmarks/gpu/fetch_wheels.sh /tmp/wheels
#
# What travels: flash-attn 4 and its pure-Python or prebuilt dependencies (FlashAttention 4's CuTe
# DSL kernels compile at run time, so nothing is built). About 97 MiB together, 88 of them the CUDA
# 13 compiler libraries of the CuTe DSL (nvidia-cutlass-dsl-libs-cu13): two batches. Assumed present
# on the node, not carried: torch with CUDA 13, numpy, pyarrow, numba, typer, rich (packctl's own
# needs except polars, which only `packctl stats` imports), einops, typing-extensions, protobuf,
# cuda-bindings, transformers and pytest.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$repo/.whl}
batch_mib=${BATCH_MIB:-54}
python=${PYTHON:-python3}

# flash-attn-4 asks for nvidia-cutlass-dsl, which asks for libs-base (-> libs-core) and the CUDA 12
# flavour libs-cu12; the node's driver and torch are CUDA 13, and the DSL picks the newest flavour
# the driver supports, so the CUDA 13 flavour travels instead of the CUDA 12 one.
WHEELS=(
    flash-attn-4==4.0.0b36
    nvidia-cutlass-dsl==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1
    nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-cu13==4.8.1
    quack-kernels==0.6.5
    apache-tvm-ffi==0.1.15.post2
    torch-c-dlpack-ext==0.1.5
)

mkdir -p "$dest/full"
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest/full" "${WHEELS[@]}"

"$python" "$repo/benchmarks/gpu/wheels.py" split "$dest" --batch-mib "$batch_mib"

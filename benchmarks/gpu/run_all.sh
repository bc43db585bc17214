#!/usr/bin/env bash
# packctl on a GPU node in one prepared run: install flash-attn 4 from carried wheels, pack
# sample_data and an rl-longtail corpus (16384, cp 1 and 2), `packctl verify --device cuda
# --dtype bf16,fp16 --bench` with flash-attn, torch-varlen, sdpa and flex, the loss and gradient
# equivalence tests and the train example on flash-attn; results.json and results.md in --out
# (docs/verify.md, "flash-attn on a GPU"). The whole run stays within --budget-s (390 by default,
# the install's minute apart), so it fits one device call of 8 minutes.
#
#   bash benchmarks/gpu/run_all.sh --dry-run --out /tmp/gpu-results   # CPU, tiny corpora, sdpa (CI)
#   bash benchmarks/gpu/run_all.sh --stage-only     # device call 1, carrying .whl/1: stage its parts
#   bash benchmarks/gpu/run_all.sh --out "$OUT"     # device call 2, carrying .whl/2: install, run all
#
# Wheels: benchmarks/gpu/fetch_wheels.sh puts them in carry batches .whl/1, .whl/2 (97 MiB in all,
# more than one call carries). Each call copies the batches it carries into $PACKCTL_WHEEL_STAGE
# (/tmp/packctl-wheels), which outlives the call while the machine stays warm; once every part is
# there the wheels are joined, hash-checked and installed into $PACKCTL_SITE (/tmp/packctl-site).
# Without flash-attn the run still goes on: its rows say why it failed, the other backends run.
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo" || exit 2
python=${PYTHON:-python3}
out=${OUT:-$repo/out/gpu-results}
work=""
dry_run=0
stage_only=0
budget=390
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry_run=1 ;;
        --stage-only) stage_only=1 ;;
        --out) out=$2; shift ;;
        --work) work=$2; shift ;;
        --budget-s) budget=$2; shift ;;
        *) echo "run_all.sh: unknown option $1 (--dry-run, --stage-only, --out DIR, --work DIR, --budget-s N)" >&2
           exit 2 ;;
    esac
    shift
done

stage=${PACKCTL_WHEEL_STAGE:-/tmp/packctl-wheels}
site=${PACKCTL_SITE:-/tmp/packctl-site}
if [ $dry_run = 1 ]; then
    install="none (dry run)"
elif [ -d "$site/flash_attn/cute" ]; then
    install="flash-attn 4 already in $site"
else
    timeout 120 "$python" benchmarks/gpu/wheels.py join .whl "$stage"
    joined=$?
    [ $stage_only = 1 ] && exit $(( joined == 3 ? 0 : joined ))
    if [ $joined = 0 ] && timeout 180 "$python" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$site" "$stage"/full/*.whl; then
        install="flash-attn 4 installed into $site from carried wheels"
    else
        install="flash-attn 4 not installed (wheels.py join exit $joined; see the output above)"
    fi
fi
[ $stage_only = 1 ] && exit 0
echo "install: $install"

if [ $dry_run = 1 ]; then
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
else
    # The CuTe DSL's wheel puts `cutlass` on sys.path with a .pth file, which Python reads in site
    # directories only, not in a PYTHONPATH folder: its folder is named here instead.
    export PYTHONPATH="$repo:$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}  # FA4 compiles each kernel once, not once per verify
exec "$python" benchmarks/gpu/run_all.py --out "$out" ${work:+--work "$work"} --budget-s "$budget" \
    --install "$install" $([ $dry_run = 1 ] && echo --dry-run)

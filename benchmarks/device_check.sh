#!/usr/bin/env bash
# The CUDA path's checks on a lent GPU in one run (docs/benchmarks.md "CUDA"), each step under its own time
# limit so that one that hangs leaves the others' results; everything goes under $OUT.
#
# Here, once (the GPU machine reaches no network, so what it lacks travels with the working tree):
#   python -m benchmarks.cuda_engine prepare --out .devicebench      # config + tokenizer of the catalog's shapes
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 -d .whl llguidance gguf
#   (both folders listed in .git/info/exclude)
# Then the device tool's run, carrying .devicebench and .whl, with a 600 s limit (the steps' limits add up to
# 575 s, so the status line of every step comes back):
#   bash benchmarks/device_check.sh
# A dry run of the script itself on a CPU machine (the kernels in Triton's interpreter; slow, no figures):
#   SUDU_DEVICE_DRY_RUN=1 OUT=/tmp/device-out bash benchmarks/device_check.sh
# (a model shrunk to 2 layers, test_device.py left out: its dry run is `SUDU_TEST_DEVICE=cpu
# SUDU_CUDA_PATH_ON_CPU=1 python -m pytest tests/test_device.py`, minutes in the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sudu-site .whl/*.whl \
        && export PYTHONPATH=/tmp/sudu-site:$PWD
else
    export PYTHONPATH=$PWD
fi
DEVICE=cuda
ASSETS=.devicebench
TESTS="tests/test_device.py tests/test_cuda_attention.py tests/test_cuda_quant.py tests/test_device_sampler.py"
BENCH="--repeat 3"
PROFILE="--batches 8,32"
if [ "${SUDU_DEVICE_DRY_RUN:-0}" = 1 ]; then
    DEVICE=cpu
    export SUDU_TEST_DEVICE=cpu SUDU_CUDA_PATH_ON_CPU=1 TRITON_INTERPRET=1
    TESTS="tests/test_cuda_attention.py"
    BENCH="--repeat 1 --tokens 4 --batches 2"
    PROFILE="--batches 2 --tokens 4"
    ASSETS=/tmp/sudu-devicebench-tiny
    python3 -m benchmarks.cuda_engine prepare --tiny --out $ASSETS --models qwen2.5-coder-0.5b-instruct >/dev/null
fi

step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, its status in $OUT/status.txt
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/status.txt"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} >"$OUT/env.txt" 2>&1
step tests 170 python3 -m pytest -q -p no:cacheprovider --timeout 120 $TESTS
step invariance 75 python3 -m benchmarks.cuda_engine invariance --device $DEVICE --assets $ASSETS
step bench 270 python3 -m benchmarks.cuda_engine run --device $DEVICE --assets $ASSETS --models qwen2.5-coder-0.5b-instruct $BENCH \
    --json "$OUT/bench.json"
step profile 60 python3 -m benchmarks.cuda_engine profile --device $DEVICE --assets $ASSETS $PROFILE --chunks 0 --trace
cat "$OUT/status.txt"

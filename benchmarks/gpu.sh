#!/usr/bin/env bash
# Every GPU check and benchmark in one call, for the device machine (one H200, torch 2.11, triton 3.6, no network).
#
#   bash benchmarks/gpu.sh                 # on the GPU machine: <= 5 min after start; results under $OUT
#   GPU_SMOKE=1 bash benchmarks/gpu.sh     # the same steps on this CPU at toy sizes (tests/benchmarks/test_gpu.py)
#
# What runs and what it writes (at most 8 files under $OUT): see python -m benchmarks.gpu --help and
# benchmarks/gpu.py. A failing step or impl is recorded in report.txt and the run goes on.
# liger-kernel is not on that machine: carry its wheel in .whl/ (docs/scale-out.md, "GPU runs") to compare with it.
set -uo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
SMOKE=""
if [ "${GPU_SMOKE:-0}" = 1 ]; then
    SMOKE="--smoke"
    export TRITON_INTERPRET=1  # impl="triton" on CPU tensors, interpreted
else
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>&1 | \
        sed 's/^/nvidia-smi: /' | tee "$OUT/log.txt"
fi
$PY -m benchmarks.gpu --out "$OUT" $SMOKE 2>&1 | tee -a "$OUT/log.txt"

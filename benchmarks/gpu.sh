#!/usr/bin/env bash
# Every GPU check and benchmark in one call, for the device machine (one H200, torch 2.11, triton 3.6, no network).
#
#   timeout 420 bash benchmarks/gpu.sh              # on the GPU machine; results under $OUT
#   GPU_SMOKE=1 bash benchmarks/gpu.sh              # the same stages on a CPU at toy sizes, Triton interpreted
#
# Why `timeout 420`: a session gets 15 minutes of device time in all, the machine's start and idle time
# included. The stage limits below sum to 390 s (plus process starts); 420 s is the hard
# ceiling that still leaves room for one rerun if the first call goes wrong.
# Each stage is its own process under its own timeout, so a CUDA fault or a hang costs that stage only; every
# stage rewrites its result file after each row, so what it measured before a kill is kept. A failing stage
# is noted in log.txt and the next stage runs. Stages and files: python -m benchmarks.gpu --help.
# At most 7 files under $OUT: log.txt, check.json, loss.json, train.json, loss.png, targets.json, report.txt.
# Wheels the machine lacks (liger-kernel for the peer; zstandard, gguf for anything that reads a cache or a
# GGUF) go in .whl/ and are installed to /tmp/site first (docs/scale-out.md, "GPU runs").
set -uo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
LOG="$OUT/log.txt"
: > "$LOG"
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
        sed 's/^/nvidia-smi: /' | tee -a "$LOG"
fi

stage() {  # stage NAME SECONDS: one process, killed (and noted) past its limit
    local name=$1 limit=$2 rc start=$SECONDS
    timeout --kill-after=5 "$limit" $PY -m benchmarks.gpu "$name" --out "$OUT" $SMOKE 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    # 124: stopped by TERM at the limit; 137 past the limit: it ignored TERM and got KILL (137 before it: killed)
    if [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ $((SECONDS - start)) -ge "$limit" ]; }; then
        echo "gpu.sh: stage $name stopped at its ${limit} s limit; the next stage runs" | tee -a "$LOG"
    elif [ "$rc" != 0 ]; then
        echo "gpu.sh: stage $name failed (exit $rc); the next stage runs" | tee -a "$LOG"
    fi
}

$PY -c "import sys, torch; print('gpu.sh: Python', sys.version.split()[0], 'torch', torch.__version__)" 2>&1 | tee -a "$LOG"
stage check 60
stage gemm 20
stage loss 190
# the smoke's bf16 steps of a 49k-vocabulary student run on CPU cores, slower than the GPU's real sizes
stage train "$([ -n "$SMOKE" ] && echo 300 || echo 80)"
stage predict 20
stage report 20

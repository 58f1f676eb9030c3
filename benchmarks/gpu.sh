#!/usr/bin/env bash
# Every GPU check and benchmark of the loss in one call (for the device machine: one H200, nothing to fetch).
#
#   bash benchmarks/gpu.sh                 # on the GPU machine; results under $OUT (default runs/gpu)
#   GPU_SMOKE=1 bash benchmarks/gpu.sh     # the same steps on this CPU at toy sizes (tests/bench/test_gpu_script.py)
#
# 1. check: fused / triton / chunked / dense in bf16 on CUDA vs the fp32 loss, every divergence, V=201,088 H=2,880;
#    and the bf16 GEMM rate of the projection itself (python -m topkd.bench.gpu check)
# 2. the projection benchmark at the paper's shapes, 8K..256K tokens, with liger-kernel's fused linear JSD and
#    torch's F.linear_cross_entropy beside ours (topkd bench loss; fresh process per point, OOM is a result)
# 3. the targets judged from both (python -m topkd.bench.gpu targets)
# liger-kernel is not on that machine: carry its wheel in .whl/ (see docs/scale-out.md, "GPU runs").
set -euo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ "${GPU_SMOKE:-0}" = 1 ]; then
    DEVICE=cpu; VOCAB=1031; HIDDEN=64; LENGTHS=257,1024; CHECK="--tokens 67 --gemm-tokens 64"; DENSE=257
    export TRITON_INTERPRET=1  # impl="triton" on CPU tensors, interpreted
else
    DEVICE=cuda; VOCAB=201088; HIDDEN=2880; LENGTHS=8192,32768,131072,262144; CHECK=""; DENSE=32768
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
fi
$PY -m topkd.bench.gpu check --device $DEVICE --vocab $VOCAB --hidden $HIDDEN $CHECK --out "$OUT/check.json"
# dense only where its [N, V] logits fit; the others at every length
$PY -m topkd.cli bench loss --device $DEVICE --dtype bfloat16 --vocab $VOCAB --hidden $HIDDEN --lengths $DENSE \
    --impls dense --out "$OUT/dense" --repeats 3
$PY -m topkd.cli bench loss --device $DEVICE --dtype bfloat16 --vocab $VOCAB --hidden $HIDDEN --lengths $LENGTHS \
    --impls fused,triton,chunked,liger_jsd,torch_lce --out "$OUT/loss" --repeats 3
$PY -m topkd.bench.gpu targets --loss "$OUT/loss/loss.json" --check "$OUT/check.json" --out "$OUT/targets.json"

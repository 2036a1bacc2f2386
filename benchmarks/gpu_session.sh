#!/usr/bin/env bash
# One prepared run on a CUDA machine: the GPU tests, then the CUDA rows of the speed benchmark
# (plain and DTensor parameters), every log under $OUT (default /tmp/lowp-gpu). Run from the
# repository root with a Python that has CUDA torch and triton; lowp runs from the checkout
# (PYTHONPATH), nothing is installed. About 6-9 minutes on an H100/H200.
#
#   OUT=/some/folder bash benchmarks/gpu_session.sh [pytest -k expression]
set -u -o pipefail
OUT=${OUT:-/tmp/lowp-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/machine.txt"

# the tests marked gpu (pyproject's addopts deselect them); -k narrows a rerun
$PY -m pytest -m gpu -o addopts="" -q -p no:cacheprovider --timeout=300 ${1:+-k "$1"} tests 2>&1 \
  | tee "$OUT/pytest_gpu.log"
tests=$?

# every parameter list of issue 31's table, torch's fused fp32 and bf16 AdamW as baselines
$PY benchmarks/step_vs_torch.py --device cuda --profile --markdown --steps 15 2>&1 | tee "$OUT/step_vs_torch_cuda.md"
$PY benchmarks/step_vs_torch.py --device cuda --dtensor --markdown --steps 15 2>&1 \
  | tee "$OUT/step_vs_torch_cuda_dtensor.md"
exit $tests

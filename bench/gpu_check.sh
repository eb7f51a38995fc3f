#!/usr/bin/env bash
# The GPU check of issue 5, as one script.
#
#   bench/gpu_check.sh prepare   # here, on the CPU machine: wheels the GPU image lacks, into .whl/
#   bench/gpu_check.sh run       # there (device tool: carry .whl): tests, drift, kernel matrix
#
# `run` needs no internet. It installs the carried wheels into /tmp/site, then runs:
#   - the triton backend's tests;
#   - the drift of every backend against the float64 reference over 4,096 tokens, with the
#     negative control;
#   - the kernel matrix, prefill and decode, fp32 and bf16, beside mamba-ssm's own step().
# It writes markdown into $OUT (the device tool's return folder), or docs/results/ without one.
# Copy the results into docs/results/ here, and declare the triton tolerances in
# scan/_tolerance.py from the drift table (until they are declared, the triton tests stop with
# "no declared tolerance").
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}

if [ "$mode" = prepare ]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  # The image (Python 3.12) has torch, triton, einops, numpy, safetensors, msgpack, hypothesis,
  # pytest; not pydantic, nor mamba-ssm.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE .venv/bin/python -m pip wheel -q --no-deps \
    --no-build-isolation -w .whl mamba-ssm==2.3.2.post1
  ls -la .whl
  exit 0
fi

out=${OUT:-docs/results}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "cannot install the carried wheels (bench/gpu_check.sh prepare first)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
stamp=$(date -u +%Y-%m-%d)
{
  echo "date $stamp"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
} | tee "$out/gpu-env.txt"
start=$(date +%s)
timeout 180 python3 bench/measure_drift.py --tokens 4096 --backends triton,chunked,reference --dtypes float32 \
  --device cuda --out "$out/drift-gpu-$stamp.md" > /dev/null; echo "drift: exit $? after $(( $(date +%s) - start )) s"
timeout 120 python3 -m pytest -q -x -rs -p no:cacheprovider tests/scan/test_triton.py tests/scan/test_triton_wiring.py \
  2>&1 | tail -25 | tee "$out/gpu-tests-$stamp.txt"; echo "tests: after $(( $(date +%s) - start )) s"
timeout 240 python3 bench/bench_kernels.py --device cuda --archs mamba2,mamba3,mamba1 --dtypes float32,bfloat16 \
  --lengths 1,2,4,8,16,32,64,128,256,512,1024,2048,4096 --batches 1,8,64,256 \
  --out "$out/kernels-gpu-$stamp.md" > /dev/null; echo "kernels: exit $? after $(( $(date +%s) - start )) s"
ls -la "$out"

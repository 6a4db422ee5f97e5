#!/usr/bin/env bash
# The GPU check of issue 8, in one run on one H200 (< 8 minutes, nothing downloaded):
#   1. the kernel tests compiled on the GPU (tests/kernels, the Triton-path model tests, gpu-marked ones too)
#   2. + 3. scripts/gpu_bench.py: HF equivalence in bf16 on a random-weight SmolLM2-shaped model, decode
#      tokens/s vs transformers generate (batch 1/32/128, with and without CUDA graphs), attention kernel
#      bandwidth vs a copy, and the 8B-shape roofline fraction, as JSON.
# Results land in $OUT (the device tool's folder) or ./gpu_check_out: tests.log, bench.json, bench.log.
#
# The H200 image has torch, triton and transformers but not msgspec or gguf, which worker/ imports:
# run scripts/gpu_wheels.sh where pip can reach PyPI first, and carry .whl with the tree.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-$PWD/gpu_check_out}
mkdir -p "$DEST"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$DEST/gpu.txt"
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__)" | tee -a "$DEST/gpu.txt"

echo "== kernel tests on the GPU"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -x --timeout 150 \
    tests/kernels tests/worker/test_models_triton.py 2>&1 | tee "$DEST/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark"
timeout 270 "$PY" scripts/gpu_bench.py --out "$DEST/bench.json" 2>&1 | tee "$DEST/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

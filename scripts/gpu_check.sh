#!/usr/bin/env bash
# The GPU check of issues 8 and 18, on one H200 (nothing downloaded), in sections:
#   tests   the kernel tests compiled on the GPU (tests/kernels, the Triton-path model tests, gpu-marked ones)
#   bench   scripts/gpu_bench.py: HF equivalence in bf16 on a random-weight SmolLM2-shaped model, decode
#           tokens/s vs transformers generate (batch 1/32/128, with and without CUDA graphs), attention
#           kernel bandwidth vs a copy, and the 8B-shape roofline fraction, as JSON (< 5 minutes)
#   serve   scripts/gpu_serve_check.py: `tierserve serve` on the device with default keys (HTTP in, SSE
#           out): single-stream and 64-concurrent tokens/s, the workers' start-up lines, and tp=1 on the
#           GPU against the CPU float32 engine (< 4 minutes)
# `scripts/gpu_check.sh` runs all three (about 9 minutes: over one device call's 10-minute limit with
# start-up, so run `gpu_check.sh tests bench` and `gpu_check.sh serve` as two calls, or one section).
# Results land in $OUT (the device tool's folder) or ./gpu_check_out: tests.log, bench.json, bench.log,
# serve.json, serve.log.
#
# The H200 image has torch, triton, transformers and tokenizers but not msgspec, gguf, pyzmq, starlette,
# uvicorn or OpenTelemetry, which worker/ and serve import: run scripts/gpu_wheels.sh where pip can reach
# PyPI first, and carry .whl with the tree.
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

SECTIONS=${*:-tests bench serve}
tests_rc=0 bench_rc=0 serve_rc=0
if [[ " $SECTIONS " == *" tests "* ]]; then
    echo "== kernel tests on the GPU"
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -x --timeout 150 \
        tests/kernels tests/worker/test_models_triton.py 2>&1 | tee "$DEST/tests.log"
    tests_rc=${PIPESTATUS[0]}
fi
if [[ " $SECTIONS " == *" bench "* ]]; then
    echo "== benchmark"
    timeout 270 "$PY" scripts/gpu_bench.py --out "$DEST/bench.json" 2>&1 | tee "$DEST/bench.log"
    bench_rc=${PIPESTATUS[0]}
fi
if [[ " $SECTIONS " == *" serve "* ]]; then
    echo "== tierserve serve on the device"
    timeout 240 "$PY" scripts/gpu_serve_check.py --out "$DEST/serve.json" 2>&1 | tee "$DEST/serve.log"
    serve_rc=${PIPESTATUS[0]}
fi

echo "gpu_check ($SECTIONS): tests rc=$tests_rc, bench rc=$bench_rc, serve rc=$serve_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$serve_rc" -eq 0 ]

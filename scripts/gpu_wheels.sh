#!/usr/bin/env bash
# Wheels for the H200 image (Python 3.12, x86-64), which has torch, triton, transformers, tokenizers,
# numpy, httpx, anyio, grpcio and requests (device/KINDS.md lists it) but not the rest of what the
# worker and `tierserve serve` import: msgspec, gguf, pyzmq, llguidance, starlette, uvicorn and
# OpenTelemetry. Run here, where pip reaches PyPI: each at the version this .venv holds, no
# dependencies (the image has the others; its glibc is 2.39, Python 3.12). gpu_check.sh installs them there from .whl (git-ignored:
# add `/.whl/` to .git/info/exclude, carry ".whl"; about 10 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
NAMES="msgspec gguf pyzmq llguidance starlette uvicorn protobuf googleapis-common-protos
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-grpc"
pins=$("$PY" - $NAMES <<'PYEOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PYEOF
)
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
ls -la .whl
du -sh .whl

#!/usr/bin/env bash
# Wheels for the H200 image (Python 3.12, x86-64), which lacks what worker/ imports besides torch:
# msgspec (wire/) and gguf (worker/models/store). Run here, where pip reaches PyPI; gpu_check.sh
# installs them there from .whl (git-ignored: add `/.whl/` to .git/info/exclude, carry ".whl").
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "msgspec==$("$PY" -c 'import msgspec; print(msgspec.__version__)')"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl \
    "gguf==$("$PY" -c 'from importlib.metadata import version; print(version("gguf"))')"
ls -la .whl

# syntax=docker/dockerfile:1
# tierserve for CPU nodes (gateway and worker alike). From the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t tierserve:cpu .
# Installed as the Makefile's bootstrap does, for serving: the CPU torch pin first, then the project
# (not editable, no dev extras); the embedded model is pulled into the image at build time.
FROM python:3.12-slim

# cc: the worker compiles its C kernels on first use (kernels/cpu/build.py); without one it says so
# and torch serves everything.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    TIERSERVE_CACHE=/var/lib/tierserve/models

# The Makefile's TORCH_CPU, from PyTorch's CPU index: PyPI's Linux wheel is the multi-GB CUDA build.
ARG TORCH=torch==2.13.0
RUN pip install --index-url https://download.pytorch.org/whl/cpu "$TORCH"

COPY pyproject.toml README.md /tmp/src/
COPY gateway /tmp/src/gateway
COPY worker /tmp/src/worker
COPY kernels /tmp/src/kernels
COPY policies /tmp/src/policies
COPY telemetry /tmp/src/telemetry
COPY wire /tmp/src/wire
COPY loadtest /tmp/src/loadtest
COPY tierserve /tmp/src/tierserve
RUN pip install /tmp/src && rm -rf /tmp/src

# The pods run as 10001 (deploy/base: runAsUser), which owns the model cache (kernels compile into it).
RUN useradd --uid 10001 --user-group --create-home --home-dir /var/lib/tierserve tierserve
USER 10001
WORKDIR /var/lib/tierserve
RUN tierserve models pull

EXPOSE 8000 5555
ENTRYPOINT ["tierserve"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# tierserve for NVIDIA GPU nodes (gateway and worker alike). From the repository root:
#   docker build -f deploy/docker/cuda.Dockerfile -t tierserve:cuda .
# As cpu.Dockerfile, with torch's CUDA build at the same pin (its wheels bring their CUDA libraries;
# the node brings the driver through the NVIDIA container toolkit).
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

# Triton compiles its launchers with cc against Python's headers when a kernel first runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    TIERSERVE_CACHE=/var/lib/tierserve/models

# The Makefile's torch pin (TORCH_CPU's version), the CUDA build from PyPI.
ARG TORCH=torch==2.13.0
RUN pip install "$TORCH"

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

RUN useradd --uid 10001 --user-group --create-home --home-dir /var/lib/tierserve tierserve
USER 10001
WORKDIR /var/lib/tierserve
RUN tierserve models pull

EXPOSE 8000 5555
ENTRYPOINT ["tierserve"]
CMD ["--help"]

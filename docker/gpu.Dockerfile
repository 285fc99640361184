# syntax=docker/dockerfile:1
# The GPU images: `engine` and `worker` share one CUDA + torch base (same host, same GPU, same wheels),
# so they are two targets of one file:  docker build -f docker/gpu.Dockerfile --target engine .
# The CUDA libraries come with the torch wheels (nvidia-* packages); the base image only provides the
# driver-compatible runtime layout, gcc (Triton compiles its launcher stubs at run time) and Python.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
# torch is pinned like pyproject.toml's engine extra; the wheel comes from PyTorch's CUDA index.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY benchmarks ./benchmarks
# torch is already satisfied by the CUDA wheel above (==2.13.0 matches 2.13.0+cu128); a mismatch
# between TORCH_VERSION and pyproject.toml fails here rather than pulling a second torch.
# The project itself (".[extra]"): its dependency pins live in pyproject.toml, not here.
# hadolint ignore=DL3013
RUN pip install ".[engine,worker]"
# The CPU executor's C++ extension, compiled once here (portable flags, ISA picked at run time) rather
# than at each container start; owned by the runtime user because torch takes a lock file beside it.
ENV TANDEM_EXT_DIR=/opt/tandem/ext
RUN python -m services.engine.moe.cpu_executor --build
COPY docker/healthcheck.py /usr/local/bin/tandem-healthcheck
RUN useradd --create-home --uid 10001 tandem \
    && mkdir -p /models /profiles \
    && chown -R tandem:tandem /models /profiles /opt/tandem
ENV TANDEM_PROFILES_DIR=/profiles \
    TANDEM_DEMO_DIR=/models/demo \
    HOME=/home/tandem
USER 10001

FROM base AS engine
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=6s --start-period=600s --retries=3 \
    CMD ["python", "/usr/local/bin/tandem-healthcheck", "http://127.0.0.1:8001/health"]
CMD ["tandem", "engine", "--device", "cuda", "--host", "0.0.0.0", "--port", "8001"]

FROM base AS worker
EXPOSE 9101
# --pool solo: one GPU benchmark at a time, in the process that serves the metrics.
HEALTHCHECK --interval=30s --timeout=6s --start-period=60s --retries=3 \
    CMD ["python", "/usr/local/bin/tandem-healthcheck", "http://127.0.0.1:9101/metrics"]
CMD ["celery", "-A", "services.profiler.app", "worker", "--pool", "solo", "--loglevel", "INFO"]

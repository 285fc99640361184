# syntax=docker/dockerfile:1
# The GPU images: `engine` and `worker` share one CUDA + torch base (same host, same GPU, same wheels),
# so they are two targets of one file:  docker build -f docker/gpu.Dockerfile --target engine .
#
# Python packages come only from the wheelhouse (`python3 scripts/wheelhouse.py` on the host, see
# deploy/README.md), bind-mounted for the two RUNs that install, so it adds nothing to the image and the
# build needs no Python index (the air-gapped path). torch is PyPI's 2.13.0: a CUDA 13.0 build whose CUDA
# libraries are wheels of their own (cuda-toolkit 13.0.3, cuDNN, NCCL), so one index serves every package
# and no CUDA library of the base image is used. The base is CUDA 13.0 anyway, to match: its
# NVIDIA_REQUIRE_CUDA makes the container toolkit refuse a driver too old for CUDA 13 (< 580) when the
# container starts, naming the reason, instead of torch failing later. The CI test builds this same file
# from a Debian stand-in base (tests/deploy/compose.ci.yml).
ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

FROM ${BASE_IMAGE} AS base
# The wheelhouse directory in the build context (scripts/wheelhouse.py --dest).
ARG WHEELHOUSE=wheelhouse
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# gcc at run time too: Triton compiles its launcher stubs when a kernel first runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ \
    && rm -rf /var/lib/apt/lists/*
# Third-party packages first, pinned by the wheelhouse's engine.txt: this layer (torch, GBs with CUDA)
# stays cached while the code changes.
RUN --mount=type=bind,source=${WHEELHOUSE},target=/wheelhouse \
    if [ ! -f /wheelhouse/engine.txt ]; then \
        echo "${WHEELHOUSE}/engine.txt is missing: run python3 scripts/wheelhouse.py first (deploy/README.md)" >&2; \
        exit 1; \
    fi \
    && python3 -m venv /opt/venv \
    && pip install --no-index --find-links /wheelhouse -r /wheelhouse/engine.txt
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY benchmarks ./benchmarks
# The project itself, editable: the C++ sources stay beside the code that compiles them. Its extras are
# resolved against what is installed, so a wheelhouse older than pyproject.toml fails here, naming the
# missing package.
RUN --mount=type=bind,source=${WHEELHOUSE},target=/wheelhouse \
    pip install --no-index --find-links /wheelhouse -e ".[engine,worker]" \
    && pip check
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

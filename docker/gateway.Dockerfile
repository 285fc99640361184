# syntax=docker/dockerfile:1
# The gateway image: OpenAI API, tokenizers and templates, no torch (pyproject `gateway` extra).
# Python packages come only from the wheelhouse (scripts/wheelhouse.py; see docker/gpu.Dockerfile).
ARG BASE_IMAGE=python:3.12.8-slim-bookworm

FROM ${BASE_IMAGE}
ARG WHEELHOUSE=wheelhouse
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN --mount=type=bind,source=${WHEELHOUSE},target=/wheelhouse \
    if [ ! -f /wheelhouse/gateway.txt ]; then \
        echo "${WHEELHOUSE}/gateway.txt is missing: run python3 scripts/wheelhouse.py first (deploy/README.md)" >&2; \
        exit 1; \
    fi \
    && python3 -m venv /opt/venv \
    && pip install --no-index --find-links /wheelhouse -r /wheelhouse/gateway.txt
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
# The project itself (see docker/gpu.Dockerfile); torch must not have come with it.
RUN --mount=type=bind,source=${WHEELHOUSE},target=/wheelhouse \
    pip install --no-index --find-links /wheelhouse -e ".[gateway]" \
    && pip check \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
COPY docker/healthcheck.py /usr/local/bin/tandem-healthcheck
RUN useradd --create-home --uid 10001 tandem
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=6s --start-period=30s --retries=3 \
    CMD ["python", "/usr/local/bin/tandem-healthcheck", "http://127.0.0.1:8000/health"]
CMD ["tandem", "gateway", "--host", "0.0.0.0", "--port", "8000"]

# syntax=docker/dockerfile:1
# The gateway image: OpenAI API, tokenizers and templates, no torch (pyproject `gateway` extra).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
# The project itself (".[extra]"): its dependency pins live in pyproject.toml, not here.
# hadolint ignore=DL3013
RUN pip install ".[gateway]" \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
COPY docker/healthcheck.py /usr/local/bin/tandem-healthcheck
RUN useradd --create-home --uid 10001 tandem
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=6s --start-period=30s --retries=3 \
    CMD ["python", "/usr/local/bin/tandem-healthcheck", "http://127.0.0.1:8000/health"]
CMD ["tandem", "gateway", "--host", "0.0.0.0", "--port", "8000"]

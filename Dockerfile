# llmgw's services in one image: llmgw, llmgw-placement, llmgw-installer,
# llmgw-launcher, llmgw-gateway (compose.yaml picks the command). Any Debian-like base with
# Python 3.11+ and its venv module does: `--build-arg BASE_IMAGE=...` (the test
# suite builds on an image made from Debian packages, as nothing can be pulled there).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG UV_VERSION=0.13.8
# uv in a virtual environment of its own: the base's pip may be missing, or
# refuse to install into the system Python (PEP 668, Debian's python3).
RUN python3 -m venv /opt/uv \
    && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
    && ln -s /opt/uv/bin/uv /usr/local/bin/uv

WORKDIR /opt/llmgw
ENV UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON_PREFERENCE=only-system \
    UV_PROJECT_ENVIRONMENT=/opt/llmgw/.venv \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/llmgw/.venv/bin:$PATH

# Dependencies first, from the lock and the workspace's manifests only, so that
# a change to llmgw's source reuses this layer. Every workspace member's
# pyproject.toml is listed here (tests/test_containers.py checks).
COPY pyproject.toml uv.lock ./
COPY libs/llmgw_core/pyproject.toml libs/llmgw_core/
COPY services/installer/pyproject.toml services/installer/
COPY services/launcher/pyproject.toml services/launcher/
COPY services/placement/pyproject.toml services/placement/
COPY services/gateway/pyproject.toml services/gateway/
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-group engines --no-install-workspace

COPY . .
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-group engines

# Not root. The directories that compose mounts volumes on belong to llmgw, so
# a fresh named volume does too (Docker and podman copy the mount point's owner).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/llmgw --shell /usr/sbin/nologin llmgw \
    && mkdir -p /var/lib/llmgw /auth \
    && chown llmgw:llmgw /var/lib/llmgw /auth
USER llmgw

# Healthy when the service's own HTTP endpoint answers: placement's /healthz by
# default; set LLMGW_HEALTH_URL for another service (compose.yaml spells out each).
ENV LLMGW_HEALTH_URL=http://127.0.0.1:8080/healthz
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['LLMGW_HEALTH_URL'], timeout=2)"]

CMD ["llmgw", "--help"]

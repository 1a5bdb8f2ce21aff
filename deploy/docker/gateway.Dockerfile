# syntax=docker/dockerfile:1
# The gateway, and the one-shot `flatfare migrate`: Flatfare's wheel and its own dependencies, no vLLM, no torch.
# Build from the repository root: docker build -f deploy/docker/gateway.Dockerfile -t flatfare-gateway .

# Flatfare's wheel, built from the source as `pip wheel --no-deps .` builds it on a checkout
# (tests/deploy/test_wheel.py builds it from these same files). The image gets the wheel, not the tree.
FROM python:3.11-slim AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY flatfare ./flatfare
COPY gateway ./gateway
COPY workers ./workers
COPY billing ./billing
COPY fleet ./fleet
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/flatfare-*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --home-dir /app flatfare

USER flatfare
# Metric files of the gateway processes (emptied at each start) and the data folder live in /tmp,
# so the root filesystem may be read-only.
ENV FLATFARE_HOST=0.0.0.0 \
    FLATFARE_PORT=8000 \
    FLATFARE_DATA_DIR=/tmp/flatfare \
    FLATFARE_METRICS_DIR=/tmp/flatfare-metrics \
    FLATFARE_LOG_FORMAT=json
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["flatfare"]
CMD ["gateway", "--processes", "2"]

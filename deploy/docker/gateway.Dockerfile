# syntax=docker/dockerfile:1
# The gateway, and the one-shot `flatfare migrate`: Flatfare and its own dependencies, no vLLM, no torch.
# Build from the repository root: docker build -f deploy/docker/gateway.Dockerfile -t flatfare-gateway .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY flatfare ./flatfare
COPY gateway ./gateway
COPY workers ./workers
COPY billing ./billing
COPY migrations ./migrations
# Editable: `flatfare migrate` finds migrations/ beside the source tree.
RUN pip install -e . && useradd --system --uid 10001 --home-dir /app flatfare

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

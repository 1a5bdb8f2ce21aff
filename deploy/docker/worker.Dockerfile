# syntax=docker/dockerfile:1
# A GPU worker on the official vLLM image (CUDA, torch and vLLM as vLLM ships them).
# Build from the repository root: docker build -f deploy/docker/worker.Dockerfile -t flatfare-worker .
# VLLM_IMAGE pins the vLLM release; Flatfare supports vLLM 0.26 to 0.32.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0

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

FROM ${VLLM_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY --from=wheel /wheels /wheels
# The image's vLLM satisfies the `gpu` extra: pip keeps it and adds only what Flatfare needs besides.
RUN wheel=$(echo /wheels/flatfare-*.whl) \
    && python3 -m pip install "${wheel}[gpu]" \
    && rm -rf /wheels \
    && python3 -c "import vllm, flatfare.cli.main; print('vLLM', vllm.__version__)"

# Models (and the Hugging Face cache) in a volume, so a restart does not download them again.
ENV FLATFARE_DATA_DIR=/data \
    FLATFARE_MODELS_DIR=/models \
    HF_HOME=/models/huggingface \
    FLATFARE_METRICS_HOST=0.0.0.0 \
    FLATFARE_METRICS_PORT=9400 \
    FLATFARE_LOG_FORMAT=json \
    VLLM_NO_USAGE_STATS=1
EXPOSE 9400
# The vLLM image's entrypoint is `vllm serve`; a Flatfare worker embeds the engine instead.
ENTRYPOINT ["flatfare"]
CMD ["worker"]
